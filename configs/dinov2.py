r"""python train.py --config configs/dinov2.py --workdir /tmp/dinov2

Fine-tunes DINOv2 with registers (``timm/vit_base_patch14_reg4_dinov2.lvd142m``
from the Hugging Face Hub, read as safetensors; any ``weights.load`` source
works through ``--config.init_weights``) on CIFAR-10 at 224 px: the weights
decide the architecture (4 registers, LayerScale, patch 14; the position
embedding is resampled from 518 px to 224 px as timm does) and the
normalisation (ImageNet statistics).

Expected: not measured on this project's CPU-only machine. The DINOv2 paper
reports linear probes of its frozen features near 99% top-1 on CIFAR-10 for
its larger models; full fine-tuning should do at least as well.

Two recipes (argument ``file.py:arg``, comma separated):

* full fine-tuning (default): AdamW (wd 0.05), layer-wise learning-rate decay
  0.75 (``config.layer_decay``: the last block learns at the peak rate, block
  ``i`` at ``0.75 ** (depth - i)`` of it), drop path 0.1, label smoothing 0.1,
  RandAugment 2/9, 500 warmup steps + cosine, bfloat16 compute;
* ``probe``: a linear probe (``config.linear_probe``: only the zero-initialised
  head learns; the backbone is frozen), SGD momentum 0.9, no augmentation
  beyond the random resized crop and flip.

Other tokens: ``s`` / ``b`` (default) / ``l`` for the size, a TFDS name
(``cifar10`` default, ``cifar100``, ``imagenet2012``, ``folder:/path``), a
resolution (a multiple of 14; ``224`` default)::

    python train.py --config configs/dinov2.py:l,cifar100,probe --workdir /tmp/l_probe

A CPU smoke run on random stand-in weights (timm's architecture, no
download), about a minute on 2 cores::

    python -c "import timm; from safetensors.torch import save_file; \
      save_file(timm.create_model('vit_small_patch14_reg4_dinov2', depth=2, \
      img_size=56).state_dict(), '/tmp/dinov2_s_random.safetensors')"
    python train.py --config configs/dinov2.py:s,digits,56 --workdir /tmp/dinov2_smoke \
      --config.init_weights=/tmp/dinov2_s_random.safetensors \
      --config.batch_size=16 --config.eval_batch_size=64 --config.total_steps=20 \
      --config.warmup_steps=5 --config.eval_every=10 --config.log_every=5 \
      --config.model.dtype=float32
"""

from configs import common

SIZES = {"s": "small", "b": "base", "l": "large"}


def get_config(arg=None):
  return common.self_supervised_recipe(
      arg, config_file="configs/dinov2.py", sizes=SIZES,
      name="vit_{size}_patch14_reg4_dinov2", tag="lvd142m", patch=14)
