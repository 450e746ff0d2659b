r"""python train.py --config configs/s16.py --workdir /tmp/s16

Expected (not measured on this project's CPU-only machine): DeiT-S reaches
79.8% ImageNet top-1 with its 300-epoch recipe; the 30k steps here
(``configs/s16.py:imagenet2012``) are a shorter budget, so expect less. On
CIFAR-10 from scratch, roughly 85-90%.

ViT-S/16 (DeiT-Small size, 22M parameters) from scratch: torchvision
releases no S weights, so this is the DeiT-style recipe of
``configs/common.vit_recipe`` (AdamW, RandAugment, mixup, label smoothing,
drop path). Takes the same argument as ``b16.py``.
"""

from configs import common


def get_config(arg=None):
  return common.vit_recipe(arg, "vit_s_16", None)
