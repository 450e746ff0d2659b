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

safetensors: see :mod:`vit_jax.formats_io` (``save_safetensors``,
``load_safetensors``).
"""

from __future__ import annotations

import collections
import re
from typing import Any, Mapping, Optional, Tuple

import numpy as np

from vit_jax import convert, models
from vit_jax.formats_arch import (  # noqa: F401  (re-exported)
    arch_of, build_model, check_variables, describe_arch, num_heads_for,
    variant_from_name)

__all__ = [
    "timm_to_params", "params_to_timm", "from_timm", "to_timm",
    "npz_to_params", "params_to_npz", "load_npz", "save_npz",
    "convert_pre_linen", "posemb_sincos_2d",
    "arch_of", "build_model", "check_variables", "describe_arch",
]

_F32 = lambda x: np.ascontiguousarray(np.asarray(x, dtype=np.float32))  # noqa: E731


def _to_numpy(x) -> np.ndarray:
  """torch tensor / jax array / numpy -> numpy (float16/bfloat16 -> float32)."""
  if hasattr(x, "detach"):  # torch.Tensor, without importing torch
    x = x.detach().cpu()
    if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
      x = x.float()
    return x.numpy()
  x = np.asarray(x)
  if x.dtype.kind == "V" and x.dtype.itemsize == 2:  # bfloat16 saved by numpy
    import ml_dtypes  # pylint: disable=import-outside-toplevel
    x = x.view(ml_dtypes.bfloat16)
  if x.dtype != np.float32 and x.dtype.kind in "fV":
    x = x.astype(np.float32)
  return x


def _unflatten(flat: Mapping[str, Any], sep: str = "/") -> dict:
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


def _flatten(tree: Mapping[str, Any], prefix: str = "", sep: str = "/") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(_flatten(v, f"{prefix}{k}{sep}", sep))
    else:
      out[f"{prefix}{k}"] = v
  return out


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
      (k[len(strip):], _to_numpy(v)) for k, v in state_dict.items())


def timm_to_params(state_dict, *, num_heads: Optional[int] = None):
  """Maps a timm ``VisionTransformer`` state dict onto our tree.

  The number of heads is not stored in a fused ``qkv`` weight: it is
  ``num_heads`` if given, else the standard one for the width (ViT-Ti 3,
  S 6, B 12, L 16, H 16). Returns ``(variables, arch)``, ``arch`` being the
  :class:`~vit_jax.models.VisionTransformer` fields read from the weights
  (plus ``image_size``).
  """
  sd = _normalise_timm(state_dict)
  bad = sorted({f"{k} ({what})" for k in sd for pat, what in
                _TIMM_UNSUPPORTED.items() if pat in k or k.startswith(pat)})
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
  _check_flat(sd, expected, "a timm VisionTransformer")

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
  return {"params": convert._tree_map_np(_F32, params)}, arch  # pylint: disable=protected-access


def _attn_from_fused(qkv_w, qkv_b, proj_w, proj_b, h):
  d = qkv_w.shape[1]
  out = {}
  for j, n in enumerate(("query", "key", "value")):
    out[n] = {"kernel": qkv_w[j * d:(j + 1) * d].T.reshape(d, h, d // h),
              "bias": qkv_b[j * d:(j + 1) * d].reshape(h, d // h)}
  out["out"] = {"kernel": proj_w.T.reshape(h, d // h, d), "bias": proj_b}
  return out


def _check_flat(sd, expected, what):
  """Reports missing, unexpected and mis-shaped keys by name, all at once."""
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
        lines.append(f"  {title} ({len(items)}):")
        lines += [f"    {s}" for s in items[:20]]
        if len(items) > 20:
          lines.append(f"    ... and {len(items) - 20} more")
    raise ValueError("\n".join(lines))


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
    sd["cls_token"] = _F32(p["cls"])
  tr = p["Transformer"]
  sd["pos_embed"] = _F32(tr["posembed_input"]["pos_embedding"])
  sd["patch_embed.proj.weight"] = _F32(p["embedding"]["kernel"]).transpose(3, 2, 0, 1)
  sd["patch_embed.proj.bias"] = _F32(p["embedding"]["bias"])
  n_layers = len([k for k in tr if k.startswith("encoderblock_")])
  for i in range(n_layers):
    blk, b = tr[f"encoderblock_{i}"], f"blocks.{i}."
    attn = blk["MultiHeadDotProductAttention_0"]
    d = np.shape(attn["query"]["kernel"])[0]
    sd[b + "norm1.weight"] = _F32(blk["LayerNorm_0"]["scale"])
    sd[b + "norm1.bias"] = _F32(blk["LayerNorm_0"]["bias"])
    sd[b + "attn.qkv.weight"] = np.concatenate(
        [_F32(attn[n]["kernel"]).reshape(d, d).T for n in ("query", "key", "value")])
    sd[b + "attn.qkv.bias"] = np.concatenate(
        [_F32(attn[n]["bias"]).reshape(d) for n in ("query", "key", "value")])
    sd[b + "attn.proj.weight"] = _F32(attn["out"]["kernel"]).reshape(d, d).T
    sd[b + "attn.proj.bias"] = _F32(attn["out"]["bias"])
    sd[b + "norm2.weight"] = _F32(blk["LayerNorm_1"]["scale"])
    sd[b + "norm2.bias"] = _F32(blk["LayerNorm_1"]["bias"])
    for j, n in (("1", "Dense_0"), ("2", "Dense_1")):
      sd[b + f"mlp.fc{j}.weight"] = _F32(blk["MlpBlock_0"][n]["kernel"]).T
      sd[b + f"mlp.fc{j}.bias"] = _F32(blk["MlpBlock_0"][n]["bias"])
  sd["norm.weight"] = _F32(tr["encoder_norm"]["scale"])
  sd["norm.bias"] = _F32(tr["encoder_norm"]["bias"])
  if "head" in p:
    sd["head.weight"] = _F32(p["head"]["kernel"]).T
    sd["head.bias"] = _F32(p["head"]["bias"])
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
  return _finish(variables, arch, name, image_size, model_overrides)


def _finish(variables, arch, name, image_size, overrides):
  if name is not None:
    _check_name(arch, name)
  if image_size is not None:
    variables = convert.resize_posemb(variables, image_size, arch["patch_size"])
  model = build_model(arch, **overrides)
  check_variables(model, variables, image_size or arch["image_size"])
  if model.scan_layers:
    variables = convert.stack_layers(variables)
  return model, variables


def _check_name(arch, name):
  v = variant_from_name(name)
  want = dict(hidden_size=v.hidden_size, num_layers=v.num_layers,
              num_heads=v.num_heads, mlp_dim=v.mlp_dim, patch_size=v.patch_size)
  diff = [f"{k} {arch[k]} (expected {want[k]})" for k in want
          if arch.get(k) != want[k]]
  if diff:
    raise ValueError(
        f"The checkpoint is not a {name}: it has {', '.join(diff)}. It looks "
        f"like {describe_arch(arch)}; pass that variant instead.")


# --------------------------------------------------------------------------- #
# Google .npz (vision_transformer, big_vision).
# --------------------------------------------------------------------------- #

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
  flat = {k[len(prefix):]: _to_numpy(v) for k, v in arrays.items()
          if k.startswith(prefix)}
  tree = convert_pre_linen(_unflatten(flat))
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
  return {"params": convert._tree_map_np(_F32, tree)}, arch  # pylint: disable=protected-access


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
  p = convert._tree_map_np(_F32, p)  # pylint: disable=protected-access
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
  return {k: np.ascontiguousarray(v) for k, v in _flatten(p).items()}


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
  return _finish(variables, arch, name, image_size, model_overrides)
