"""torchvision <-> Flax parameter mapping and position-embedding resampling.

This module maps parameter trees only; it never builds a torch model except in
:func:`to_torchvision_model`. torch is imported lazily inside the functions
that need it, so ``from vit_jax import convert`` works without torch.

    model, variables = convert.from_torchvision(state_dict, "vit_b_16")
    state_dict = convert.to_torchvision(variables)   # strict=True loadable

Key mapping (torchvision -> Flax, ``L`` = encoder_layer index)::

    class_token                       cls
    conv_proj.{weight,bias}           embedding/{kernel,bias}   (OIHW -> HWIO)
    conv_proj.conv_bn_relu_{i}.0/.1   stem_convs_{i} / stem_bns_{i} (conv stem)
    conv_proj.conv_last               embedding                  (conv stem)
    encoder.pos_embedding             Transformer/posembed_input/pos_embedding
    encoder.layers.encoder_layer_L.ln_1 / ln_2      LayerNorm_0 / LayerNorm_1
    ...self_attention.in_proj_{weight,bias}         query/key/value (row split)
    ...self_attention.out_proj                      out
    ...mlp.0 / mlp.3 (legacy mlp.linear_1/_2)       MlpBlock_0/Dense_0 / Dense_1
    encoder.ln                        Transformer/encoder_norm
    heads.pre_logits / heads.head     pre_logits / head
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from vit_jax import models

__all__ = [
    "from_torchvision",
    "to_torchvision",
    "to_torchvision_model",
    "load_torchvision",
    "torchvision_to_params",
    "params_to_torchvision",
    "resample_posemb",
    "resize_posemb",
    "stack_layers",
    "unstack_layers",
    "Preprocessing",
]

_BLOCK = "encoder.layers.encoder_layer_{}."
_LEGACY_MLP = {"mlp.linear_1.": "mlp.0.", "mlp.linear_2.": "mlp.3."}
_BN_STATS = ("running_mean", "running_var")


# --------------------------------------------------------------------------- #
# Bicubic resampling that matches torch.nn.functional.interpolate.
# --------------------------------------------------------------------------- #


def _cubic_weights(t: np.ndarray, a: float = -0.75) -> np.ndarray:
  """Keys' cubic convolution weights for the 4 taps around ``t`` in [0, 1).

  Same kernel (A = -0.75) as PyTorch's ``upsample_bicubic2d``; note
  ``jax.image.resize`` uses A = -0.5 and half-pixel centres instead.
  """
  def near(x):  # |x| <= 1
    return ((a + 2) * x - (a + 3)) * x * x + 1

  def far(x):  # 1 < |x| < 2
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

  return np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=-1)


def _bicubic_matrix(n_in: int, n_out: int, dtype=np.float32) -> np.ndarray:
  """(n_out, n_in) matrix of bicubic interpolation with align_corners=True.

  Source coordinates and tap weights are computed in ``dtype``, as PyTorch
  does for inputs of that dtype; the result is accumulated in float64.
  """
  f = np.dtype(dtype).type if np.dtype(dtype) == np.float64 else np.float32
  scale = f(n_in - 1) / f(n_out - 1) if n_out > 1 else f(0)
  src = np.arange(n_out, dtype=f) * scale
  base = np.floor(src).astype(np.int64)
  weights = _cubic_weights(src - base.astype(f)).astype(np.float64)
  mat = np.zeros((n_out, n_in), np.float64)
  for tap in range(4):
    # Out-of-range taps read the border pixel, as PyTorch clamps indices.
    idx = np.clip(base - 1 + tap, 0, n_in - 1)
    np.add.at(mat, (np.arange(n_out), idx), weights[:, tap])
  return mat


def _grid_of(rows: int, what: str) -> Tuple[int, int]:
  side = math.isqrt(rows)
  if side * side != rows:
    raise ValueError(
        f"{what}: {rows} patch rows do not form a square grid; pass the grid "
        f"as old_grid=(height, width).")
  return side, side


def resample_posemb(posemb, new_grid, *, num_prefix_tokens: int = 1,
                    old_grid: Optional[Tuple[int, int]] = None) -> np.ndarray:
  """Resamples a (1, prefix + H*W, D) position embedding to ``new_grid``.

  Bicubic with ``align_corners=True``, prefix (class) tokens kept: the same
  numbers as torchvision's ``interpolate_embeddings``. ``new_grid`` is an int
  (square) or (height, width) in patches.
  """
  posemb = np.asarray(posemb)
  if posemb.ndim != 3 or posemb.shape[0] != 1:
    raise ValueError(f"Expected a position embedding of shape (1, tokens, "
                     f"width), got {posemb.shape}")
  prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
  gh, gw = old_grid or _grid_of(grid.shape[1], "resample_posemb")
  if gh * gw != grid.shape[1]:
    raise ValueError(f"old_grid={old_grid} has {gh * gw} cells, the embedding "
                     f"has {grid.shape[1]} patch rows")
  nh, nw = models._pair(new_grid)  # pylint: disable=protected-access
  if (nh, nw) == (gh, gw):
    return posemb
  d = grid.shape[-1]
  img = grid.reshape(gh, gw, d).astype(np.float64)
  img = np.einsum("Hh,hwd->Hwd", _bicubic_matrix(gh, nh, posemb.dtype), img)
  img = np.einsum("Ww,hwd->hWd", _bicubic_matrix(gw, nw, posemb.dtype), img)
  img = img.reshape(1, nh * nw, d).astype(posemb.dtype)
  return np.concatenate([prefix, img], axis=1)


def resize_posemb(variables, image_size, patch_size: Optional[int] = None):
  """Returns ``variables`` with the position embedding resampled for
  ``image_size`` (int or (H, W)). ``patch_size`` defaults to the embedding
  conv's kernel (pass it for a conv-stem model)."""
  params = _params_of(variables)
  if patch_size is None:
    patch_size = int(np.shape(params["embedding"]["kernel"])[0])
  h, w = models._pair(image_size)  # pylint: disable=protected-access
  if h % patch_size or w % patch_size:
    raise ValueError(f"image_size {h}x{w} is not divisible by the patch size "
                     f"{patch_size}")
  pe = params["Transformer"]["posembed_input"]["pos_embedding"]
  prefix = 1 if "cls" in params else 0
  new = resample_posemb(pe, (h // patch_size, w // patch_size),
                        num_prefix_tokens=prefix)
  return _replace_posemb(variables, new)


def _replace_posemb(variables, new):
  out = dict(variables)
  is_wrapped = "params" in variables
  params = dict(out["params"] if is_wrapped else out)
  tr = dict(params["Transformer"])
  tr["posembed_input"] = {"pos_embedding": new}
  params["Transformer"] = tr
  if is_wrapped:
    out["params"] = params
    return out
  return params


# --------------------------------------------------------------------------- #
# Tree helpers.
# --------------------------------------------------------------------------- #


def _params_of(variables):
  return variables["params"] if "params" in variables else variables


def _np(x) -> np.ndarray:
  """torch tensor / jax array / numpy -> numpy (bfloat16 -> float32)."""
  if hasattr(x, "detach"):  # torch.Tensor, without importing torch
    x = x.detach().cpu()
    if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
      x = x.float()
    # A copy: .numpy() shares the tensor's memory, and the converted
    # variables must not change when the torch model trains on.
    return x.numpy().copy()
  return np.asarray(x)


def unstack_layers(params):
  """Scanned tree (``Transformer/encoderblock`` with a layer axis) ->
  per-layer tree (``encoderblock_{i}``). Other trees are returned as is."""
  import jax  # local: cheap, and keeps the module importable lightly

  is_wrapped = "params" in params
  p = _params_of(params)
  tr = p.get("Transformer", {})
  if "encoderblock" not in tr:
    return params
  stacked = tr["encoderblock"]
  n = jax.tree_util.tree_leaves(stacked)[0].shape[0]
  new_tr = {k: v for k, v in tr.items() if k != "encoderblock"}
  for i in range(n):
    new_tr[f"encoderblock_{i}"] = jax.tree_util.tree_map(lambda x: x[i], stacked)
  out = dict(p, Transformer=new_tr)
  return dict(params, params=out) if is_wrapped else out


def stack_layers(params):
  """Per-layer tree -> scanned tree (for ``scan_layers=True`` models)."""
  import jax

  is_wrapped = "params" in params
  p = _params_of(params)
  tr = p["Transformer"]
  names = sorted((k for k in tr if re.fullmatch(r"encoderblock_\d+", k)),
                 key=lambda k: int(k.split("_")[1]))
  if not names:
    return params
  blocks = [tr[k] for k in names]
  new_tr = {k: v for k, v in tr.items() if k not in names}
  new_tr["encoderblock"] = jax.tree_util.tree_map(
      lambda *xs: np.stack([np.asarray(x) for x in xs]), *blocks)
  out = dict(p, Transformer=new_tr)
  return dict(params, params=out) if is_wrapped else out


# --------------------------------------------------------------------------- #
# torchvision -> Flax.
# --------------------------------------------------------------------------- #


def _normalise_state_dict(state_dict) -> "collections.OrderedDict[str, np.ndarray]":
  """Tensors or arrays -> numpy; strips DDP's ``module.`` prefix and renames
  torchvision's legacy MLP keys (``mlp.linear_1/2`` -> ``mlp.0/3``)."""
  if hasattr(state_dict, "state_dict") and callable(state_dict.state_dict):
    state_dict = state_dict.state_dict()  # a torch nn.Module
  if not isinstance(state_dict, Mapping):
    raise TypeError(f"Expected a torchvision state_dict (a mapping of names to "
                    f"tensors), got {type(state_dict).__name__}")
  out = collections.OrderedDict()
  keys = list(state_dict)
  strip = "module." if keys and all(k.startswith("module.") for k in keys) else ""
  for k, v in state_dict.items():
    k = k[len(strip):]
    for old, new in _LEGACY_MLP.items():
      k = k.replace(old, new)
    out[k] = _np(v)
  return out


def _conv_stem_from_keys(sd) -> Tuple[models.ConvStemConfig, ...]:
  """Reads torchvision's ``conv_stem_configs`` back from the state dict."""
  stem = []
  i = 0
  while f"conv_proj.conv_bn_relu_{i}.0.weight" in sd:
    w = sd[f"conv_proj.conv_bn_relu_{i}.0.weight"]
    stem.append((int(w.shape[0]), int(w.shape[2])))
    i += 1
  return tuple(stem)


def _expected_shapes(v: models.Variant, num_classes, rep, stem_layers,
                     stem_strides, pos_rows) -> "collections.OrderedDict":
  d, m = v.hidden_size, v.mlp_dim
  e = collections.OrderedDict()
  e["class_token"] = (1, 1, d)
  e["encoder.pos_embedding"] = (1, pos_rows, d)
  if stem_layers:
    c_in = 3
    for i, (c_out, k) in enumerate(stem_layers):
      pre = f"conv_proj.conv_bn_relu_{i}."
      e[pre + "0.weight"] = (c_out, c_in, k, k)
      for n in ("weight", "bias") + _BN_STATS:
        e[pre + "1." + n] = (c_out,)
      e[pre + "1.num_batches_tracked"] = ()
      c_in = c_out
    e["conv_proj.conv_last.weight"] = (d, c_in, 1, 1)
    e["conv_proj.conv_last.bias"] = (d,)
  else:
    e["conv_proj.weight"] = (d, 3, v.patch_size, v.patch_size)
    e["conv_proj.bias"] = (d,)
  for i in range(v.num_layers):
    b = _BLOCK.format(i)
    for ln in ("ln_1", "ln_2"):
      e[b + ln + ".weight"] = e[b + ln + ".bias"] = (d,)
    e[b + "self_attention.in_proj_weight"] = (3 * d, d)
    e[b + "self_attention.in_proj_bias"] = (3 * d,)
    e[b + "self_attention.out_proj.weight"] = (d, d)
    e[b + "self_attention.out_proj.bias"] = (d,)
    e[b + "mlp.0.weight"], e[b + "mlp.0.bias"] = (m, d), (m,)
    e[b + "mlp.3.weight"], e[b + "mlp.3.bias"] = (d, m), (d,)
  e["encoder.ln.weight"] = e["encoder.ln.bias"] = (d,)
  width = d
  if rep:
    e["heads.pre_logits.weight"], e["heads.pre_logits.bias"] = (rep, d), (rep,)
    width = rep
  if num_classes:
    e["heads.head.weight"], e["heads.head.bias"] = (num_classes, width), (num_classes,)
  return e


def check_keys(sd, expected, what):
  """Reports missing, unexpected and mis-shaped keys by name, all at once.

  ``sd`` maps names to arrays, ``expected`` names to shapes; ``what`` names
  the layout in the error ("torchvision's vit_b_16").
  """
  missing = [k for k in expected if k not in sd]
  unexpected = [k for k in sd if k not in expected]
  misshaped = [f"{k}: expected {tuple(expected[k])}, got {tuple(sd[k].shape)}"
               for k in expected
               if k in sd and tuple(sd[k].shape) != tuple(expected[k])]
  if missing or unexpected or misshaped:
    lines = [f"Weights do not match {what}:"]
    for title, items in (("missing keys", missing),
                         ("unexpected keys", unexpected),
                         ("mis-shaped keys", misshaped)):
      if items:
        shown = items[:20] + ([f"... and {len(items) - 20} more"]
                              if len(items) > 20 else [])
        lines.append(f"  {title} ({len(items)}):")
        lines += [f"    {s}" for s in shown]
    raise ValueError("\n".join(lines))


def _split_heads(w, h):
  """torch Linear weight (out=D, in=D) -> linen DenseGeneral (D, H, D/H)."""
  d_out, d_in = w.shape
  return w.T.reshape(d_in, h, d_out // h)


_ARCH_FIELDS = ("hidden_size", "num_layers", "num_heads", "mlp_dim", "patch_size")


def _variant(name, overrides=None) -> models.Variant:
  """A name (or Variant) plus architecture overrides (e.g. num_layers)."""
  v = name if isinstance(name, models.Variant) else models.decode_variant(name)
  arch = {k: overrides[k] for k in _ARCH_FIELDS if overrides and k in overrides}
  return dataclasses.replace(v, **arch)


def torchvision_to_params(state_dict, name, conv_stem=None):
  """Maps a torchvision ViT state dict onto the Flax tree.

  ``name`` is a variant name or a :class:`~vit_jax.models.Variant` (for
  custom sizes). ``conv_stem`` gives a conv stem's strides, which a state
  dict does not store (default: 2 until they reach the patch size, then 1);
  its channels and kernels must match the weights. Returns ``(variables, info)`` where ``variables`` holds
  ``params`` (and ``batch_stats`` for a conv stem) and ``info`` is a dict of
  the inferred ``num_classes``, ``representation_size``, ``conv_stem`` and
  ``image_size``.
  """
  v = _variant(name)
  sd = _normalise_state_dict(state_dict)
  h, d = v.num_heads, v.hidden_size

  head_w = sd.get("heads.head.weight")
  num_classes = int(head_w.shape[0]) if head_w is not None else 0
  pre = sd.get("heads.pre_logits.weight")
  rep = int(pre.shape[0]) if pre is not None else None
  stem = _conv_stem_from_keys(sd)
  pos = sd.get("encoder.pos_embedding")
  pos_rows = int(pos.shape[1]) if pos is not None and pos.ndim == 3 else 197
  strides = _stem_strides(stem, v.patch_size, conv_stem)
  check_keys(sd, _expected_shapes(v, num_classes, rep, stem, strides, pos_rows),
             "torchvision's " + (name if isinstance(name, str) else str(v)))
  grid = _grid_of(pos_rows - 1, "encoder.pos_embedding")

  def dense(prefix):
    return {"kernel": sd[prefix + ".weight"].T, "bias": sd[prefix + ".bias"]}

  def ln(prefix):
    return {"scale": sd[prefix + ".weight"], "bias": sd[prefix + ".bias"]}

  def conv(prefix, bias=True):
    out = {"kernel": sd[prefix + ".weight"].transpose(2, 3, 1, 0)}
    if bias:
      out["bias"] = sd[prefix + ".bias"]
    return out

  p: dict = {"cls": sd["class_token"]}
  batch_stats = {}
  if stem:
    for i in range(len(stem)):
      pre_ = f"conv_proj.conv_bn_relu_{i}."
      p[f"stem_convs_{i}"] = conv(pre_ + "0", bias=False)
      p[f"stem_bns_{i}"] = {"scale": sd[pre_ + "1.weight"],
                           "bias": sd[pre_ + "1.bias"]}
      batch_stats[f"stem_bns_{i}"] = {"mean": sd[pre_ + "1.running_mean"],
                                      "var": sd[pre_ + "1.running_var"]}
    p["embedding"] = conv("conv_proj.conv_last")
  else:
    p["embedding"] = conv("conv_proj")

  tr: dict = {"posembed_input": {"pos_embedding": sd["encoder.pos_embedding"]}}
  for i in range(v.num_layers):
    b = _BLOCK.format(i)
    in_w = sd[b + "self_attention.in_proj_weight"]
    in_b = sd[b + "self_attention.in_proj_bias"]
    attn = {}
    for j, n in enumerate(("query", "key", "value")):
      attn[n] = {"kernel": _split_heads(in_w[j * d:(j + 1) * d], h),
                 "bias": in_b[j * d:(j + 1) * d].reshape(h, d // h)}
    out_w = sd[b + "self_attention.out_proj.weight"]  # (D_out, D_in)
    attn["out"] = {"kernel": out_w.T.reshape(h, d // h, d),
                   "bias": sd[b + "self_attention.out_proj.bias"]}
    tr[f"encoderblock_{i}"] = {
        "LayerNorm_0": ln(b + "ln_1"),
        "MultiHeadDotProductAttention_0": attn,
        "LayerNorm_1": ln(b + "ln_2"),
        "MlpBlock_0": {"Dense_0": dense(b + "mlp.0"),
                       "Dense_1": dense(b + "mlp.3")},
    }
  tr["encoder_norm"] = ln("encoder.ln")
  p["Transformer"] = tr
  if rep:
    p["pre_logits"] = dense("heads.pre_logits")
  if num_classes:
    p["head"] = dense("heads.head")

  p = _tree_map_np(lambda x: np.ascontiguousarray(x, dtype=np.float32), p)
  variables = {"params": p}
  if batch_stats:
    variables["batch_stats"] = _tree_map_np(
        lambda x: np.asarray(x, np.float32), batch_stats)
  conv_stem = tuple(models.ConvStemConfig(c, k, s)
                    for (c, k), s in zip(stem, strides)) if stem else None
  info = dict(num_classes=num_classes, representation_size=rep,
              conv_stem=conv_stem, image_size=grid[0] * v.patch_size)
  return variables, info


def _stem_strides(stem, patch_size, conv_stem=None) -> Tuple[int, ...]:
  """The stem's strides: ``conv_stem``'s (checked against the weights'
  (out_channels, kernel_size) pairs), else inferred."""
  if conv_stem is None:
    return _infer_stem_strides(stem, patch_size)
  given = [c if isinstance(c, models.ConvStemConfig) else
           models.ConvStemConfig(*c) for c in conv_stem]
  pairs = [(c.out_channels, c.kernel_size) for c in given]
  if pairs != [tuple(p) for p in stem]:
    raise ValueError(
        f"conv_stem (out_channels, kernel_size) per layer {pairs} does not "
        f"match the state dict's stem {[tuple(p) for p in stem]}.")
  return tuple(c.stride for c in given)


def _infer_stem_strides(stem, patch_size) -> Tuple[int, ...]:
  """Strides are not stored in a state dict: torchvision's published conv
  stems halve the resolution per layer, so the strides are 2 until they
  multiply to the patch size and 1 afterwards."""
  strides, total = [], 1
  for _ in stem:
    s = 2 if total < patch_size else 1
    strides.append(s)
    total *= s
  if stem and total != patch_size:
    raise ValueError(
        f"Cannot infer conv-stem strides: {len(stem)} stride-2 layers give "
        f"{total}, not the patch size {patch_size}. Pass the stem with its "
        f"strides: conv_stem=[ConvStemConfig(out_channels, kernel_size, "
        f"stride), ...].")
  return tuple(strides)


def _tree_map_np(fn, tree):
  if isinstance(tree, Mapping):
    return {k: _tree_map_np(fn, v) for k, v in tree.items()}
  return fn(tree)


def from_torchvision(state_dict, name: str, *, image_size=None,
                     **model_overrides):
  """torchvision ViT weights -> ``(model, variables)``.

  Args:
    state_dict: a torchvision ``VisionTransformer`` state dict (torch tensors
      or numpy arrays; a ``torch.nn.Module`` is accepted too).
    name: the variant, e.g. ``"vit_b_16"`` (gives heads/width/depth).
    image_size: resolution to use the model at. The position embedding is
      resampled from the checkpoint's grid exactly as torchvision's
      ``interpolate_embeddings`` does. ``None`` keeps the checkpoint's.
    **model_overrides: other :class:`~vit_jax.models.VisionTransformer`
      fields (dtype, dropout_rate, scan_layers, ...); architecture fields
      (num_layers, hidden_size, ...) describe a custom-size checkpoint.

  ``num_classes``, ``representation_size`` and a conv stem are read from the
  weights. Missing, unexpected and mis-shaped keys are reported together.
  """
  v = _variant(name, model_overrides)
  variables, info = torchvision_to_params(
      state_dict, v, conv_stem=model_overrides.get("conv_stem"))
  if image_size is not None:
    variables = resize_posemb(variables, image_size, v.patch_size)
  kwargs = dict(num_classes=info["num_classes"],
                representation_size=info["representation_size"],
                conv_stem=info["conv_stem"])
  kwargs.update(model_overrides)
  model = models.get_model(name, **kwargs)
  if model.scan_layers:
    variables = stack_layers(variables)
  return model, variables


# --------------------------------------------------------------------------- #
# Flax -> torchvision.
# --------------------------------------------------------------------------- #


def params_to_torchvision(variables) -> "collections.OrderedDict[str, np.ndarray]":
  """The Flax tree -> torchvision's state dict, as numpy arrays (no torch).

  Works for per-layer and scanned (``scan_layers=True``) trees; the number of
  heads is read from the attention kernels, so no variant name is needed.
  """
  variables = unstack_layers(dict(variables))
  p = _params_of(variables)
  stats = variables.get("batch_stats", {}) if "params" in variables else {}
  a = lambda x: np.asarray(x, dtype=np.float32)  # noqa: E731 (bf16 -> f32)
  sd = collections.OrderedDict()
  if "cls" not in p:
    raise ValueError("torchvision's ViT has a class token; this tree has no "
                     "'cls' (classifier='gap'?) and cannot be exported.")
  sd["class_token"] = a(p["cls"])

  def conv(tree, prefix, bias=True):
    sd[prefix + ".weight"] = a(tree["kernel"]).transpose(3, 2, 0, 1)
    if bias:
      sd[prefix + ".bias"] = a(tree["bias"])

  stem_ids = sorted(int(k.split("_")[-1]) for k in p if k.startswith("stem_convs_"))
  for i in stem_ids:
    pre = f"conv_proj.conv_bn_relu_{i}."
    conv(p[f"stem_convs_{i}"], pre + "0", bias=False)
    bn, st = p[f"stem_bns_{i}"], stats.get(f"stem_bns_{i}")
    if st is None:
      raise ValueError(f"conv stem layer {i} needs batch_stats: pass the whole "
                       f"variables dict, not only 'params'")
    sd[pre + "1.weight"], sd[pre + "1.bias"] = a(bn["scale"]), a(bn["bias"])
    sd[pre + "1.running_mean"], sd[pre + "1.running_var"] = a(st["mean"]), a(st["var"])
    sd[pre + "1.num_batches_tracked"] = np.array(0, np.int64)
  conv(p["embedding"], "conv_proj.conv_last" if stem_ids else "conv_proj")

  tr = p["Transformer"]
  sd["encoder.pos_embedding"] = a(tr["posembed_input"]["pos_embedding"])
  n_layers = len([k for k in tr if k.startswith("encoderblock_")])
  for i in range(n_layers):
    blk, b = tr[f"encoderblock_{i}"], _BLOCK.format(i)
    attn = blk["MultiHeadDotProductAttention_0"]
    d = a(attn["query"]["kernel"]).shape[0]
    sd[b + "ln_1.weight"] = a(blk["LayerNorm_0"]["scale"])
    sd[b + "ln_1.bias"] = a(blk["LayerNorm_0"]["bias"])
    sd[b + "self_attention.in_proj_weight"] = np.concatenate(
        [a(attn[n]["kernel"]).reshape(d, d).T for n in ("query", "key", "value")])
    sd[b + "self_attention.in_proj_bias"] = np.concatenate(
        [a(attn[n]["bias"]).reshape(d) for n in ("query", "key", "value")])
    sd[b + "self_attention.out_proj.weight"] = a(attn["out"]["kernel"]).reshape(d, d).T
    sd[b + "self_attention.out_proj.bias"] = a(attn["out"]["bias"])
    sd[b + "ln_2.weight"] = a(blk["LayerNorm_1"]["scale"])
    sd[b + "ln_2.bias"] = a(blk["LayerNorm_1"]["bias"])
    for j, n in (("0", "Dense_0"), ("3", "Dense_1")):
      sd[b + f"mlp.{j}.weight"] = a(blk["MlpBlock_0"][n]["kernel"]).T
      sd[b + f"mlp.{j}.bias"] = a(blk["MlpBlock_0"][n]["bias"])
  sd["encoder.ln.weight"] = a(tr["encoder_norm"]["scale"])
  sd["encoder.ln.bias"] = a(tr["encoder_norm"]["bias"])
  if "pre_logits" in p:
    sd["heads.pre_logits.weight"] = a(p["pre_logits"]["kernel"]).T
    sd["heads.pre_logits.bias"] = a(p["pre_logits"]["bias"])
  if "head" in p:
    sd["heads.head.weight"] = a(p["head"]["kernel"]).T
    sd["heads.head.bias"] = a(p["head"]["bias"])
  return collections.OrderedDict(
      (k, np.ascontiguousarray(x)) for k, x in sd.items())


def to_torchvision(variables) -> "collections.OrderedDict":
  """Flax variables -> a torchvision state dict of torch tensors.

  Loads with ``strict=True`` into ``torchvision.models.<name>(num_classes=...,
  image_size=..., representation_size=...)`` built to match (see
  :func:`to_torchvision_model`, which does that for you).
  """
  import torch  # pylint: disable=import-outside-toplevel

  return collections.OrderedDict(
      (k, torch.from_numpy(np.array(x))) for k, x in
      params_to_torchvision(variables).items())


def to_torchvision_model(variables, name, conv_stem=None, **arch_overrides):
  """Builds the matching torchvision ``VisionTransformer`` and loads
  ``variables`` into it with ``strict=True``. A conv stem's strides are
  ``conv_stem``'s (e.g. ``model.conv_stem``), else inferred as on load."""
  import torchvision  # pylint: disable=import-outside-toplevel
  from torchvision.models.vision_transformer import ConvStemConfig

  v = _variant(name, arch_overrides)
  sd = to_torchvision(variables)
  rows = sd["encoder.pos_embedding"].shape[1] - 1
  grid = _grid_of(rows, "encoder.pos_embedding")
  kwargs = dict(image_size=grid[0] * v.patch_size, patch_size=v.patch_size,
                num_layers=v.num_layers, num_heads=v.num_heads,
                hidden_dim=v.hidden_size, mlp_dim=v.mlp_dim)
  if "heads.head.weight" in sd:
    kwargs["num_classes"] = sd["heads.head.weight"].shape[0]
  if "heads.pre_logits.weight" in sd:
    kwargs["representation_size"] = sd["heads.pre_logits.weight"].shape[0]
  stem = _conv_stem_from_keys(sd)
  if stem:
    strides = _stem_strides(stem, v.patch_size, conv_stem)
    kwargs["conv_stem_configs"] = [ConvStemConfig(c, k, s)
                                   for (c, k), s in zip(stem, strides)]
  model = torchvision.models.VisionTransformer(**kwargs)
  model.load_state_dict(sd, strict=True)
  return model.eval()


# --------------------------------------------------------------------------- #
# torchvision's released weights.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Preprocessing:
  """How images must be prepared for a set of weights (torchvision's
  ``ImageClassification`` transform): resize the short side to
  ``resize_size`` with ``interpolation``, center-crop ``crop_size``, scale
  to [0, 1], normalise with ``mean``/``std``; then NHWC."""

  crop_size: int = 224
  resize_size: int = 256
  interpolation: str = "bilinear"
  mean: Tuple[float, float, float] = (0.485, 0.456, 0.406)
  std: Tuple[float, float, float] = (0.229, 0.224, 0.225)


class TorchvisionWeights(NamedTuple):
  model: Any
  variables: Any
  preprocessing: Preprocessing
  categories: Optional[Sequence[str]] = None


def _weights_enum(name: str, weights: str):
  import torchvision  # pylint: disable=import-outside-toplevel

  enum_name = name.upper().replace("VIT_", "ViT_") + "_Weights"
  try:
    enum = torchvision.models.get_weight(f"{enum_name}.{weights}")
  except (ValueError, KeyError, AttributeError) as e:
    raise ValueError(
        f"torchvision has no weights {weights!r} for {name} ({e}). Pass one "
        f"of torchvision's names (e.g. 'IMAGENET1K_V1', "
        f"'IMAGENET1K_SWAG_E2E_V1') or a path to a .pth file.") from None
  return enum


def _preprocessing_of(enum) -> Preprocessing:
  t = enum.transforms()
  interp = getattr(t.interpolation, "value", str(t.interpolation))
  return Preprocessing(
      crop_size=int(t.crop_size[0]), resize_size=int(t.resize_size[0]),
      interpolation=str(interp), mean=tuple(t.mean), std=tuple(t.std))


def _download_state_dict(enum):
  import torch  # pylint: disable=import-outside-toplevel

  return torch.hub.load_state_dict_from_url(
      enum.url, progress=True, check_hash=True, weights_only=True)


def load_state_dict_file(path: str):
  """Reads a ``.pth``/``.pt`` file without running pickled code
  (``torch.load(weights_only=True)``); unwraps ``{'model': ...}`` /
  ``{'state_dict': ...}`` training checkpoints."""
  import torch  # pylint: disable=import-outside-toplevel

  if not os.path.isfile(path):
    raise FileNotFoundError(f"No such checkpoint file: {path!r}")
  try:
    obj = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as e:  # pickle.UnpicklingError and friends
    raise ValueError(
        f"Cannot read {path!r} as a plain tensor state dict with "
        f"torch.load(weights_only=True): {e}. Checkpoints holding arbitrary "
        f"pickled objects are refused because loading them runs code.") from e
  for key in ("model", "state_dict", "model_state_dict"):
    if isinstance(obj, Mapping) and key in obj and isinstance(obj[key], Mapping):
      obj = obj[key]
  return obj


def load_torchvision(name: str, weights: str = "IMAGENET1K_V1", *,
                     image_size=None, **model_overrides) -> TorchvisionWeights:
  """torchvision's released weights (or a ``.pth`` file) as Flax variables.

  ``weights`` is a torchvision weights name (``"IMAGENET1K_V1"``,
  ``"IMAGENET1K_SWAG_E2E_V1"``, ...; downloaded through torch.hub, hash
  checked, read with ``weights_only=True``) or a path to a saved state dict.
  Returns ``(model, variables, preprocessing, categories)``; the model runs
  at the resolution the weights expect unless ``image_size`` is given.
  """
  categories = None
  is_file = (os.path.sep in weights or os.path.exists(weights) or
             weights.endswith((".pth", ".pt")))
  if is_file:
    state_dict = load_state_dict_file(weights)
  else:
    enum = _weights_enum(name, weights)
    categories = enum.meta.get("categories")
    state_dict = _download_state_dict(enum)
  model, variables = from_torchvision(state_dict, name, image_size=image_size,
                                      **model_overrides)
  rows = variables["params"]["Transformer"]["posembed_input"][
      "pos_embedding"].shape[1]
  crop = _grid_of(rows - 1, "pos_embedding")[0] * model.patch_size
  if is_file:  # torchvision's classic recipe: resize 256 -> crop 224
    pre = Preprocessing(crop_size=crop, resize_size=int(round(crop * 256 / 224)))
  else:
    pre = _preprocessing_of(enum)
    ratio = pre.resize_size / pre.crop_size
    pre = dataclasses.replace(pre, crop_size=crop,
                              resize_size=int(round(crop * ratio)))
  return TorchvisionWeights(model, variables, pre, categories)
