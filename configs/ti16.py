r"""ViT-Ti/16 (DeiT-Tiny size, 5.7M params) trained from scratch.

    python train.py --config configs/ti16.py --workdir /tmp/ti16           # CIFAR-10
    python train.py --config configs/ti16.py:cifar100,224 --workdir /tmp/ti16_c100

torchvision releases no Ti weights, so this is the DeiT-style from-scratch
recipe (AdamW, RandAugment, mixup, label smoothing; 30k steps of 512).
Expected (not measured on this project's CPU machine): well below the
fine-tuned sizes; ViTs from scratch on CIFAR typically reach 80-90%.
``--config.init_weights=/path/to.pth`` fine-tunes a torchvision-layout
state dict of the same size instead.
"""

from configs import common


def get_config(arg=None):
  return common.vit_recipe(arg, "vit_ti_16", None)
