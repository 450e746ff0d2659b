"""Optax optimizer and learning-rate schedule built from a training config.

``make_schedule``: linear warmup from 0 to ``learning_rate`` over the
(clamped, see ``configs/common.warmup_steps``) warmup, then cosine, linear or
constant to ``end_learning_rate_factor * learning_rate`` at ``total_steps``.

``make_optimizer``: global-norm clipping, then AdamW or SGD with momentum;
decoupled weight decay on kernels only (no decay on biases, LayerNorm scales,
the class token or the position embedding).
"""

from __future__ import annotations

import jax
import optax


def warmup_steps(config) -> int:
  """``config.warmup_steps`` clamped to a tenth of a run shorter than ten
  warmups (so overriding ``total_steps`` alone gives a working short run)."""
  w = max(0, int(config.warmup_steps))
  total = int(config.total_steps)
  if w * 10 > total:
    w = min(w, total // 10)
  return w


def make_schedule(config) -> optax.Schedule:
  peak = float(config.learning_rate)
  total = int(config.total_steps)
  warm = warmup_steps(config)
  end = peak * float(config.end_learning_rate_factor)
  rest = max(1, total - warm)
  if config.schedule == "cosine":
    decay = optax.cosine_decay_schedule(peak, rest, alpha=end / peak if peak else 0.0)
  elif config.schedule == "linear":
    decay = optax.linear_schedule(peak, end, rest)
  elif config.schedule == "constant":
    decay = optax.constant_schedule(peak)
  else:
    raise ValueError(f"config.schedule={config.schedule!r}: expected "
                     f"'cosine', 'linear' or 'constant'.")
  if not warm:
    return decay
  # Warmup reaches the peak at step `warm` (first step uses peak / warm).
  ramp = optax.linear_schedule(peak / warm, peak, warm - 1) if warm > 1 else (
      optax.constant_schedule(peak))
  return optax.join_schedules([ramp, decay], [warm])


def decay_mask(params):
  """True for the leaves that get weight decay: the ``kernel`` leaves."""
  def is_kernel(path, _):
    last = path[-1]
    name = getattr(last, "key", getattr(last, "name", str(last)))
    return name == "kernel"
  return jax.tree_util.tree_map_with_path(is_kernel, params)


def make_optimizer(config, schedule=None) -> optax.GradientTransformation:
  schedule = schedule or make_schedule(config)
  chain = []
  if config.grad_clip_norm and config.grad_clip_norm > 0:
    chain.append(optax.clip_by_global_norm(float(config.grad_clip_norm)))
  if config.optimizer == "adamw":
    chain.append(optax.adamw(schedule, b1=float(config.b1), b2=float(config.b2),
                             weight_decay=float(config.weight_decay),
                             mask=decay_mask))
  elif config.optimizer == "sgd":
    if config.weight_decay:
      # L2-style decay through the momentum, as torch.optim.SGD's.
      chain.append(optax.add_decayed_weights(float(config.weight_decay),
                                             mask=decay_mask))
    chain.append(optax.sgd(schedule, momentum=float(config.momentum) or None,
                           nesterov=bool(config.nesterov)))
  else:
    raise ValueError(f"config.optimizer={config.optimizer!r}: expected "
                     f"'adamw' or 'sgd'.")
  return optax.chain(*chain)
