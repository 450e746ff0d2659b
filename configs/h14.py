r"""ViT-H/14 fine-tuned from torchvision's IMAGENET1K_SWAG_LINEAR_V1 weights.

    python train.py --config configs/h14.py --workdir /tmp/h14             # CIFAR-10
    python train.py --config configs/h14.py:imagenet2012 --workdir /tmp/h14_in

torchvision's only H/14 weights are SWAG (Instagram pre-training, 633M
parameters); the LINEAR_V1 variant runs at 224. Same fine-tuning recipe as
``b16.py``, with scanned layers, full rematerialisation and FSDP over every
device. Expected (not measured on this project's CPU machine): above 99% on
CIFAR-10; torchvision reports 85.7% ImageNet top-1 for these weights.
"""

from configs import common


def get_config(arg=None):
  c = common.vit_recipe(arg, "vit_h_14", "IMAGENET1K_SWAG_LINEAR_V1")
  c.model.scan_layers = True
  c.model.remat_policy = "full"
  c.fsdp = -1
  return c
