"""Optax optimizer and learning-rate schedule built from a training config.

``make_schedule``: linear warmup from 0 to ``learning_rate`` over the
(clamped, see ``configs/common.warmup_steps``) warmup, then cosine, linear or
constant to ``end_learning_rate_factor * learning_rate`` at ``total_steps``.

``make_optimizer``: global-norm clipping, then AdamW or SGD with momentum;
decoupled weight decay on kernels only (no decay on biases, LayerNorm scales,
the class token or the position embedding); optionally layer-wise learning-
rate decay (``config.layer_decay``: BEiT / DeiT-III / DINOv2 fine-tuning)
and a frozen backbone (``config.linear_probe``: only the head learns).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
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


def _key(entry) -> str:
  return str(getattr(entry, "key", getattr(entry, "name", entry)))


_BLOCK = re.compile(r"^encoderblock_(\d+)$")
# Parameters before the first block: layer 0 of layer-wise decay.
_EMBEDDING = ("embedding", "cls", "registers", "posembed_input", "pre_norm")


def layer_ids(tree):
  """Each leaf's depth: 0 for the embeddings (patch embedding, class token,
  registers, position embedding, pre-norm, conv stem), i + 1 for block i, and
  L + 1 for what follows the blocks (final norm, pooling, head). A scanned
  ``encoderblock`` leaf gets the (L, 1, ...) column of its layers' depths."""
  def names(path):
    return [_key(p) for p in path]

  paths = [names(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  blocks = [int(m.group(1)) for n in paths for m in map(_BLOCK.match, n) if m]
  scanned = [leaf.shape[0] for p, leaf in jax.tree_util.tree_leaves_with_path(tree)
             if "encoderblock" in names(p)]
  depth = (max(blocks) + 1 if blocks else 0) or (scanned[0] if scanned else 0)

  def layer(path, leaf):
    n = names(path)
    for k in n:
      m = _BLOCK.match(k)
      if m:
        return int(m.group(1)) + 1
    if "encoderblock" in n:  # stacked layers on the leading axis
      return jnp.arange(1, depth + 1).reshape((-1,) + (1,) * (leaf.ndim - 1))
    if any(k in _EMBEDDING or k.startswith(("stem_", "embedding")) for k in n):
      return 0
    return depth + 1
  return jax.tree_util.tree_map_with_path(layer, tree), depth


def scale_by_layer_decay(decay: float) -> optax.GradientTransformation:
  """Multiplies each update by ``decay ** (L + 1 - layer)`` (layer-wise
  learning-rate decay: the head at the full rate, each block below it
  ``decay`` times slower, the embeddings slowest)."""
  def update(updates, state, params=None):
    del params
    ids, depth = layer_ids(updates)
    updates = jax.tree_util.tree_map(
        lambda u, i: u * jnp.asarray(decay, u.dtype) ** (depth + 1 - i),
        updates, ids)
    return updates, state
  return optax.GradientTransformation(lambda params: optax.EmptyState(),
                                      update)


def head_only(params):
  """'train' for the head (and a representation layer), 'frozen' for the
  rest: the labels of a linear probe."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "train" if _key(path[0]) in ("head", "pre_logits")
      else "frozen", params)


def make_optimizer(config, schedule=None) -> optax.GradientTransformation:
  schedule = schedule or make_schedule(config)
  tx = _base_optimizer(config, schedule)
  decay = float(config.get("layer_decay", 1.0) or 1.0)
  if not 0.0 < decay <= 1.0:
    raise ValueError(f"config.layer_decay={decay}: expected a rate in (0, 1] "
                     f"(1 = off; DeiT-III and DINOv2 fine-tune with 0.65-0.9).")
  if decay < 1.0:
    tx = optax.chain(tx, scale_by_layer_decay(decay))
  if config.get("linear_probe", False):
    tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()},
                               head_only)
  return tx


def _base_optimizer(config, schedule) -> optax.GradientTransformation:
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
