"""Flax NNX: any vit_jax model as an ``nnx.Module``, and back.

    from flax import nnx
    import vit_jax.nnx

    loaded = vit_jax.weights.load("hf-hub:timm/vit_small_patch14_reg4_dinov2.lvd142m")
    model = vit_jax.nnx.to_nnx(loaded)             # an nnx.Module, weights in it
    logits = model(images, train=False)            # the same numbers as loaded.model.apply
    feats = model.forward_features(images, train=False)

    optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    # ... nnx.value_and_grad / optimizer.update(model, grads), see
    # tests/test_nnx.py for a complete fine-tuning step

    model_def, variables = vit_jax.nnx.to_linen(model)   # back, e.g. to save or export

It is Flax's own bridge (``nnx.bridge.ToNNX``) around the linen module,
initialised once for the shapes and then given the loaded variables, so
every option, checkpoint layout and parity test of the linen model holds
for the NNX one. Dropout and drop path draw from the ``'dropout'`` stream
of the module's ``nnx.Rngs``.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import traverse_util


_WEIGHTS = (nnx.Param, nnx.BatchStat)  # what a checkpoint holds (not the rngs)


def to_nnx(model, variables: Optional[Any] = None, *,
           rngs: Optional[nnx.Rngs] = None,
           image_size: Optional[Any] = None) -> nnx.Module:
  """``(model, variables)`` (or a :class:`vit_jax.weights.Loaded`) -> an
  ``nnx.Module`` holding those variables.

  Args:
    model: a :class:`vit_jax.models.VisionTransformer`, or what
      :func:`vit_jax.weights.load` returns (then ``variables`` is its own).
    variables: ``{'params': ..., ('batch_stats': ...)}``; ``None`` with a
      bare model: its random initialisation.
    rngs: the module's random streams (default ``nnx.Rngs(params=0,
      dropout=1)``).
    image_size: the input size the shapes are set up with (default: the
      weights' own, else the model's ``image_size``, else 224).
  """
  if hasattr(model, "model") and hasattr(model, "variables"):
    model, variables = model.model, (variables if variables is not None
                                     else model.variables)
  size = image_size or model.image_size or _native_size(model, variables)
  h, w = (size if isinstance(size, (tuple, list)) else (size, size))
  rngs = rngs if rngs is not None else nnx.Rngs(params=0, dropout=1)
  module = nnx.bridge.ToNNX(model, rngs=rngs)
  module.lazy_init(jnp.zeros((1, int(h), int(w), model.num_channels),
                             jnp.float32), train=False)
  if variables is not None:
    _assign(module, variables)
  return module


def to_linen(module: nnx.Module) -> Tuple[Any, dict]:
  """An ``nnx.Module`` made by :func:`to_nnx` -> ``(linen model,
  variables)``: what every other part of vit_jax takes (``save_safetensors``,
  ``formats.to_timm``, ``export.export``...)."""
  model = module.to_nnx__module
  out: dict = {}
  for path, var in nnx.to_flat_state(nnx.state(module, _WEIGHTS)):
    col = "batch_stats" if isinstance(var, nnx.BatchStat) else "params"
    out[(col,) + tuple(str(p) for p in path)] = var.get_value()
  return model, traverse_util.unflatten_dict(out)


def _native_size(model, variables) -> int:
  if variables is None:
    return 224
  p = variables["params"] if "params" in variables else variables
  rows = int(np.shape(p["Transformer"]["posembed_input"]["pos_embedding"])[1])
  patches = rows if model.no_embed_class else rows - model.num_prefix_tokens
  side = int(round(np.sqrt(max(patches, 1))))
  return side * model.patch_size


def _assign(module: nnx.Module, variables) -> None:
  """Puts our variables into the module's own (same paths, same shapes)."""
  variables = variables if "params" in variables else {"params": variables}
  ours = {}
  for col, tree in variables.items():
    for path, x in traverse_util.flatten_dict(dict(tree)).items():
      ours[tuple(path)] = jnp.asarray(x)
  state = nnx.state(module, _WEIGHTS)
  flat = dict(nnx.to_flat_state(state))
  have = {tuple(str(p) for p in k): k for k in flat}
  missing = sorted("/".join(k) for k in have if k not in ours)
  unexpected = sorted("/".join(k) for k in ours if k not in have)
  if missing or unexpected:
    raise ValueError(f"The variables do not fit the model: missing "
                     f"{missing[:5]}, unexpected {unexpected[:5]}.")
  for key, path in have.items():
    var = flat[path]
    x = ours[key]
    if tuple(x.shape) != tuple(var.get_value().shape):
      raise ValueError(f"{'/'.join(key)}: shape {tuple(x.shape)}, the model "
                       f"has {tuple(var.get_value().shape)}.")
    var.set_value(x.astype(var.get_value().dtype))
  nnx.update(module, state)


__all__ = ["to_nnx", "to_linen"]

del jax  # imported for users' type checkers only
