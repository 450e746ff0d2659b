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
  tokens = [t.strip() for t in (arg or "").split(",") if t.strip()]
  size = next((t for t in tokens if t in SIZES), "b")
  probe = "probe" in tokens
  rest = ",".join(t for t in tokens if t not in SIZES and t != "probe")
  dataset, res, _ = common.parse_arg(rest)
  name = f"vit_{SIZES[size]}_patch14_reg4_dinov2"

  c = common.get_config()
  d = common.DATASETS.get(dataset, dict(train_split="train", eval_split="test",
                                        steps=10_000, eval_crop_fraction=0.875))
  c.dataset = dataset
  c.train_split, c.eval_split = d["train_split"], d["eval_split"]
  c.image_size = res or 224
  c.pp.eval_crop_fraction = d["eval_crop_fraction"]
  c.pp.crop = "inception"
  c.pp.flip = True
  c.model_name = name  # timm's: gives what the keys cannot (activation, eps)
  c.init_weights = f"hf-hub:timm/{name}.lvd142m"
  c.model.dtype = "bfloat16"
  c.batch_size = 512
  c.eval_batch_size = 512
  c.total_steps = d["steps"]
  c.warmup_steps = 500
  c.schedule = "cosine"
  c.grad_clip_norm = 1.0
  c.log_every = 50
  c.eval_every = 1000
  c.checkpoint_every = 1000
  if probe:
    c.linear_probe = True
    c.optimizer = "sgd"
    c.momentum = 0.9
    c.learning_rate = 0.01
    c.weight_decay = 0.0
  else:
    c.optimizer = "adamw"
    c.learning_rate = 5e-5 * c.batch_size / 256
    c.weight_decay = 0.05
    c.b2 = 0.999
    c.layer_decay = 0.75
    c.model.drop_path_rate = 0.1
    c.label_smoothing = 0.1
    c.pp.randaugment_layers = 2
    c.pp.randaugment_magnitude = 9
  return c
