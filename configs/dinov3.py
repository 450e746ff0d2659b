r"""python train.py --config configs/dinov3.py --workdir /tmp/dinov3

Fine-tunes DINOv3 (``timm/vit_base_patch16_dinov3.lvd1689m`` from the Hugging
Face Hub, read as safetensors; any ``weights.load`` source works through
``--config.init_weights``, e.g. the original
``hf-hub:facebook/dinov3-vitb16-pretrain-lvd1689m``) on CIFAR-10 at 224 px:
the weights and timm's name decide the architecture (RoPE with periods of
base 100, 4 registers, LayerScale, patch 16, no learned position embedding:
any resolution that is a multiple of 16 runs without resampling anything;
the mean of the patch tokens is pooled, as timm's default) and the
normalisation (ImageNet statistics).

Expected: not measured on this project's CPU-only machine. The DINOv3 paper
reports linear probes of its frozen ViT-B/16 features near 99% top-1 on
CIFAR-10; full fine-tuning should do at least as well.

Two recipes (argument ``file.py:arg``, comma separated):

* full fine-tuning (default): AdamW (wd 0.05), layer-wise learning-rate decay
  0.75 (``config.layer_decay``), drop path 0.1, label smoothing 0.1,
  RandAugment 2/9, 500 warmup steps + cosine, bfloat16 compute;
* ``probe``: a linear probe (``config.linear_probe``: only the zero-initialised
  head learns; the backbone is frozen), SGD momentum 0.9.

Other tokens: ``s`` / ``splus`` / ``b`` (default) / ``l`` / ``hplus`` for the
size (S+ and H+ have SwiGLU MLPs), a TFDS name (``cifar10`` default,
``cifar100``, ``imagenet2012``, ``folder:/path``), a resolution (a multiple
of 16; ``224`` default)::

    python train.py --config configs/dinov3.py:l,cifar100,probe --workdir /tmp/l_probe

A CPU smoke run on random stand-in weights (timm's architecture, no
download), about a minute on 2 cores::

    python -c "import timm; from safetensors.torch import save_file; \
      save_file(timm.create_model('vit_small_patch16_dinov3', depth=2, \
      num_classes=0).state_dict(), '/tmp/dinov3_s_random.safetensors')"
    python train.py --config configs/dinov3.py:s,digits,64 --workdir /tmp/dinov3_smoke \
      --config.init_weights=/tmp/dinov3_s_random.safetensors \
      --config.batch_size=16 --config.eval_batch_size=64 --config.total_steps=20 \
      --config.warmup_steps=5 --config.eval_every=10 --config.log_every=5 \
      --config.model.dtype=float32
"""

from configs import common

SIZES = {"s": "small", "splus": "small_plus", "b": "base", "l": "large",
         "hplus": "huge_plus"}


def get_config(arg=None):
  return common.self_supervised_recipe(
      arg, config_file="configs/dinov3.py", sizes=SIZES,
      name="vit_{size}_patch16_dinov3", tag="lvd1689m", patch=16)
