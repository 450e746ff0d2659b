r"""python train.py --config configs/l16.py --workdir /tmp/l16

Expected (not measured on this project's CPU-only machine): about 98-99%
CIFAR-10 test accuracy; torchvision reports 79.7% ImageNet top-1 for these
weights.

ViT-L/16 fine-tuned from torchvision's IMAGENET1K_V1 weights with the
``b16.py`` recipe (SGD momentum 0.9, clip 1.0, warmup + cosine, batch 512),
plus scanned layers, rematerialisation and FSDP over every device so the
304M parameters and their momentum fit. Takes the same argument as
``b16.py`` (``configs/l16.py:cifar100,384``).
"""

from configs import common


def get_config(arg=None):
  c = common.vit_recipe(arg, "vit_l_16", "IMAGENET1K_V1")
  c.model.scan_layers = True
  c.model.remat_policy = "dots"
  c.fsdp = -1
  return c
