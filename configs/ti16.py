r"""python train.py --config configs/ti16.py --workdir /tmp/ti16

Expected (not measured on this project's CPU-only machine): well below the
fine-tuned sizes; ViTs trained from scratch on CIFAR-10 typically reach
80-90%.

ViT-Ti/16 (DeiT-Tiny size, 5.7M parameters) from scratch: torchvision
releases no Ti weights, so this is the DeiT-style recipe of
``configs/common.vit_recipe`` (AdamW, RandAugment, mixup, label smoothing,
drop path; 30k steps of 512). Takes the same argument as ``b16.py``
(``configs/ti16.py:cifar100,224``). ``--config.init_weights=/path/to.pth``
fine-tunes a torchvision-layout state dict of this size instead.
"""

from configs import common


def get_config(arg=None):
  return common.vit_recipe(arg, "vit_ti_16", None)
