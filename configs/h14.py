r"""python train.py --config configs/h14.py --workdir /tmp/h14

Expected (not measured on this project's CPU-only machine): above 99%
CIFAR-10 test accuracy; torchvision reports 85.7% ImageNet top-1 for these
weights.

ViT-H/14 fine-tuned from torchvision's IMAGENET1K_SWAG_LINEAR_V1 weights
(SWAG: Instagram pre-training, 633M parameters, at 224) with the ``b16.py``
recipe, plus scanned layers, full rematerialisation and FSDP over every
device. Takes the same argument as ``b16.py``
(``configs/h14.py:imagenet2012``).
"""

from configs import common


def get_config(arg=None):
  c = common.vit_recipe(arg, "vit_h_14", "IMAGENET1K_SWAG_LINEAR_V1")
  c.model.scan_layers = True
  c.model.remat_policy = "full"
  c.fsdp = -1
  return c
