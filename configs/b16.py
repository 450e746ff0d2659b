r"""python train.py --config configs/b16.py --workdir /tmp/b16

Expected (the ViT paper's fine-tuning recipe; not measured on this project's
CPU-only machine): about 98% CIFAR-10 test accuracy after the 10k steps at
224 (the paper reports about 98% / 87% on CIFAR-10 / CIFAR-100 for B/16
pre-trained on ImageNet-1k); ``:imagenet2012`` stays near torchvision's
81.1% top-1. From ``scratch`` on CIFAR expect far less (ViTs need
pre-training).

ViT-B/16 fine-tuned from torchvision's IMAGENET1K_V1 weights (through
``vit_jax.convert``): SGD momentum 0.9, global-norm clip 1.0, batch 512, 500
warmup steps + cosine, zero-initialised head, bfloat16 compute with float32
parameters. Other forms::

    python train.py --config configs/b16.py:cifar100,384 --workdir /tmp/b16_c100
    python train.py --config configs/b16.py:imagenet2012 --workdir /tmp/b16_in
    python train.py --config configs/b16.py:cifar10,scratch --workdir /tmp/b16_s
    python train.py --config configs/b16.py --config.dataset=folder:/data/pets ...

Argument (``file.py:arg``, comma separated): a TFDS name (``cifar10``
default, ``cifar100``, ``imagenet2012``, any other, or ``folder:/path``), a
resolution (``224`` default, ``384``: the position embedding is resampled
bicubically like torchvision's ``interpolate_embeddings``), ``scratch``.
``--config.init_weights=/path/vit_b_16.pth`` uses a local torchvision state
dict instead of downloading the released one. A tiny CPU smoke run::

    python train.py --config configs/b16.py --workdir /tmp/b16_smoke \
      --config.dataset=digits --config.image_size=32 --config.batch_size=8 \
      --config.eval_batch_size=8 --config.total_steps=4 \
      --config.model.dtype=float32 --config.init_weights=/tmp/vit_b_16.pth
"""

from configs import common


def get_config(arg=None):
  return common.vit_recipe(arg, "vit_b_16", "IMAGENET1K_V1")
