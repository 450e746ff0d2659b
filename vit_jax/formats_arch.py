"""What architecture a set of weights is: read it, check it, build it.

Shared by the checkpoint formats (:mod:`vit_jax.formats`,
:mod:`vit_jax.formats_io`) and the loaders of :mod:`vit_jax.inference`. An
*arch* is a dict of :class:`~vit_jax.models.VisionTransformer` fields
(``patch_size``, ``hidden_size``, ``num_layers``, ``num_heads``, ``mlp_dim``,
``num_classes``, ``representation_size``, ``classifier``, ``conv_stem``)
plus ``image_size``, the resolution the position embedding was made for.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Optional

import numpy as np

from vit_jax import convert, models

ARCH_FIELDS = ("patch_size", "hidden_size", "num_layers", "num_heads",
               "mlp_dim", "num_classes", "representation_size", "classifier",
               "conv_stem")

_TIMM_SIZES = {"tiny": "ti", "small": "s", "base": "b", "large": "l",
               "huge": "h"}
_TIMM_NAME = re.compile(r"^vit_(tiny|small|base|large|huge)_patch(\d+)"
                        r"(?:_(\d+))?(?:[._].*)?$")


def variant_from_name(name: str) -> models.Variant:
  """``vit_b_16`` (ours), ``B/16`` (big_vision) or ``vit_base_patch16_224``
  (timm, optionally with a ``.tag``) -> :class:`~vit_jax.models.Variant`."""
  m = _TIMM_NAME.match(name)
  if m:
    return models.decode_variant(f"vit_{_TIMM_SIZES[m.group(1)]}_{m.group(2)}")
  try:
    return models.decode_variant(name)
  except ValueError as e:
    raise ValueError(f"{e} timm names such as 'vit_base_patch16_224' are "
                     f"accepted too.") from None


def num_heads_for(width: int) -> int:
  """The standard number of heads for a width (Ti 3, S 6, B 12, L/H 16)."""
  table = {w: h for w, _, h, _ in models.SIZES.values()}
  if width not in table:
    raise ValueError(
        f"The number of attention heads is not stored in these weights and "
        f"width {width} is not a standard ViT width ({sorted(table)}): pass "
        f"num_heads (or the variant name, e.g. --model vit_b_16).")
  return table[width]


def variant_name(arch: Mapping[str, Any]) -> Optional[str]:
  """Our name for the arch's size (``vit_b_16``) if it is a standard one."""
  for size, (w, depth, heads, mlp) in models.SIZES.items():
    if (arch.get("hidden_size"), arch.get("num_layers"), arch.get("num_heads"),
        arch.get("mlp_dim")) == (w, depth, heads, mlp):
      return f"vit_{size}_{arch.get('patch_size')}"
  return None


def describe_arch(arch: Mapping[str, Any]) -> str:
  """One line: ``vit_b_16 (width 768, 12 layers, 12 heads, MLP 3072, ...)``."""
  parts = [f"width {arch.get('hidden_size')}", f"{arch.get('num_layers')} layers",
           f"{arch.get('num_heads')} heads", f"MLP {arch.get('mlp_dim')}",
           f"patch {arch.get('patch_size')}"]
  if arch.get("conv_stem"):
    parts.append(f"conv stem of {len(arch['conv_stem'])} layers")
  if arch.get("classifier", "token") != "token":
    parts.append(f"classifier {arch['classifier']!r}")
  if arch.get("representation_size"):
    parts.append(f"pre_logits {arch['representation_size']}")
  parts.append(f"{arch.get('num_classes') or 'no'} classes")
  if arch.get("image_size"):
    parts.append(f"{arch['image_size']}px")
  name = variant_name(arch)
  return f"{name or 'a ViT'} ({', '.join(parts)})"


def arch_of(variables, conv_stem=None) -> dict:
  """Reads the arch from one of our trees (per-layer or scanned).

  Conv-stem strides are not stored in weights: pass ``conv_stem`` for a tree
  with ``stem_convs_*``.
  """
  p = convert._params_of(variables)  # pylint: disable=protected-access
  tr = p["Transformer"]
  if "encoderblock" in tr:
    blk = tr["encoderblock"]
    depth = int(np.shape(blk["LayerNorm_0"]["scale"])[0])
    first = lambda x: np.shape(x)[1:]  # noqa: E731
  else:
    blocks = [k for k in tr if k.startswith("encoderblock_")]
    depth = len(blocks)
    blk = tr["encoderblock_0"]
    first = np.shape
  q = first(blk["MultiHeadDotProductAttention_0"]["query"]["kernel"])
  mlp = first(blk["MlpBlock_0"]["Dense_0"]["kernel"])[-1]
  emb = np.shape(p["embedding"]["kernel"])
  stem_keys = sorted((k for k in p if k.startswith("stem_convs_")),
                     key=lambda k: int(k.rsplit("_", 1)[1]))
  if stem_keys:
    if conv_stem is None:
      raise ValueError("This tree has a conv stem, whose strides are not "
                       "stored in the weights: pass conv_stem.")
    conv_stem = tuple(c if isinstance(c, models.ConvStemConfig)
                      else models.ConvStemConfig(*c) for c in conv_stem)
    patch = int(np.prod([c.stride for c in conv_stem]))
  else:
    conv_stem, patch = None, int(emb[0])
  has_cls = "cls" in p
  rows = int(np.shape(tr["posembed_input"]["pos_embedding"])[1]) - int(has_cls)
  side = int(round(np.sqrt(rows)))
  head = p.get("head", {}).get("kernel")
  rep = p.get("pre_logits", {}).get("kernel")
  return dict(patch_size=patch, hidden_size=int(emb[-1]), num_layers=depth,
              num_heads=int(q[1]), mlp_dim=int(mlp),
              num_classes=int(np.shape(head)[-1]) if head is not None else 0,
              representation_size=int(np.shape(rep)[-1]) if rep is not None else None,
              classifier="token" if has_cls else "gap", conv_stem=conv_stem,
              image_size=side * patch if side * side == rows else None)


def arch_to_json(arch: Mapping[str, Any]) -> dict:
  """A JSON-able copy (conv stem as ``[[out_channels, kernel, stride], ...]``)."""
  out = {k: arch.get(k) for k in ARCH_FIELDS + ("image_size",)}
  if out["conv_stem"]:
    out["conv_stem"] = [list(dataclasses.astuple(c)) for c in out["conv_stem"]]
  return out


def arch_from_json(d: Mapping[str, Any]) -> dict:
  unknown = sorted(set(d) - set(ARCH_FIELDS) - {"image_size"})
  if unknown:
    raise ValueError(f"Unknown architecture fields {unknown}; known: "
                     f"{list(ARCH_FIELDS) + ['image_size']}")
  out = dict(d)
  if out.get("conv_stem"):
    out["conv_stem"] = tuple(models.ConvStemConfig(*c) for c in out["conv_stem"])
  return out


def build_model(arch: Mapping[str, Any], **overrides) -> models.VisionTransformer:
  """The :class:`~vit_jax.models.VisionTransformer` of an arch (any field
  can be overridden, e.g. ``dtype``, ``scan_layers``,
  ``sow_attention_weights``)."""
  fields = {f.name for f in dataclasses.fields(models.VisionTransformer)} - {
      "parent", "name"}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise TypeError(f"unknown model option(s) {unknown}; valid options are "
                    f"{sorted(fields)}")
  kwargs = {k: arch[k] for k in ARCH_FIELDS if k in arch}
  kwargs.update(overrides)
  if kwargs.get("conv_stem"):
    kwargs["conv_stem"] = tuple(
        c if isinstance(c, models.ConvStemConfig) else models.ConvStemConfig(*c)
        for c in kwargs["conv_stem"])
  return models.VisionTransformer(**kwargs)


def _shapes(tree, prefix=""):
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(_shapes(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = tuple(np.shape(v))
  return out


def check_variables(model: models.VisionTransformer, variables, image_size):
  """Raises a ValueError naming every missing, unexpected and mis-shaped
  variable of ``variables`` (per-layer tree) against what ``model`` at
  ``image_size`` needs; nothing is computed (``jax.eval_shape``)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  h, w = models._pair(image_size)  # pylint: disable=protected-access
  x = jax.ShapeDtypeStruct((1, h, w, model.num_channels), jnp.float32)
  ref = model.clone(scan_layers=False, remat_policy=None)
  want = jax.eval_shape(lambda x: ref.init(jax.random.key(0), x, train=False), x)
  want = _shapes({k: v for k, v in want.items() if k != "intermediates"})
  have = _shapes(dict(variables))
  missing = [k for k in want if k not in have]
  unexpected = [k for k in have if k not in want]
  misshaped = [f"{k}: expected {want[k]}, got {have[k]}" for k in want
               if k in have and have[k] != want[k]]
  if missing or unexpected or misshaped:
    lines = ["The weights do not fit the model they describe:"]
    for title, items in (("missing", missing), ("unexpected", unexpected),
                         ("mis-shaped", misshaped)):
      if items:
        lines.append(f"  {title} ({len(items)}): " + ", ".join(items[:12]) +
                     (f" ... and {len(items) - 12} more" if len(items) > 12 else ""))
    raise ValueError("\n".join(lines))


# --------------------------------------------------------------------------- #
# Helpers shared by the formats.
# --------------------------------------------------------------------------- #

F32 = lambda x: np.ascontiguousarray(np.asarray(x, dtype=np.float32))  # noqa: E731


def to_numpy(x) -> np.ndarray:
  """torch tensor / jax array / numpy -> numpy (float16/bfloat16 -> float32)."""
  if hasattr(x, "detach"):  # torch.Tensor, without importing torch
    x = x.detach().cpu()
    if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
      x = x.float()
    return x.numpy().copy()  # .numpy() would share the tensor's memory
  x = np.asarray(x)
  if x.dtype.kind == "V" and x.dtype.itemsize == 2:  # bfloat16 saved by numpy
    import ml_dtypes  # pylint: disable=import-outside-toplevel
    x = x.view(ml_dtypes.bfloat16)
  if x.dtype != np.float32 and x.dtype.kind in "fV":
    x = x.astype(np.float32)
  return x


def unflatten(flat: Mapping[str, Any], sep: str = "/") -> dict:
  tree: dict = {}
  for key, value in flat.items():
    node = tree
    parts = key.split(sep)
    for p in parts[:-1]:
      node = node.setdefault(p, {})
      if not isinstance(node, dict):
        raise ValueError(f"Key {key!r} nests under a leaf")
    node[parts[-1]] = value
  return tree


def flatten(tree: Mapping[str, Any], prefix: str = "", sep: str = "/") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(flatten(v, f"{prefix}{k}{sep}", sep))
    else:
      out[f"{prefix}{k}"] = v
  return out


check_flat = convert.check_keys  # missing / unexpected / mis-shaped, by name


def finish(variables, arch, name, image_size, overrides):
  if name is not None:
    check_name(arch, name)
  if image_size is not None:
    variables = convert.resize_posemb(variables, image_size, arch["patch_size"])
  model = build_model(arch, **overrides)
  check_variables(model, variables, image_size or arch["image_size"])
  if model.scan_layers:
    variables = convert.stack_layers(variables)
  return model, variables


def check_name(arch, name):
  v = variant_from_name(name)
  want = dict(hidden_size=v.hidden_size, num_layers=v.num_layers,
              num_heads=v.num_heads, mlp_dim=v.mlp_dim, patch_size=v.patch_size)
  diff = [f"{k} {arch[k]} (expected {want[k]})" for k in want
          if arch.get(k) != want[k]]
  if diff:
    raise ValueError(
        f"The checkpoint is not a {name}: it has {', '.join(diff)}. It looks "
        f"like {describe_arch(arch)}; pass that variant instead.")
