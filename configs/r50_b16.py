r"""python train.py --config configs/r50_b16.py --workdir /tmp/r50_b16

Expected (not measured on this project's CPU-only machine):
google-research/vision_transformer reports 98.72% CIFAR-10, 90.88% CIFAR-100
and 83.72% ImageNet top-1 (dropout 0) fine-tuning its ImageNet-21k
R50+ViT-B/16 at 384 px with this recipe's optimiser (``:cifar10,384``); at the
default 224 px expect somewhat less.

The ViT paper's hybrid: a ResNet-50 stem ((3, 4, 9) bottleneck units, /16)
before the 1x1 patch embedding of ViT-B. Fine-tuned from timm's copy of
Google's ImageNet-21k weights (``vit_base_r50_s16_224.orig_in21k``, from the
Hugging Face Hub; no head: a fresh zero head) with the ``b16.py`` recipe:
SGD momentum 0.9, global-norm clip 1.0, batch 512, 500 warmup steps + cosine,
bfloat16 compute. Takes the same argument as ``b16.py``
(``configs/r50_b16.py:cifar100,384``, ``:imagenet2012``).

Google's own file works as well and computes exactly as Google's module
(its weight standardisation and GroupNorm constants, tanh GELU)::

    python train.py --config configs/r50_b16.py --workdir /tmp/r50_b16 \
      --config.init_weights=/path/to/imagenet21k/R50+ViT-B_16.npz

A CPU smoke run on random stand-in weights (timm's architecture, 2 blocks, no
download)::

    python -c "import timm; from safetensors.torch import save_file; \
      save_file(timm.create_model('vit_base_r50_s16_224', depth=2, \
      img_size=64).state_dict(), '/tmp/r50_b16_random.safetensors')"
    python train.py --config configs/r50_b16.py:digits,64 --workdir /tmp/r50_smoke \
      --config.init_weights=/tmp/r50_b16_random.safetensors \
      --config.batch_size=8 --config.eval_batch_size=8 --config.total_steps=4 \
      --config.warmup_steps=1 --config.model.dtype=float32
"""

from configs import common


def get_config(arg=None):
  return common.vit_recipe(arg, "vit_base_r50_s16_224",
                           "vit_base_r50_s16_224.orig_in21k")
