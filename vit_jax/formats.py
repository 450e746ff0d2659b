"""Checkpoint formats beyond torchvision: timm, Google ``.npz``, safetensors.

All of them map onto the one parameter tree of :mod:`vit_jax.models` (the
tree of google-research/vision_transformer). Only parameter trees are mapped
here; files are read without pickle (``np.load(allow_pickle=False)``,
safetensors); torch is imported lazily and only to produce torch tensors.

timm ``VisionTransformer`` state dicts (``vit_base_patch16_224`` and
friends)::

    cls_token                    cls
    pos_embed                    Transformer/posembed_input/pos_embedding
                                 (``no_embed_class``: a zero class row is added)
    patch_embed.proj             embedding                    (OIHW -> HWIO)
    blocks.{i}.norm1 / norm2     encoderblock_{i}/LayerNorm_0 / LayerNorm_1
    blocks.{i}.attn.qkv          .../MultiHeadDotProductAttention_0/
                                 {query,key,value} (rows split q, k, v)
    blocks.{i}.attn.proj         .../MultiHeadDotProductAttention_0/out
    blocks.{i}.mlp.fc1 / fc2     .../MlpBlock_0/Dense_0 / Dense_1
    norm                         Transformer/encoder_norm
    head                         head

Google ``.npz`` (google-research/vision_transformer and big_vision; AugReg,
i21k, ...): '/'-joined keys of a Flax tree, optionally under ``opt/target/``,
``params/`` or ``params/img/``. Pre-Linen names (``MultiHeadDotProductAttention_1``,
``LayerNorm_2``, ``MlpBlock_3``) are renumbered as
``flax.training.checkpoints.convert_pre_linen`` does; big_vision's top-level
``pos_embedding`` (patch rows only, added before the class token is
concatenated) becomes our embedding with a zero class row, which computes
the same function; its scanned ``Transformer/encoderblock`` is unstacked;
``gap`` heads (no ``cls``) become ``classifier='gap'``.

The ``.npz`` functions live in :mod:`vit_jax.formats_google` (re-exported
here); safetensors and "any state dict" loading in :mod:`vit_jax.formats_io`.
"""

from __future__ import annotations

import collections
import re
from typing import Mapping, Optional

import numpy as np

from vit_jax import convert
from vit_jax.formats_arch import (  # noqa: F401  (re-exported)
    F32, arch_of, build_model, check_flat, check_name, check_variables,
    describe_arch, finish, num_heads_for, to_numpy, variant_from_name)

__all__ = [
    "timm_to_params", "params_to_timm", "from_timm", "to_timm",
    "npz_to_params", "params_to_npz", "load_npz", "save_npz", "read_npz",
    "convert_pre_linen", "posemb_sincos_2d",
    "arch_of", "build_model", "check_variables", "describe_arch",
]

# --------------------------------------------------------------------------- #
# timm.
# --------------------------------------------------------------------------- #

_TIMM_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_TIMM_BLOCK_KEYS = (
    "norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.qkv.bias",
    "attn.proj.weight", "attn.proj.bias", "norm2.weight", "norm2.bias",
    "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias")
_TIMM_TOP_KEYS = ("cls_token", "pos_embed", "patch_embed.proj.weight",
                  "patch_embed.proj.bias", "norm.weight", "norm.bias",
                  "head.weight", "head.bias")
# timm features this model does not have, with what they are.
_TIMM_UNSUPPORTED = {
    "fc_norm.": "a LayerNorm after pooling (global_pool='avg' with fc_norm)",
    "dist_token": "DeiT's distillation token",
    "head_dist.": "DeiT's distillation head",
    "reg_token": "register tokens",
    "norm_pre.": "a LayerNorm before the blocks (CLIP-style pre_norm)",
    ".ls1.": "LayerScale (init_values)",
    ".ls2.": "LayerScale (init_values)",
    ".q_norm.": "q/k normalisation (qk_norm)",
    ".k_norm.": "q/k normalisation (qk_norm)",
    "attn_pool.": "attention pooling ('map' head)",
    ".attn.norm.": "a norm inside attention (scale_attn_norm)",
    ".mlp.norm.": "a norm inside the MLP (scale_mlp_norm)",
    ".w12.": "a SwiGLU MLP",
    "patch_embed.norm.": "a norm after the patch embedding",
    "patch_embed.backbone.": "a hybrid CNN backbone",
}


def _normalise_timm(state_dict) -> "collections.OrderedDict[str, np.ndarray]":
  if hasattr(state_dict, "state_dict") and callable(state_dict.state_dict):
    state_dict = state_dict.state_dict()
  if not isinstance(state_dict, Mapping):
    raise TypeError(f"Expected a timm state_dict (a mapping of names to "
                    f"tensors), got {type(state_dict).__name__}")
  for key in ("model", "state_dict", "model_state_dict"):
    if key in state_dict and isinstance(state_dict[key], Mapping):
      state_dict = state_dict[key]
  keys = list(state_dict)
  strip = "module." if keys and all(k.startswith("module.") for k in keys) else ""
  return collections.OrderedDict(
      (k[len(strip):], to_numpy(v)) for k, v in state_dict.items())


def timm_to_params(state_dict, *, num_heads: Optional[int] = None):
  """Maps a timm ``VisionTransformer`` state dict onto our tree.

  The number of heads is not stored in a fused ``qkv`` weight: it is
  ``num_heads`` if given, else the standard one for the width (ViT-Ti 3,
  S 6, B 12, L 16, H 16). Returns ``(variables, arch)``, ``arch`` being the
  :class:`~vit_jax.models.VisionTransformer` fields read from the weights
  (plus ``image_size``).
  """
  sd = _normalise_timm(state_dict)
  bad, unknown = set(), []
  for k in sd:
    what = [w for pat, w in _TIMM_UNSUPPORTED.items() if pat in k]
    m = _TIMM_BLOCK.match(k)
    if what:
      bad.add(f"{k} ({what[0]})")
    elif not (k in _TIMM_TOP_KEYS or (m and m.group(2) in _TIMM_BLOCK_KEYS)):
      unknown.append(k)
  if unknown:
    raise ValueError(
        f"Not a timm VisionTransformer state dict: {len(unknown)} of its "
        f"{len(sd)} keys are no ViT parameter, e.g. {unknown[:5]}. Is it "
        f"another architecture (Swin, BEiT, EVA, ConvNeXt...)?")
  bad = sorted(bad)
  if bad:
    raise ValueError(
        "This timm checkpoint uses features vit_jax's VisionTransformer does "
        "not have: " + "; ".join(bad[:8]) +
        (f" and {len(bad) - 8} more" if len(bad) > 8 else "") +
        ". Supported: plain ViTs with a class token (or no class token and "
        "average pooling without fc_norm).")
  if "patch_embed.proj.weight" not in sd:
    raise ValueError(
        "Not a timm VisionTransformer state dict: 'patch_embed.proj.weight' "
        f"is missing (first keys: {list(sd)[:6]}).")
  w = sd["patch_embed.proj.weight"]
  if w.ndim != 4:
    raise ValueError(f"patch_embed.proj.weight: expected a 4-D conv weight "
                     f"(D, C, P, P), got shape {w.shape}")
  d, p = int(w.shape[0]), int(w.shape[2])
  depth = 1 + max((int(m.group(1)) for m in map(_TIMM_BLOCK.match, sd) if m),
                  default=-1)
  if depth == 0:
    raise ValueError("timm state dict has no 'blocks.N.*' keys")
  m_dim = int(sd.get("blocks.0.mlp.fc1.weight", np.zeros((0,))).shape[0])
  h = num_heads or num_heads_for(d)
  if d % h:
    raise ValueError(f"num_heads={h} does not divide the width {d}")

  expected = {"patch_embed.proj.weight": tuple(w.shape),
              "patch_embed.proj.bias": (d,),
              "norm.weight": (d,), "norm.bias": (d,)}
  has_cls = "cls_token" in sd
  if has_cls:
    expected["cls_token"] = (1, 1, d)
  pos = sd.get("pos_embed")
  if pos is None or pos.ndim != 3:
    raise ValueError("timm state dict: 'pos_embed' of shape (1, tokens, "
                     "width) is missing")
  expected["pos_embed"] = (1, int(pos.shape[1]), d)
  if "head.weight" in sd:
    nc = int(sd["head.weight"].shape[0])
    expected["head.weight"], expected["head.bias"] = (nc, d), (nc,)
  else:
    nc = 0
  for i in range(depth):
    b = f"blocks.{i}."
    shapes = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,),
              (m_dim, d), (m_dim,), (d, m_dim), (d,)]
    for k, s in zip(_TIMM_BLOCK_KEYS, shapes):
      expected[b + k] = s
    if b + "attn.qkv.bias" not in sd:  # qkv_bias=False: zero bias, same math
      sd[b + "attn.qkv.bias"] = np.zeros((3 * d,), np.float32)
  check_flat(sd, expected, "a timm VisionTransformer")

  prefix = 1 if has_cls else 0
  rows = int(pos.shape[1])
  side = int(round(np.sqrt(rows - prefix))) if rows > prefix else 0
  if has_cls and side * side != rows - 1:
    side = int(round(np.sqrt(rows)))
    if side * side != rows:
      raise ValueError(f"pos_embed has {rows} rows: not a square patch grid "
                       f"with or without a class row")
    # no_embed_class=True: the class token gets no position embedding.
    pos = np.concatenate([np.zeros((1, 1, d), pos.dtype), pos], axis=1)
  elif side * side != rows - prefix:
    raise ValueError(f"pos_embed has {rows} rows: not a square patch grid")

  dense = lambda k: {"kernel": sd[k + ".weight"].T, "bias": sd[k + ".bias"]}  # noqa: E731
  ln = lambda k: {"scale": sd[k + ".weight"], "bias": sd[k + ".bias"]}  # noqa: E731
  params: dict = {"embedding": {"kernel": w.transpose(2, 3, 1, 0),
                                "bias": sd["patch_embed.proj.bias"]}}
  if has_cls:
    params["cls"] = sd["cls_token"]
  tr: dict = {"posembed_input": {"pos_embedding": pos}}
  for i in range(depth):
    b = f"blocks.{i}."
    tr[f"encoderblock_{i}"] = {
        "LayerNorm_0": ln(b + "norm1"),
        "MultiHeadDotProductAttention_0": _attn_from_fused(
            sd[b + "attn.qkv.weight"], sd[b + "attn.qkv.bias"],
            sd[b + "attn.proj.weight"], sd[b + "attn.proj.bias"], h),
        "LayerNorm_1": ln(b + "norm2"),
        "MlpBlock_0": {"Dense_0": dense(b + "mlp.fc1"),
                       "Dense_1": dense(b + "mlp.fc2")},
    }
  tr["encoder_norm"] = ln("norm")
  params["Transformer"] = tr
  if nc:
    params["head"] = dense("head")
  arch = dict(patch_size=p, hidden_size=d, num_layers=depth, num_heads=h,
              mlp_dim=m_dim, num_classes=nc, representation_size=None,
              classifier="token" if has_cls else "gap", conv_stem=None,
              image_size=side * p)
  return {"params": convert._tree_map_np(F32, params)}, arch  # pylint: disable=protected-access


def _attn_from_fused(qkv_w, qkv_b, proj_w, proj_b, h):
  d = qkv_w.shape[1]
  out = {}
  for j, n in enumerate(("query", "key", "value")):
    out[n] = {"kernel": qkv_w[j * d:(j + 1) * d].T.reshape(d, h, d // h),
              "bias": qkv_b[j * d:(j + 1) * d].reshape(h, d // h)}
  out["out"] = {"kernel": proj_w.T.reshape(h, d // h, d), "bias": proj_b}
  return out


def params_to_timm(variables) -> "collections.OrderedDict[str, np.ndarray]":
  """Our tree -> a timm ``VisionTransformer`` state dict (numpy arrays).

  Loads with ``strict=True`` into ``timm.create_model('vit_..._patchP_R',
  num_classes=C, img_size=...)``; a ``classifier='gap'`` tree into one built
  with ``class_token=False, global_pool='avg', fc_norm=False``.
  """
  variables = convert.unstack_layers(dict(variables))
  p = convert._params_of(variables)  # pylint: disable=protected-access
  for k, why in (("stem_convs_0", "a conv stem"),
                 ("pre_logits", "a representation (pre_logits) layer")):
    if k in p:
      raise ValueError(f"timm's VisionTransformer has no {why}; this tree "
                       f"cannot be exported to timm")
  sd = collections.OrderedDict()
  if "cls" in p:
    sd["cls_token"] = F32(p["cls"])
  tr = p["Transformer"]
  sd["pos_embed"] = F32(tr["posembed_input"]["pos_embedding"])
  sd["patch_embed.proj.weight"] = F32(p["embedding"]["kernel"]).transpose(3, 2, 0, 1)
  sd["patch_embed.proj.bias"] = F32(p["embedding"]["bias"])
  n_layers = len([k for k in tr if k.startswith("encoderblock_")])
  for i in range(n_layers):
    blk, b = tr[f"encoderblock_{i}"], f"blocks.{i}."
    attn = blk["MultiHeadDotProductAttention_0"]
    d = np.shape(attn["query"]["kernel"])[0]
    sd[b + "norm1.weight"] = F32(blk["LayerNorm_0"]["scale"])
    sd[b + "norm1.bias"] = F32(blk["LayerNorm_0"]["bias"])
    sd[b + "attn.qkv.weight"] = np.concatenate(
        [F32(attn[n]["kernel"]).reshape(d, d).T for n in ("query", "key", "value")])
    sd[b + "attn.qkv.bias"] = np.concatenate(
        [F32(attn[n]["bias"]).reshape(d) for n in ("query", "key", "value")])
    sd[b + "attn.proj.weight"] = F32(attn["out"]["kernel"]).reshape(d, d).T
    sd[b + "attn.proj.bias"] = F32(attn["out"]["bias"])
    sd[b + "norm2.weight"] = F32(blk["LayerNorm_1"]["scale"])
    sd[b + "norm2.bias"] = F32(blk["LayerNorm_1"]["bias"])
    for j, n in (("1", "Dense_0"), ("2", "Dense_1")):
      sd[b + f"mlp.fc{j}.weight"] = F32(blk["MlpBlock_0"][n]["kernel"]).T
      sd[b + f"mlp.fc{j}.bias"] = F32(blk["MlpBlock_0"][n]["bias"])
  sd["norm.weight"] = F32(tr["encoder_norm"]["scale"])
  sd["norm.bias"] = F32(tr["encoder_norm"]["bias"])
  if "head" in p:
    sd["head.weight"] = F32(p["head"]["kernel"]).T
    sd["head.bias"] = F32(p["head"]["bias"])
  return collections.OrderedDict(
      (k, np.ascontiguousarray(v)) for k, v in sd.items())


def to_timm(variables) -> "collections.OrderedDict":
  """Like :func:`params_to_timm`, as torch tensors."""
  import torch  # pylint: disable=import-outside-toplevel

  return collections.OrderedDict(
      (k, torch.from_numpy(np.array(v))) for k, v in params_to_timm(variables).items())


def from_timm(state_dict, name: Optional[str] = None, *,
              num_heads: Optional[int] = None, image_size=None,
              **model_overrides):
  """timm ViT weights -> ``(model, variables)``.

  ``name`` (ours, ``vit_b_16``; big_vision's, ``B/16``; or timm's,
  ``vit_base_patch16_224``) gives the number of heads and is checked against
  the weights: a checkpoint of another size is an error naming both.
  ``image_size`` resamples the position embedding (torchvision's bicubic).
  """
  if name is not None and num_heads is None:
    v = variant_from_name(name)
    w = _normalise_timm(state_dict).get("patch_embed.proj.weight")
    if w is not None and np.shape(w)[0] == v.hidden_size:
      num_heads = v.num_heads  # else: the width's heads, for the error
  variables, arch = timm_to_params(state_dict, num_heads=num_heads)
  return finish(variables, arch, name, image_size, model_overrides)


# The Google .npz formats and safetensors, under this one name.
from vit_jax.formats_google import (  # noqa: E402,F401  pylint: disable=wrong-import-position
    convert_pre_linen, load_npz, npz_to_params, params_to_npz,
    posemb_sincos_2d, read_npz, save_npz)
