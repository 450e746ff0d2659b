"""safetensors files, and PyTorch-side state dicts whatever their layout.

``save_safetensors`` writes our tree (``layout='vit_jax'``: keys
``params/Transformer/encoderblock_0/...`` and ``batch_stats/...``, the arrays
bit for bit, and the architecture, preprocessing and label names in the
file's metadata so it loads without a variant name), or timm's / torchvision's
state-dict layout for use with those libraries. ``load_safetensors`` reads any
of the three back. ``from_state_dict`` maps a torch-side state dict (a
``.pth`` read with ``weights_only=True``, or a safetensors file) whichever of
torchvision's or timm's names it uses.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

import numpy as np

from vit_jax import convert, formats, models
from vit_jax.formats_arch import (arch_from_json, arch_of, arch_to_json,
                                  check_name, finish, flatten,
                                  num_heads_for, unflatten, variant_from_name)

__all__ = ["save_safetensors", "load_safetensors", "read_safetensors",
           "from_state_dict", "state_dict_layout", "torchvision_arch"]

FORMAT_KEY = "format"
VIT_JAX_FORMAT = "vit_jax"


def _arch_of_model(model: models.VisionTransformer, variables) -> dict:
  arch = {k: getattr(model, k) for k in
          ("patch_size", "hidden_size", "num_layers", "num_heads", "mlp_dim",
           "num_classes", "representation_size", "classifier", "conv_stem")}
  arch["image_size"] = arch_of(variables, conv_stem=model.conv_stem)["image_size"]
  return arch


def save_safetensors(variables, path: str, *, model=None,
                     layout: str = "vit_jax",
                     metadata: Optional[Mapping[str, Any]] = None) -> None:
  """Writes ``variables`` to a safetensors file.

  Args:
    variables: ``{'params': ..., 'batch_stats': ...}`` (or bare params).
    path: output file.
    model: the Module the variables belong to; needed for a conv stem (its
      strides are not in the weights), else the arch is read from the tree.
    layout: ``'vit_jax'`` (our tree, exact), ``'timm'`` or ``'torchvision'``
      (their state-dict names, float32).
    metadata: extra JSON-able entries (e.g. ``preprocessing``,
      ``label_names``) stored JSON-encoded in the header.
  """
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  variables = dict(variables)
  if "params" not in variables:
    variables = {"params": variables}
  variables = convert.unstack_layers(variables)
  arch = (_arch_of_model(model, variables) if model is not None
          else arch_of(variables))
  if layout == "vit_jax":
    tensors = {k: np.ascontiguousarray(np.asarray(v)) for k, v in
               flatten(variables).items()}
  elif layout == "timm":
    tensors = dict(formats.params_to_timm(variables))
  elif layout == "torchvision":
    tensors = dict(convert.params_to_torchvision(variables))
  else:
    raise ValueError(f"layout={layout!r}: expected 'vit_jax', 'timm' or "
                     f"'torchvision'")
  meta = {FORMAT_KEY: VIT_JAX_FORMAT if layout == "vit_jax" else "pt",
          "layout": layout, "arch": json.dumps(arch_to_json(arch))}
  for k, v in (metadata or {}).items():
    meta[k] = json.dumps(v)
  save_file(tensors, path, metadata=meta)


def read_safetensors(path: str):
  """``(arrays, metadata)`` of a safetensors file (numpy; no torch needed)."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  if not os.path.isfile(path):
    raise FileNotFoundError(f"No such checkpoint file: {path!r}")
  try:
    with safe_open(path, framework="numpy") as f:
      meta = dict(f.metadata() or {})
      arrays = {k: f.get_tensor(k) for k in f.keys()}
  except Exception as e:  # safetensors raises its own error types
    raise ValueError(f"Cannot read {path!r} as a safetensors file: {e}") from None
  return arrays, meta


def _decode_meta(meta: Mapping[str, str]) -> dict:
  out = {}
  for k, v in meta.items():
    try:
      out[k] = json.loads(v)
    except (TypeError, ValueError):
      out[k] = v
  return out


def load_safetensors(path: str, name: Optional[str] = None, *,
                     image_size=None, num_heads: Optional[int] = None,
                     **model_overrides):
  """A safetensors file of any of the three layouts ->
  ``(model, variables, metadata)`` (metadata JSON-decoded)."""
  arrays, raw_meta = read_safetensors(path)
  meta = _decode_meta(raw_meta)
  if meta.get(FORMAT_KEY) == VIT_JAX_FORMAT or any(
      k.startswith("params/") for k in arrays):
    variables = unflatten(arrays)
    if "arch" in meta:
      arch = arch_from_json(meta["arch"])
    else:
      arch = arch_of(variables)
    model, variables = finish(variables, arch, name, image_size,
                              model_overrides)
    meta.setdefault("layout", "vit_jax")
    return model, variables, meta
  meta.setdefault("layout", state_dict_layout(list(arrays)))
  model, variables = from_state_dict(arrays, name, image_size=image_size,
                                     num_heads=num_heads, **model_overrides)
  return model, variables, meta


def state_dict_layout(keys) -> str:
  """``'torchvision'``, ``'timm'`` or ``'unknown'`` from a state dict's keys."""
  keys = [k[len("module."):] if k.startswith("module.") else k for k in keys]
  if any(k in ("conv_proj.weight", "conv_proj.conv_last.weight", "class_token")
         or k.startswith("encoder.layers.") for k in keys):
    return "torchvision"
  if any(k == "patch_embed.proj.weight" or k.startswith("blocks.") for k in keys):
    return "timm"
  return "unknown"


def torchvision_arch(state_dict, num_heads: Optional[int] = None) -> dict:
  """Size of a torchvision ViT state dict, read from its shapes (the heads,
  not stored, are ``num_heads`` or the standard number for the width; a
  conv stem's patch size cannot be read and needs the variant name)."""
  sd = state_dict
  strip = "module." if all(k.startswith("module.") for k in sd) else ""
  get = lambda k: sd.get(strip + k)  # noqa: E731
  tok = get("class_token")
  w = get("conv_proj.weight")
  if tok is None or w is None:
    raise ValueError(
        "Cannot tell the variant of this torchvision state dict from its "
        "shapes (conv stem, or keys missing): pass the variant name "
        "(e.g. --model vit_b_16).")
  d = int(np.shape(tok)[-1])
  depth = len({k.split(".")[2] for k in sd
               if k.startswith(strip + "encoder.layers.")})
  mlp = get("encoder.layers.encoder_layer_0.mlp.0.weight")
  if mlp is None:
    mlp = get("encoder.layers.encoder_layer_0.mlp.linear_1.weight")
  head = get("heads.head.weight")
  pos = get("encoder.pos_embedding")
  side = int(round(np.sqrt(np.shape(pos)[1] - 1))) if pos is not None else 0
  return dict(num_classes=int(np.shape(head)[0]) if head is not None else 0,
              image_size=side * int(np.shape(w)[-1]) or None,
              hidden_size=d, num_layers=depth,
              mlp_dim=int(np.shape(mlp)[0]) if mlp is not None else None,
              patch_size=int(np.shape(w)[-1]),
              num_heads=num_heads or num_heads_for(d))


def from_state_dict(state_dict, name: Optional[str] = None, *,
                    image_size=None, num_heads: Optional[int] = None,
                    **model_overrides):
  """A torchvision or timm ViT state dict -> ``(model, variables)``.

  ``name`` is the variant (``vit_b_16``, ``B/16`` or timm's
  ``vit_base_patch16_224``) and is checked against the shapes; without it
  the size (any depth / width) is read from the shapes, with ``num_heads``
  or else the standard number of heads for the width. A state dict of some
  other network is an error that says what was found.
  """
  if not isinstance(state_dict, Mapping):
    raise TypeError(f"Expected a state dict (mapping of names to tensors), "
                    f"got {type(state_dict).__name__}")
  layout = state_dict_layout(list(state_dict))
  if layout == "timm":
    return formats.from_timm(state_dict, name, num_heads=num_heads,
                             image_size=image_size, **model_overrides)
  if layout == "torchvision":
    try:
      have = torchvision_arch(state_dict, num_heads)
    except ValueError:
      if name is None:
        raise
      have = None  # conv stem: the variant name says the size
    if name is not None:
      if have is not None:
        check_name(have, name)
      v = variant_from_name(name)  # ours, big_vision's or timm's name
      have = dict(hidden_size=v.hidden_size, num_layers=v.num_layers,
                  num_heads=v.num_heads, mlp_dim=v.mlp_dim,
                  patch_size=v.patch_size)
    # Any size: the converter takes the architecture as overrides.
    arch = {k: have[k] for k in _TV_ARCH}
    return convert.from_torchvision(state_dict, "vit_b_16",
                                    image_size=image_size,
                                    **{**arch, **model_overrides})
  keys = list(state_dict)
  raise ValueError(
      "Not a Vision Transformer checkpoint of torchvision's or timm's layout "
      f"(no 'conv_proj'/'encoder.layers.*' nor 'patch_embed'/'blocks.*' "
      f"keys); it has {len(keys)} entries, e.g. {keys[:5]}. Is it another "
      f"architecture (e.g. a ResNet)?")


_TV_ARCH = ("hidden_size", "num_layers", "num_heads", "mlp_dim", "patch_size")
