r"""ViT-L/16 fine-tuned from torchvision's IMAGENET1K_V1 weights.

    python train.py --config configs/l16.py --workdir /tmp/l16             # CIFAR-10
    python train.py --config configs/l16.py:cifar100,384 --workdir /tmp/l16_c100

Same recipe as ``b16.py`` (SGD momentum 0.9, clip 1.0, warmup + cosine,
batch 512), with scanned layers, rematerialisation and FSDP over every
device so the 304M parameters and their momentum fit. Expected (not measured
on this project's CPU machine): about 98-99% on CIFAR-10.
"""

from configs import common


def get_config(arg=None):
  c = common.vit_recipe(arg, "vit_l_16", "IMAGENET1K_V1")
  c.model.scan_layers = True
  c.model.remat_policy = "dots"
  c.fsdp = -1
  return c
