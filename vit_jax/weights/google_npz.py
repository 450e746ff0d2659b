"""Google ``.npz`` checkpoints (google-research/vision_transformer, big_vision):
their trees are ours up to a short, ordered list of fix-ups, the way
big_vision's ``fix_old_checkpoints`` reads.

Reading (:func:`npz_to_tree`), in order:

1. the model's subtree: keys under ``''``, ``opt/target/``, ``params/`` or
   ``params/img/`` (a two-tower model's image tower);
2. pre-Linen names renumbered per class (``MultiHeadDotProductAttention_1``
   -> ``_0``, ``LayerNorm_2`` -> ``LayerNorm_1``, ``MlpBlock_3`` ->
   ``MlpBlock_0``), as ``flax.training.checkpoints.convert_pre_linen``;
3. a scanned ``Transformer/encoderblock`` unstacked;
4. big_vision's position embedding (top-level ``pos_embedding``, patch rows
   only, added before the class token is concatenated) becomes our
   ``posembed_input`` of a ``no_embed_class`` model, which computes the same
   function; a fixed ``sincos2d`` embedding (nothing stored) is computed.
5. a hybrid's GroupNorm scales and biases stored (1, 1, 1, C) by flax
   before 0.3.6 are squeezed to (C,), as vision_transformer's
   ``checkpoint._fix_groupnorm``.

Numerics: Google's models were trained with flax's default GELU (the tanh
approximation). Loads use the exact GELU, as timm does for the same files
(the two differ by less than 1e-3 per activation); pass ``act='gelu_tanh'``
to :func:`vit_jax.weights.load` for big_vision's function exactly.
The ResNet hybrids (R50+ViT-B/16 ..., ``conv_root``) load as Google's
``models_vit.VisionTransformer(resnet=...)`` computes them: its weight
standardisation and GroupNorm constants (:data:`vit_jax.models.resnet.
GOOGLE`; timm's differ, and no other library computes these files
exactly) and its tanh GELU (:data:`HYBRID_DEFAULTS`; ``act='gelu'`` for
timm's choice). big_vision's ``pool_type='0'`` (first patch token) cannot
be told from ``gap`` by the weights and loads as ``gap``.
"""

from __future__ import annotations

import collections
import re
from typing import Any, Mapping

import numpy as np

from vit_jax import models
from vit_jax.weights import trees

_MODULE_NUM = re.compile(r"^(.*)_(\d+)$")
_GROUPNORM = re.compile(r"^gn(\d+|_root|_proj)$")
# What a hybrid .npz loads with unless stated (Google's module's function).
HYBRID_DEFAULTS = {"act": "gelu_tanh"}
PREFIXES = ("", "opt/target/", "params/", "params/img/")
_PRE_LINEN_BLOCK = {"LayerNorm_0": "LayerNorm_0",
                    "MultiHeadDotProductAttention_0": "MultiHeadDotProductAttention_1",
                    "LayerNorm_1": "LayerNorm_2", "MlpBlock_0": "MlpBlock_3"}


def _natural_key(s: str):
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def convert_pre_linen(tree):
  """Renumbers pre-Linen submodule names per class, exactly as
  ``flax.training.checkpoints.convert_pre_linen`` (without its
  TensorFlow-backed module). Linen trees come back unchanged."""
  if not isinstance(tree, Mapping):
    return tree
  out, counts = {}, collections.Counter()
  for name in sorted(tree, key=_natural_key):
    m = _MODULE_NUM.match(name)
    new = name
    if m:
      new = f"{m.group(1)}_{counts[m.group(1)]}"
      counts[m.group(1)] += 1
    out[new] = convert_pre_linen(tree[name])
  return out


def posemb_sincos_2d(h: int, w: int, width: int, temperature: float = 10_000.):
  """big_vision's fixed ``sincos2d`` position embedding, (1, h*w, width)."""
  if width % 4:
    raise ValueError(f"sincos2d position embedding needs a width divisible "
                     f"by 4, got {width}")
  y, x = np.mgrid[:h, :w]
  omega = np.arange(width // 4, dtype=np.float32) / np.float32(width // 4 - 1)
  omega = (1.0 / (np.float32(temperature) ** omega)).astype(np.float32)
  y = np.einsum("m,d->md", y.flatten().astype(np.float32), omega)
  x = np.einsum("m,d->md", x.flatten().astype(np.float32), omega)
  pe = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
  return pe.astype(np.float32)[None]


def _subtree(arrays: Mapping[str, Any]) -> dict:
  prefix = next((p for p in PREFIXES if f"{p}embedding/kernel" in arrays),
                None)
  if prefix is None:
    keys = list(arrays)
    raise ValueError(
        "Not a Google ViT checkpoint: no 'embedding/kernel' under any of the "
        f"prefixes {[p or '<none>' for p in PREFIXES]} (first keys: "
        f"{keys[:6]}).")
  return trees.unflatten({k[len(prefix):]: trees.f32(v)
                          for k, v in arrays.items() if k.startswith(prefix)})


def _fix_groupnorm(tree):
  """GroupNorm ``scale`` / ``bias`` of shape (1, 1, 1, C) -> (C,)."""
  def fix(node, name=""):
    if not isinstance(node, Mapping):
      return node
    out = {}
    for k, v in node.items():
      if (_GROUPNORM.match(name) and k in ("scale", "bias") and
          not isinstance(v, Mapping) and np.ndim(v) == 4):
        v = np.reshape(v, (-1,))
      out[k] = fix(v, k)
    return out
  return fix(tree)


def is_hybrid(variables) -> bool:
  """Whether a tree (or variables) has a ResNet stem (``conv_root``)."""
  return "conv_root" in trees.params_of(variables)


def npz_to_tree(arrays: Mapping[str, Any], *, image_size=None) -> dict:
  """Flat '/'-keyed arrays of a Google ViT -> our variables. ``image_size``
  is needed only for big_vision's fixed ``sincos2d``."""
  tree = _fix_groupnorm(convert_pre_linen(_subtree(arrays)))
  if not isinstance(tree.get("Transformer"), dict):
    raise ValueError("Not a ViT checkpoint: no 'Transformer' subtree")
  tree = trees.unstack_layers(tree)
  tr = tree["Transformer"]
  kernel = tree["embedding"]["kernel"]
  if kernel.ndim != 4:
    raise ValueError(f"embedding/kernel: expected a conv kernel (P, P, C, D), "
                     f"got shape {kernel.shape}")
  if "posembed_input" in tr:
    pe = tr["posembed_input"]["pos_embedding"]
  else:
    pe = tree.pop("pos_embedding", tr.pop("pos_embedding", None))
    if pe is None:  # big_vision 'sincos2d': nothing stored.
      if image_size is None:
        raise ValueError(
            "This checkpoint stores no position embedding (big_vision's "
            "fixed 'sincos2d'); pass image_size to compute it for a "
            "resolution.")
      gh, gw = models.pair(image_size)
      p = int(kernel.shape[0])
      pe = posemb_sincos_2d(gh // p, gw // p, int(kernel.shape[-1]))
    tr["posembed_input"] = {"pos_embedding": pe}
  return {"params": tree}


def npz_to_params(arrays: Mapping[str, Any], *, image_size=None):
  """Flat arrays of a Google ViT -> ``(variables, arch)``: our tree after
  the fix-ups, and the :class:`~vit_jax.models.VisionTransformer` fields
  plus ``image_size`` (the position embedding's resolution)."""
  variables = npz_to_tree(arrays, image_size=image_size)
  arch = trees.arch_of(variables)
  if is_hybrid(variables):
    arch.update(HYBRID_DEFAULTS)
  arch["image_size"] = trees.native_image_size(variables,
                                               models.get_model(arch))
  return variables, arch


def _is_square(n: int) -> bool:
  s = int(round(np.sqrt(max(n, 0))))
  return s * s == n


def tree_to_npz(variables, layout: str = "vision_transformer",
                scan: bool = False) -> "dict[str, np.ndarray]":
  """Our tree -> the flat '/'-keyed arrays of a Google ``.npz``.

  ``layout='vision_transformer'``: the released ViT/AugReg files' layout
  (pre-Linen block names, ``Transformer/posembed_input`` with the class
  row); what timm's ``_load_weights`` and vision_transformer's
  ``load_pretrained`` read. ``layout='big_vision'``: Linen names, a
  top-level ``pos_embedding`` without the class row (that row is folded into
  ``cls``, as big_vision's ``fix_old_checkpoints`` does), and with
  ``scan=True`` the blocks stacked under ``Transformer/encoderblock``.
  """
  if layout not in ("vision_transformer", "big_vision"):
    raise ValueError(f"layout={layout!r}: expected 'vision_transformer' or "
                     f"'big_vision'")
  p = dict(trees.params_of(trees.unstack_layers(trees.wrap(variables))))
  bad = [k for k in p if k.startswith("stem_") or k == "registers"]
  if bad:
    raise ValueError(f"Google .npz ViTs have no {bad[0]} (conv stem / "
                     f"registers); this tree cannot be saved in that format "
                     f"(use safetensors).")
  p = trees.tree_map(trees.f32, p)
  tr = dict(p["Transformer"])
  pe = tr["posembed_input"]["pos_embedding"]
  side_rows = pe.shape[1] - int("cls" in p)
  embeds_cls = "cls" in p and _is_square(side_rows)
  blocks = sorted((k for k in tr if k.startswith("encoderblock_")),
                  key=_natural_key)
  if layout == "vision_transformer":
    if "cls" in p and not embeds_cls:  # no_embed_class: a zero class row
      tr["posembed_input"] = {"pos_embedding": np.concatenate(
          [np.zeros_like(pe[:, :1]), pe], axis=1)}
    for k in blocks:
      tr[k] = {_PRE_LINEN_BLOCK.get(n, n): v for n, v in tr[k].items()}
  else:
    tr.pop("posembed_input")
    if embeds_cls:
      p["cls"] = (p["cls"] + pe[:, :1]).astype(np.float32)
      pe = pe[:, 1:]
    p["pos_embedding"] = pe
    if scan:
      tr = trees.stack_layers({"Transformer": tr})["Transformer"]
  p["Transformer"] = tr
  return {k: np.ascontiguousarray(v) for k, v in trees.flatten(p).items()}
