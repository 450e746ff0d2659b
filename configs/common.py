"""The base training config every recipe starts from.

A recipe (``configs/b16.py``, ``configs/digits.py``...) calls
:func:`get_config`, overrides a few fields and returns the config; ``train.py``
locks it, so ``--config.some_feild=1`` (a typo) is an error. Time-like
settings are in steps. Overriding ``total_steps`` alone gives a working short
run: the warmup is clamped to the run (``vit_jax.train.optim.warmup_steps``), the last
step always logs, evaluates and checkpoints.
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0

  # ---------------------------------------------------------------- data
  # A TFDS name ('cifar10', 'imagenet2012', 'digits'...), 'folder:/path' or
  # an existing directory laid out as <dir>/<split>/<label>/<image>.
  c.dataset = "digits"
  c.data_dir = config_dict.placeholder(str)  # None: TFDS's default
  c.download = True  # download a missing dataset (fails fast offline)
  c.train_split = "train"
  c.eval_split = "test"
  c.image_size = 224
  c.shuffle_buffer = 50_000
  c.cache = False  # keep the (encoded) examples in memory after one pass
  c.prefetch = 2

  c.pp = ml_collections.ConfigDict()
  c.pp.crop = "inception"  # 'inception' | 'random_crop' | 'resize'
  c.pp.crop_scale = (0.08, 1.0)  # inception crop: area range
  c.pp.crop_ratio = (3 / 4, 4 / 3)  # inception crop: aspect ratio range
  c.pp.crop_padding = 4  # random_crop: resize, zero-pad this much, crop
  c.pp.flip = True
  c.pp.eval_crop_fraction = 0.875  # eval: resize to size/fraction, crop size
  c.pp.randaugment_layers = 0  # 0 = off; e.g. 2
  c.pp.randaugment_magnitude = 10  # 0..30
  c.pp.mixup_alpha = 0.0  # 0 = off; e.g. 0.2
  # Normalisation in [0, 1] pixel units; None: the initial weights' own
  # (ImageNet statistics for torchvision weights), else 0.5 / 0.5.
  c.pp.mean = config_dict.placeholder(tuple)
  c.pp.std = config_dict.placeholder(tuple)
  # NaFlex (a NaFlex model: SigLIP 2 NaFlex weights, or from scratch with
  # SigLIP 2's grid resize): None = square image_size batches; a tuple of
  # sequence lengths, e.g. (64, 144): every image keeps its aspect ratio
  # within the step's length (one drawn per step from (seed, step); the
  # jitted step compiles once per length), evaluation at the longest.
  c.naflex_seq_lens = config_dict.placeholder(tuple)

  # ---------------------------------------------------------------- model
  c.model_name = "vit_b_16"  # vit_{ti,s,b,l,h}_{patch}
  c.model = ml_collections.ConfigDict()
  # Sizes; None: the model_name's. Fine-tuning (init_weights), the weights
  # decide the architecture: a recipe's model_name and sizes are used only
  # where they describe the weights. Set on the command line they are
  # applied: patch_size resamples the patch embedding (FlexiViT), num_heads
  # gives the heads weights do not store (a custom width); a size the
  # weights contradict is refused, naming both.
  c.model.patch_size = config_dict.placeholder(int)
  c.model.hidden_size = config_dict.placeholder(int)
  c.model.num_layers = config_dict.placeholder(int)
  c.model.num_heads = config_dict.placeholder(int)
  c.model.mlp_dim = config_dict.placeholder(int)
  c.model.dtype = "float32"  # compute dtype; 'bfloat16' for mixed precision
  c.model.dropout_rate = 0.0
  c.model.attention_dropout_rate = 0.0
  c.model.drop_path_rate = 0.0
  c.model.classifier = "token"
  c.model.representation_size = config_dict.placeholder(int)
  c.model.scan_layers = False
  c.model.remat_policy = ""  # '', 'full', 'dots', 'dots_no_batch', 'nothing'
  c.model.head_bias_init = 0.0
  # Attention kernel: None lets the backend choose (vit_jax.models.kernels.
  # choose_attention: cuDNN fused attention on GPU with bfloat16/float16,
  # XLA elsewhere, the matmul kernel on CPU); or 'matmul' | 'xla' | 'cudnn'.
  c.model.attention_impl = config_dict.placeholder(str)

  # Initial weights: '' = from scratch; anything vit_jax.weights.load reads
  # (a .pth / .safetensors / .npz file, a Hugging Face directory,
  # hf-hub:org/name, a workdir, a pretrained name, a torchvision weights
  # name such as 'IMAGENET1K_V1'). They decide the architecture (and, unless
  # pp.mean / pp.std are set, the normalisation); see the model sizes above.
  c.init_weights = ""
  c.reset_head = True  # fresh zero head for fine-tuning (always if classes differ)

  # ---------------------------------------------------------------- optim
  c.optimizer = "adamw"  # 'adamw' | 'sgd' (momentum)
  c.learning_rate = 1e-3
  c.schedule = "cosine"  # 'cosine' | 'linear' | 'constant' (after warmup)
  c.warmup_steps = 500
  c.end_learning_rate_factor = 0.0  # final lr = factor * learning_rate
  c.total_steps = 10_000
  c.weight_decay = 0.0  # decoupled; applied to kernels only
  c.momentum = 0.9  # sgd
  c.nesterov = False  # sgd
  c.b1 = 0.9  # adamw
  c.b2 = 0.999  # adamw
  c.grad_clip_norm = 1.0  # 0 = no clipping
  c.label_smoothing = 0.0
  # Layer-wise learning-rate decay: block i of L learns at rate
  # layer_decay ** (L - i) (1.0 = off; 0.65-0.9 to fine-tune DeiT-III/DINOv2).
  c.layer_decay = 1.0
  c.linear_probe = False  # train the head only (frozen backbone)
  c.batch_size = 512  # global, per optimizer step
  c.grad_accum_steps = 1  # micro-batches per step (batch_size / this each)
  c.eval_batch_size = 512  # global

  # ---------------------------------------------------------------- mesh
  # Size of the 'fsdp' mesh axis: parameters and optimizer state are sharded
  # over it (1 = pure data parallel, -1 = all devices).
  c.fsdp = 1

  # ---------------------------------------------------------------- processes
  # Seconds one process waits for the others at any one point (a step's
  # all-reduce, evaluation, a checkpoint's barriers or commit, start-up,
  # exit) before it stops with an error naming the step and what it waited
  # for (0: no limit). It must cover the spread of compile and data start-up
  # times between processes.
  c.peer_timeout_seconds = 300

  # ---------------------------------------------------------------- logging
  c.log_every = 50
  c.eval_every = 1000
  c.checkpoint_every = 1000
  c.keep_checkpoints = 3
  c.async_checkpointing = True
  # None: resume from the newest intact checkpoint in the workdir (damaged
  # ones are set aside); N: from step N (newer ones are set aside); 0: start
  # afresh (every checkpoint is set aside, in <workdir>/checkpoints.set_aside).
  c.resume_from_step = config_dict.placeholder(int)
  c.write_plots = True
  c.tensorboard = True
  return c



# Per-dataset defaults for the ViT recipes: splits, steps (the ViT paper's
# fine-tuning lengths) and the eval crop (CIFAR is only resized).
DATASETS = {
    "cifar10": dict(train_split="train", eval_split="test", steps=10_000,
                    eval_crop_fraction=1.0),
    "cifar100": dict(train_split="train", eval_split="test", steps=10_000,
                     eval_crop_fraction=1.0),
    "imagenet2012": dict(train_split="train", eval_split="validation",
                         steps=20_000, eval_crop_fraction=0.875),
    "oxford_iiit_pet": dict(train_split="train", eval_split="test", steps=500,
                            eval_crop_fraction=0.875),
    "oxford_flowers102": dict(train_split="train", eval_split="test",
                              steps=500, eval_crop_fraction=0.875),
}


def parse_arg(arg, default_dataset="cifar10"):
  """``'cifar100,384,scratch'`` -> (dataset, resolution or None, scratch)."""
  dataset, res, scratch = default_dataset, None, False
  for tok in [t.strip() for t in (arg or "").split(",") if t.strip()]:
    if tok.isdigit():
      res = int(tok)
    elif tok == "scratch":
      scratch = True
    else:
      dataset = tok
  return dataset, res, scratch


def vit_recipe(arg, model_name: str, weights: str,
               default_res: int = 224) -> ml_collections.ConfigDict:
  """The shared ViT recipe behind b16.py / l16.py / ...

  Fine-tuning (default, from torchvision ``weights``): the ViT paper's
  recipe: SGD momentum 0.9, no weight decay, global-norm clip 1.0, batch 512,
  500 warmup steps + cosine, zero-initialised head, Inception crop + flip;
  the position embedding is resampled when the resolution differs.
  ``scratch`` (or ``weights=None``, for sizes torchvision does not release):
  AdamW (wd 0.05), label smoothing, RandAugment, mixup, drop path: a
  DeiT-style recipe for training from random weights.
  """
  dataset, res, scratch = parse_arg(arg)
  scratch = scratch or not weights  # no released weights: from scratch
  c = get_config()
  d = DATASETS.get(dataset, dict(train_split="train", eval_split="test",
                                 steps=10_000, eval_crop_fraction=0.875))
  c.dataset = dataset
  c.train_split, c.eval_split = d["train_split"], d["eval_split"]
  c.image_size = res or default_res
  c.pp.eval_crop_fraction = d["eval_crop_fraction"]
  c.pp.crop = "inception"
  c.pp.flip = True
  c.model_name = model_name
  c.model.dtype = "bfloat16"  # mixed precision: bf16 compute, f32 params
  c.batch_size = 512
  c.eval_batch_size = 512
  c.total_steps = d["steps"]
  c.log_every = 50
  c.eval_every = 1000
  c.checkpoint_every = 1000
  if not scratch:
    c.init_weights = weights
    c.optimizer = "sgd"
    c.momentum = 0.9
    c.learning_rate = 0.01
    c.weight_decay = 0.0
    c.grad_clip_norm = 1.0
    c.warmup_steps = 500
    c.schedule = "cosine"
  else:
    c.init_weights = ""
    c.optimizer = "adamw"
    c.learning_rate = 1e-3
    c.weight_decay = 0.05
    c.b2 = 0.999
    c.grad_clip_norm = 1.0
    c.label_smoothing = 0.1
    c.warmup_steps = 2_000
    c.total_steps = max(c.total_steps, 30_000)
    c.pp.randaugment_layers = 2
    c.pp.randaugment_magnitude = 9
    c.pp.mixup_alpha = 0.2
    c.pp.mean = (0.5, 0.5, 0.5)
    c.pp.std = (0.5, 0.5, 0.5)
    c.model.drop_path_rate = 0.1
  return c


def self_supervised_recipe(arg, *, config_file: str, sizes: dict,
                           name: str, tag: str, patch: int
                           ) -> ml_collections.ConfigDict:
  """The shared recipe behind dinov2.py / dinov3.py: fine-tune (or
  linear-probe, token ``probe``) a self-supervised backbone from timm's
  hub weights.

  ``arg``: comma-separated tokens: a size key of ``sizes`` (``'b'`` by
  default), ``probe``, a dataset and a resolution (a multiple of
  ``patch``). ``name``: timm's model name with ``{size}`` for the size's
  word; ``tag``: the pretrained tag (``lvd142m``).

  Full fine-tuning: AdamW (wd 0.05, b2 0.999), layer-wise learning-rate
  decay 0.75, drop path 0.1, label smoothing 0.1, RandAugment 2/9, 500
  warmup steps + cosine, clip 1.0, bfloat16 compute. ``probe``: only the
  zero-initialised head learns (SGD momentum 0.9, lr 0.01, no decay).
  """
  tokens = [t.strip() for t in (arg or "").split(",") if t.strip()]
  size = next((t for t in tokens if t in sizes), "b")
  probe = "probe" in tokens
  rest = ",".join(t for t in tokens if t not in sizes and t != "probe")
  dataset, res, _ = parse_arg(rest)
  if res is not None and res % patch:
    raise ValueError(f"{config_file}: resolution {res} is not a multiple of "
                     f"the patch size {patch}")
  model_name = name.format(size=sizes[size])

  c = get_config()
  d = DATASETS.get(dataset, dict(train_split="train", eval_split="test",
                                 steps=10_000, eval_crop_fraction=0.875))
  c.dataset = dataset
  c.train_split, c.eval_split = d["train_split"], d["eval_split"]
  c.image_size = res or 224
  c.pp.eval_crop_fraction = d["eval_crop_fraction"]
  c.pp.crop = "inception"
  c.pp.flip = True
  c.model_name = model_name  # timm's: gives what the keys cannot (eps, RoPE)
  c.init_weights = f"hf-hub:timm/{model_name}.{tag}"
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
