r"""ViT-S/16 (DeiT-Small size, 22M params) trained from scratch.

    python train.py --config configs/s16.py --workdir /tmp/s16             # CIFAR-10
    python train.py --config configs/s16.py:imagenet2012 --workdir /tmp/s16_in

torchvision releases no S weights, so this is the DeiT-style from-scratch
recipe (AdamW, RandAugment, mixup, label smoothing). Expected (not measured
on this project's CPU machine): DeiT-S reaches 79.8% on ImageNet with its
300-epoch recipe; the 30k steps here are a shorter budget.
"""

from configs import common


def get_config(arg=None):
  return common.vit_recipe(arg, "vit_s_16", None)
