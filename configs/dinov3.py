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
  tokens = [t.strip() for t in (arg or "").split(",") if t.strip()]
  size = next((t for t in tokens if t in SIZES), "b")
  probe = "probe" in tokens
  rest = ",".join(t for t in tokens if t not in SIZES and t != "probe")
  dataset, res, _ = common.parse_arg(rest)
  if res is not None and res % 16:
    raise ValueError(f"configs/dinov3.py: resolution {res} is not a multiple "
                     f"of the patch size 16")
  name = f"vit_{SIZES[size]}_patch16_dinov3"

  c = common.get_config()
  d = common.DATASETS.get(dataset, dict(train_split="train", eval_split="test",
                                        steps=10_000, eval_crop_fraction=0.875))
  c.dataset = dataset
  c.train_split, c.eval_split = d["train_split"], d["eval_split"]
  c.image_size = res or 224
  c.pp.eval_crop_fraction = d["eval_crop_fraction"]
  c.pp.crop = "inception"
  c.pp.flip = True
  c.model_name = name  # timm's: gives what the keys cannot (RoPE, eps)
  c.init_weights = f"hf-hub:timm/{name}.lvd1689m"
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
