"""The named ViTs and the one constructor.

``SIZES`` is the one table of sizes (width, depth, heads, MLP): a name
``vit_{ti,s,b,l,h}_{patch}`` (torchvision's) or big_vision's ``B/16``
decodes into it; :func:`get_model` builds a
:class:`~vit_jax.models.vit.VisionTransformer` from a name, a
:class:`Variant` or a mapping of its fields (an architecture read from
weights), with any field overridden.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Mapping, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.models import mbconv as mbconv_lib
from vit_jax.models import resnet as resnet_lib
from vit_jax.models.vit import ConvStemConfig, VisionTransformer, pair

# --------------------------------------------------------------------------- #
# Variants: one table of sizes; a name ``vit_{size}_{patch}`` decodes into it.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Variant:
  """Architecture of one named ViT: what a name like ``vit_b_16`` means."""

  hidden_size: int
  num_layers: int
  num_heads: int
  mlp_dim: int
  patch_size: int

  def as_kwargs(self) -> dict:
    return dataclasses.asdict(self)


# width, depth, heads, mlp_dim (ViT paper Table 1; Ti and S from DeiT / AugReg).
SIZES = {
    "ti": (192, 12, 3, 768),
    "s": (384, 12, 6, 1536),
    "b": (768, 12, 12, 3072),
    "l": (1024, 24, 16, 4096),
    "h": (1280, 32, 16, 5120),
}

_NAME_RE = re.compile(r"^vit_(ti|s|b|l|h)_(\d+)$")
_BV_NAME_RE = re.compile(r"^(Ti|S|B|L|H)/(\d+)$")


def decode_variant(name: str) -> Variant:
  """Decodes ``vit_b_16`` (torchvision style) or ``B/16`` (big_vision style)."""
  m = _NAME_RE.match(name) or _BV_NAME_RE.match(name)
  if m is None:
    raise ValueError(
        f"Unknown ViT variant {name!r}: expected 'vit_{{size}}_{{patch}}' with "
        f"size one of {sorted(SIZES)} (e.g. 'vit_b_16'), or big_vision's "
        f"'B/16', or a timm architecture name (vit_jax.list_models() lists "
        f"them). Registered: {', '.join(VARIANTS)}.")
  size, patch = m.group(1).lower(), int(m.group(2))
  if patch <= 0:
    raise ValueError(f"Patch size must be positive in {name!r}.")
  width, depth, heads, mlp = SIZES[size]
  return Variant(width, depth, heads, mlp, patch)


# The registered variants: torchvision's five, plus Ti and S.
VARIANTS = {
    name: decode_variant(name)
    for name in ("vit_ti_16", "vit_s_16", "vit_s_32", "vit_b_16", "vit_b_32",
                 "vit_l_16", "vit_l_32", "vit_h_14")
}


# --------------------------------------------------------------------------- #
# Public constructors.
# --------------------------------------------------------------------------- #


FIELDS = tuple(f.name for f in dataclasses.fields(VisionTransformer)
               if f.name not in ("parent", "name"))
# Fields that are options of a run (training, compute, input handling), not
# the architecture a checkpoint stores; ARCH_FIELDS are the others.
OPTION_FIELDS = ("num_classes", "image_size", "dropout_rate",
                 "attention_dropout_rate", "drop_path_rate", "head_bias_init",
                 "dtype", "param_dtype", "scan_layers", "remat_policy",
                 "sow_attention_weights", "attention_impl", "dynamic_img_size",
                 "dynamic_img_pad", "rope_shift", "rope_jitter",
                 "rope_rescale", "distilled_training")
ARCH_FIELDS = tuple(f for f in FIELDS if f not in OPTION_FIELDS)


def get_model(name_or_arch: Union[str, Variant, Mapping[str, Any]],
              **overrides) -> VisionTransformer:
  """The one constructor: a name or an architecture -> a linen Module.

  ``name_or_arch`` is a variant name (``vit_b_16``, big_vision's ``B/16``),
  a timm architecture name (``vit_small_patch14_reg4_dinov2``,
  ``eva02_tiny_patch14_224``: the architecture timm builds by default, its
  classes and image size included; :func:`vit_jax.list_models` lists them),
  a :class:`Variant`, or a mapping of :class:`VisionTransformer` fields (an
  architecture, e.g. what :func:`vit_jax.weights.arch_of` reads from a
  tree). Any field can be overridden, e.g. ``get_model("vit_b_16",
  num_classes=10, drop_path_rate=0.1, dtype=jnp.bfloat16)``.
  """
  timm_arch = (timm_architecture(name_or_arch)
               if isinstance(name_or_arch, str) else None)
  if timm_arch is not None:
    kwargs = timm_arch
  elif isinstance(name_or_arch, str):
    kwargs = decode_variant(name_or_arch).as_kwargs()
  elif isinstance(name_or_arch, Variant):
    kwargs = name_or_arch.as_kwargs()
  elif isinstance(name_or_arch, Mapping):
    kwargs = dict(name_or_arch)
  else:
    raise TypeError(f"get_model: expected a variant name, a Variant or a "
                    f"mapping of VisionTransformer fields, got "
                    f"{type(name_or_arch).__name__}")
  what = name_or_arch if isinstance(name_or_arch, str) else "architecture"
  unknown = sorted(set(kwargs) - set(FIELDS)) + sorted(set(overrides) - set(FIELDS))
  if unknown:
    raise TypeError(f"get_model({what!r}): unknown option(s) {unknown}; "
                    f"valid options are {sorted(FIELDS)}")
  kwargs.update(overrides)
  for key in ("dtype", "param_dtype"):
    if isinstance(kwargs.get(key), str):
      kwargs[key] = jnp.dtype(kwargs[key])
  if kwargs.get("conv_stem") is not None:
    kwargs["conv_stem"] = tuple(
        c if isinstance(c, ConvStemConfig) else ConvStemConfig(*c)
        for c in kwargs["conv_stem"])
  if kwargs.get("resnet") is not None:  # a record (JSON) or stage depths
    kwargs["resnet"] = resnet_lib.as_config(kwargs["resnet"])
  if kwargs.get("mbconv") is not None:  # a record (JSON)
    kwargs["mbconv"] = mbconv_lib.as_config(kwargs["mbconv"])
  for key in ("rope_ref_grid", "image_size", "naflex_grid",  # JSON: lists
              "global_attn_indexes"):
    if isinstance(kwargs.get(key), list):
      kwargs[key] = tuple(kwargs[key])
  return VisionTransformer(**kwargs)


def timm_architecture(name: str) -> Optional[dict]:
  """The fields of timm's architecture ``name`` (``vit_base_patch16_224``;
  a ``.tag`` is ignored), as timm builds it by default (its classes and
  image size included), or None for a name that is not one. The table is
  generated from timm (:mod:`vit_jax.weights.pretrained`)."""
  from vit_jax.models import _timm_archs  # pylint: disable=import-outside-toplevel
  record = _timm_archs.ARCHS.get(str(name).split(".", 1)[0])
  return None if record is None else dict(record)


def from_record(name: str, fields: Mapping[str, Any],
                **overrides) -> VisionTransformer:
  """A model from a stored record (a training checkpoint's meta, a
  config): its name and its fields. Where the fields state every size a
  name would give (a custom size, or weights that gave the whole
  architecture) the name, ours or timm's or a recipe's own, is only a
  label; else the name gives the sizes and the fields override them."""
  kwargs = dict(fields, **overrides)
  sizes = {f.name for f in dataclasses.fields(Variant)}
  if sizes <= set(kwargs) or set(ARCH_FIELDS) <= set(kwargs):
    return get_model(kwargs)
  return get_model(name, **kwargs)


def variant_name(arch: Mapping[str, Any]) -> Optional[str]:
  """Our name (``vit_b_16``) for an architecture of a standard size
  (None for a hybrid: a ResNet or ViTamin stem is no variant of ours)."""
  if arch.get("resnet") is not None or arch.get("mbconv") is not None:
    return None
  for size, (w, depth, heads, mlp) in SIZES.items():
    if (arch.get("hidden_size"), arch.get("num_layers"), arch.get("num_heads"),
        arch.get("mlp_dim")) == (w, depth, heads, mlp):
      return f"vit_{size}_{arch.get('patch_size')}"
  return None


def count_params(tree) -> int:
  """Number of scalars in a parameter tree (or ``{'params': ...}``)."""
  if isinstance(tree, dict) and "params" in tree:
    tree = tree["params"]
  return int(sum(np.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(tree)))


def init_params(model: VisionTransformer, image_size: int = 224, seed: int = 0):
  """Initialises ``model`` for square ``image_size`` inputs (shapes only are
  traced, so this is cheap for the large variants under ``jax.jit``)."""
  size = pair(model.image_size or image_size)
  x = jnp.zeros((1, *size, model.num_channels), jnp.float32)
  return jax.jit(functools.partial(model.init, train=False))(
      jax.random.key(seed), x)


def arch_record(model) -> dict:
  """The architecture of ``model`` (a module, or a mapping of its fields)
  as JSON-able data: its :data:`ARCH_FIELDS`, a conv stem as
  ``[out_channels, kernel_size, stride]`` lists, a ResNet stem as its
  :meth:`~vit_jax.models.resnet.ResNetConfig.record`. What a checkpoint stores
  beside its weights; :func:`get_model` takes it back."""
  get = (model.get if isinstance(model, Mapping) else
         lambda k, d=None: getattr(model, k, d))
  default = {f.name: f.default for f in dataclasses.fields(VisionTransformer)
             if f.name in ARCH_FIELDS}
  arch = {k: get(k, default[k]) for k in ARCH_FIELDS}
  if arch.get("conv_stem"):
    arch["conv_stem"] = [list(dataclasses.astuple(c)) if isinstance(
        c, ConvStemConfig) else list(c) for c in arch["conv_stem"]]
  if arch.get("resnet") is not None:
    arch["resnet"] = resnet_lib.as_config(arch["resnet"]).record()
  if arch.get("mbconv") is not None:
    arch["mbconv"] = mbconv_lib.as_config(arch["mbconv"]).record()
  for key in ("rope_ref_grid", "naflex_grid", "global_attn_indexes"):
    if arch.get(key) is not None:
      arch[key] = list(arch[key])
  return arch
