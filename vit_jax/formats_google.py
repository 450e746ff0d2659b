"""Google ``.npz`` checkpoints: google-research/vision_transformer and big_vision.

Read with ``np.load(allow_pickle=False)``; re-exported by
:mod:`vit_jax.formats` (see its docstring for the key mapping).

Numerics: Google's models were trained with flax's default GELU (the tanh
approximation); like timm, vit_jax runs them with the exact (erf) GELU that
torchvision parity needs. The two differ by less than 1e-3 per activation;
logits of loaded checkpoints are therefore timm's, not bit-for-bit big_vision's.
What is not supported is reported by name: ResNet hybrids (``conv_root``),
``map`` heads (``MAPHead_0``); big_vision's ``pool_type='0'`` (first patch
token, no class token) cannot be told from ``gap`` by the weights and loads
as ``gap``.
"""

from __future__ import annotations

import collections
import re
from typing import Any, Mapping, Optional

import numpy as np

from vit_jax import convert, models
from vit_jax.formats_arch import F32, finish, flatten, to_numpy, unflatten

_MODULE_NUM = re.compile(r"^(.*)_(\d+)$")


def _natural_key(s: str):
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def convert_pre_linen(tree):
  """Renumbers pre-Linen submodule names per class (``LayerNorm_2`` ->
  ``LayerNorm_1``, ``MultiHeadDotProductAttention_1`` -> ``_0``,
  ``MlpBlock_3`` -> ``MlpBlock_0``), exactly as
  ``flax.training.checkpoints.convert_pre_linen`` (without importing its
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


_NPZ_PREFIXES = ("", "opt/target/", "params/", "params/img/")


def npz_to_params(arrays: Mapping[str, Any], *, image_size=None):
  """Flat '/'-keyed arrays of a Google ViT checkpoint -> ``(variables, arch)``.

  ``image_size`` is only needed for big_vision models with a fixed
  ``sincos2d`` position embedding (nothing stored): it is computed for that
  resolution.
  """
  keys = list(arrays)
  prefix = next((p for p in _NPZ_PREFIXES if f"{p}embedding/kernel" in arrays),
                None)
  if prefix is None:
    if any(k.endswith("conv_root/kernel") for k in keys):
      raise ValueError("This is a ResNet+ViT hybrid (R50+ViT) checkpoint "
                       "('conv_root'); only plain ViTs are supported.")
    raise ValueError(
        "Not a Google ViT checkpoint: no 'embedding/kernel' under any of the "
        f"prefixes {[p or '<none>' for p in _NPZ_PREFIXES]} (first keys: "
        f"{keys[:6]}).")
  flat = {k[len(prefix):]: to_numpy(v) for k, v in arrays.items()
          if k.startswith(prefix)}
  tree = convert_pre_linen(unflatten(flat))
  if "MAPHead_0" in tree or "probe" in tree:
    raise ValueError("This big_vision model has a 'map' head (MAPHead_0: "
                     "attention pooling); vit_jax supports the class-token "
                     "('tok') and 'gap' heads only.")
  tr = tree.get("Transformer")
  if not isinstance(tr, dict):
    raise ValueError("Not a ViT checkpoint: no 'Transformer' subtree")
  tree = convert.unstack_layers(tree)
  tr = tree["Transformer"]
  d = int(tree["embedding"]["kernel"].shape[-1])
  kernel = tree["embedding"]["kernel"]
  if kernel.ndim != 4:
    raise ValueError(f"embedding/kernel: expected a conv kernel (P, P, C, D), "
                     f"got shape {kernel.shape}")
  p = int(kernel.shape[0])
  has_cls = "cls" in tree

  # Position embedding: ours is Transformer/posembed_input/pos_embedding,
  # with a class row when there is a class token.
  if "posembed_input" in tr:
    pe = tr.pop("posembed_input")["pos_embedding"]
    if has_cls and _is_square(pe.shape[1]):  # added before the cls concat
      pe = _with_zero_row(pe)
  else:
    pe = tree.pop("pos_embedding", None)
    if pe is None:
      pe = tr.pop("pos_embedding", None)
    if pe is None:  # big_vision 'sincos2d': nothing stored.
      if image_size is None:
        raise ValueError(
            "This checkpoint stores no position embedding (big_vision's fixed "
            "'sincos2d'); pass image_size to compute it for a resolution.")
      gh, gw = models._pair(image_size)  # pylint: disable=protected-access
      pe = posemb_sincos_2d(gh // p, gw // p, d)
    if has_cls and _is_square(pe.shape[1]):
      pe = _with_zero_row(pe)
  tr["posembed_input"] = {"pos_embedding": pe}
  tree["Transformer"] = tr
  rows = int(pe.shape[1]) - (1 if has_cls else 0)
  if not _is_square(rows):
    raise ValueError(f"Position embedding has {pe.shape[1]} rows: not a "
                     f"square patch grid (+ class row)")
  blocks = sorted((k for k in tr if k.startswith("encoderblock_")),
                  key=_natural_key)
  if not blocks:
    raise ValueError("No Transformer/encoderblock_N in the checkpoint")
  b0 = tr[blocks[0]]
  try:
    heads = int(b0["MultiHeadDotProductAttention_0"]["query"]["kernel"].shape[1])
    mlp = int(b0["MlpBlock_0"]["Dense_0"]["kernel"].shape[-1])
  except (KeyError, TypeError, IndexError) as e:
    raise ValueError(f"{blocks[0]} does not look like a ViT block (missing "
                     f"{e}); keys: {sorted(b0)}") from None
  rep = tree.get("pre_logits", {}).get("kernel")
  head = tree.get("head", {}).get("kernel")
  arch = dict(patch_size=p, hidden_size=d, num_layers=len(blocks),
              num_heads=heads, mlp_dim=mlp,
              num_classes=int(head.shape[-1]) if head is not None else 0,
              representation_size=int(rep.shape[-1]) if rep is not None else None,
              classifier="token" if has_cls else "gap", conv_stem=None,
              image_size=int(round(np.sqrt(rows))) * p)
  if head is None and rep is not None:
    arch["num_classes"] = 0  # features only: pre_logits is dropped by the model
  return {"params": convert._tree_map_np(F32, tree)}, arch  # pylint: disable=protected-access


def _is_square(n: int) -> bool:
  s = int(round(np.sqrt(n)))
  return s * s == n


def _with_zero_row(pe):
  return np.concatenate([np.zeros_like(pe[:, :1]), pe], axis=1)


_PRE_LINEN_BLOCK = {"LayerNorm_0": "LayerNorm_0",
                    "MultiHeadDotProductAttention_0": "MultiHeadDotProductAttention_1",
                    "LayerNorm_1": "LayerNorm_2", "MlpBlock_0": "MlpBlock_3"}


def params_to_npz(variables, layout: str = "vision_transformer",
                  scan: bool = False) -> "dict[str, np.ndarray]":
  """Our tree -> the flat '/'-keyed arrays of a Google ``.npz``.

  ``layout='vision_transformer'``: the released ViT/AugReg files' layout
  (pre-Linen block names, ``Transformer/posembed_input`` with the class row);
  what timm's ``_load_weights`` and vision_transformer's ``load_pretrained``
  read. ``layout='big_vision'``: Linen names, a top-level ``pos_embedding``
  without the class row (that row is folded into ``cls``, as big_vision's
  ``fix_old_checkpoints`` does), and with ``scan=True`` the blocks stacked
  under ``Transformer/encoderblock``.
  """
  if layout not in ("vision_transformer", "big_vision"):
    raise ValueError(f"layout={layout!r}: expected 'vision_transformer' or "
                     f"'big_vision'")
  variables = convert.unstack_layers(dict(variables))
  p = dict(convert._params_of(variables))  # pylint: disable=protected-access
  if any(k.startswith("stem_") for k in p):
    raise ValueError("Google .npz ViTs have no conv stem; this tree cannot be "
                     "saved in that format (use safetensors).")
  p = convert._tree_map_np(F32, p)  # pylint: disable=protected-access
  tr = dict(p["Transformer"])
  blocks = sorted((k for k in tr if k.startswith("encoderblock_")),
                  key=_natural_key)
  if layout == "vision_transformer":
    for k in blocks:
      tr[k] = {_PRE_LINEN_BLOCK[n]: v for n, v in tr[k].items()}
  else:
    pe = tr.pop("posembed_input")["pos_embedding"]
    if "cls" in p:
      p["cls"] = (p["cls"] + pe[:, :1]).astype(np.float32)
      pe = pe[:, 1:]
    p["pos_embedding"] = pe
    if scan:
      stacked = convert.stack_layers({"Transformer": tr})["Transformer"]
      tr = stacked
  p["Transformer"] = tr
  return {k: np.ascontiguousarray(v) for k, v in flatten(p).items()}


def save_npz(variables, path: str, layout: str = "vision_transformer",
             scan: bool = False) -> None:
  """Writes :func:`params_to_npz` to ``path`` (``np.savez``, no pickle)."""
  arrays = params_to_npz(variables, layout=layout, scan=scan)
  with open(path, "wb") as f:
    np.savez(f, **arrays)


def read_npz(path: str) -> "dict[str, np.ndarray]":
  """All arrays of an ``.npz`` file, read with ``allow_pickle=False``."""
  try:
    with np.load(path, allow_pickle=False) as f:
      if not hasattr(f, "files"):
        raise ValueError("it holds a single array (.npy), not named arrays")
      return {k: f[k] for k in f.files}
  except FileNotFoundError:
    raise FileNotFoundError(f"No such checkpoint file: {path!r}") from None
  except ValueError as e:
    raise ValueError(f"Cannot read {path!r} as an .npz of arrays without "
                     f"pickle: {e}") from None
  except (OSError, EOFError) as e:
    raise ValueError(f"Cannot read {path!r} as an .npz file: {e}") from None


def load_npz(path: str, name: Optional[str] = None, *, image_size=None,
             **model_overrides):
  """A Google ``.npz`` ViT (vision_transformer or big_vision) ->
  ``(model, variables)``. ``name`` (optional) is checked against the weights;
  ``image_size`` resamples the position embedding."""
  variables, arch = npz_to_params(read_npz(path), image_size=image_size)
  return finish(variables, arch, name, image_size, model_overrides)
