"""Checkpoint formats beyond torchvision: timm, Hugging Face transformers,
Google ``.npz`` and safetensors: the public face of :mod:`vit_jax.weights`.

    model, variables = formats.from_timm(state_dict, "vit_small_patch14_reg4_dinov2")
    state_dict = formats.to_timm(variables)            # timm loads it strictly
    model, variables = formats.from_transformers("path/to/vit-base-patch16-224")
    state_dict = formats.to_transformers(variables)

Every format maps onto the one parameter tree of :mod:`vit_jax.models`
through a table (:mod:`vit_jax.weights.layouts`) or, for Google's files, a
short list of fix-ups (:mod:`vit_jax.weights.google_npz`). Files are read
without pickle; torch is imported only to produce torch tensors.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any, Mapping, Optional

import numpy as np

from vit_jax.weights import build, files, google_npz, layouts, trees
from vit_jax.weights.google_npz import (  # noqa: F401  (public names)
    convert_pre_linen, posemb_sincos_2d)
from vit_jax.weights.files import read_npz, read_safetensors  # noqa: F401

__all__ = [
    "from_timm", "to_timm", "params_to_timm",
    "from_transformers", "to_transformers", "params_to_transformers",
    "from_state_dict",
    "load_npz", "save_npz", "npz_to_params", "params_to_npz", "read_npz",
    "load_safetensors", "save_safetensors", "read_safetensors",
    "convert_pre_linen", "posemb_sincos_2d",
]


def _torch(sd) -> "collections.OrderedDict":
  import torch  # pylint: disable=import-outside-toplevel
  return collections.OrderedDict(
      (k, torch.from_numpy(np.array(v))) for k, v in sd.items())


# ------------------------------------------------------------------- timm ---


def from_timm(state_dict, name: Optional[str] = None, *,
              image_size=None, num_heads: Optional[int] = None,
              **model_overrides):
  """timm ``VisionTransformer`` weights -> ``(model, variables)``.

  ``name`` is timm's model name (``vit_small_patch14_reg4_dinov2``,
  ``deit3_base_patch16_224``, ``vit_base_patch16_clip_quickgelu_224``,
  ``vit_base_patch16_siglip_224``, optionally with a ``.tag``): it decides
  what the keys cannot (QuickGELU and GELU models have identical keys; the
  LayerNorm epsilon; the heads of a fused q/k/v) and is checked against the
  weights. Ours (``vit_b_16``) and big_vision's (``B/16``) names work for
  classic ViTs. Without a name: exact GELU, epsilon 1e-6, the width's heads.
  The model's ``apply`` is timm's ``forward``; ``forward_features`` is timm's
  ``forward_features``. ``image_size`` resamples the position embedding.
  """
  return build.from_state_dict(state_dict, name, layout="timm",
                               image_size=image_size, num_heads=num_heads,
                               **model_overrides)


def params_to_timm(variables) -> "collections.OrderedDict[str, np.ndarray]":
  """Our tree -> a timm ``VisionTransformer`` state dict (numpy), which
  ``timm.create_model(name, num_classes=..., img_size=...)`` loads with
  ``strict=True`` (a ``classifier='gap'`` tree: a model built with
  ``class_token=False, global_pool='avg'``)."""
  return build.to_state_dict(variables, "timm")


def to_timm(variables) -> "collections.OrderedDict":
  """Like :func:`params_to_timm`, as torch tensors."""
  return _torch(params_to_timm(variables))


# ------------------------------------------------------- Hugging Face ViT ---


def from_transformers(state_dict_or_dir, config: Optional[Mapping[str, Any]] = None,
                      *, image_size=None, **model_overrides):
  """Hugging Face transformers weights -> ``(model, variables)``: ``ViTModel``
  / ``ViTForImageClassification``, and the image towers ``Dinov2Model``,
  ``CLIPVisionModel`` (or a ``CLIPModel``'s vision half) and
  ``SiglipVisionModel`` (or a ``SiglipModel``'s).

  ``state_dict_or_dir``: a state dict (``model.state_dict()``, or a model),
  or a directory written by ``save_pretrained`` (``config.json`` +
  ``model.safetensors``). The architecture comes from ``config`` (a
  ``ViTConfig``, or its dict) or the directory's ``config.json``; without
  one, transformers' defaults (exact GELU, LayerNorm epsilon 1e-12). A
  ``ViTModel``'s pooler becomes ``pre_logits`` (Dense + tanh): with no
  classifier, ``apply`` returns its ``pooler_output``.
  """
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  if isinstance(state_dict_or_dir, (str, os.PathLike)):
    arrays, dir_config, _ = files.read_model_dir(str(state_dict_or_dir))
    state_dict_or_dir, config = arrays, config or dir_config
  elif hasattr(state_dict_or_dir, "config") and config is None:
    config = state_dict_or_dir.config.to_dict()  # a transformers model
  layout = None
  if config and (config.get("vision_config") or config).get("model_type"):
    layout = layouts.HF_MODEL_TYPES.get(
        (config.get("vision_config") or config)["model_type"])
  return build.from_state_dict(state_dict_or_dir, layout=layout,
                               config=config, image_size=image_size,
                               **model_overrides)


def params_to_transformers(variables, layout: Optional[str] = None
                           ) -> "collections.OrderedDict[str, np.ndarray]":
  """Our tree -> transformers' state dict (numpy), which the matching model
  loads with ``load_state_dict(strict=True)``. ``layout`` (default: from
  the tree): ``'transformers'`` (``ViTForImageClassification``: ``vit.``
  prefix and ``classifier`` when there is a head; else ``ViTModel``, with
  ``pooler`` for ``pre_logits``), ``'transformers_dinov2'``,
  ``'transformers_clip'`` or ``'transformers_siglip'`` (the image towers)."""
  variables = trees.wrap(trees.unstack_layers(trees.wrap(variables)))
  if layout is None:
    layout = layouts.transformers_layout_of(trees.arch_of(variables))
  sd = build.to_state_dict(variables, layout)
  if "classifier.weight" not in sd:
    return sd
  if "pooler.dense.weight" in sd:
    raise ValueError("transformers' ViTForImageClassification has no pooler: "
                     "a tree with both pre_logits and a head cannot be "
                     "exported to it.")
  return collections.OrderedDict(
      (k if k.startswith("classifier.") else "vit." + k, v)
      for k, v in sd.items())


def to_transformers(variables, layout: Optional[str] = None
                    ) -> "collections.OrderedDict":
  """Like :func:`params_to_transformers`, as torch tensors."""
  return _torch(params_to_transformers(variables, layout))


def from_state_dict(state_dict, name: Optional[str] = None, **kwargs):
  """A torchvision, timm or transformers ViT state dict, whichever names it
  uses -> ``(model, variables)``; the size is read from the shapes."""
  return build.from_state_dict(state_dict, name, **kwargs)


# ------------------------------------------------------------ Google .npz ---


def npz_to_params(arrays: Mapping[str, Any], *, image_size=None):
  """Flat arrays of a Google ViT -> ``(variables, arch)``: our tree after
  the fix-ups, and the :class:`~vit_jax.models.VisionTransformer` fields
  plus ``image_size`` (the position embedding's resolution)."""
  from vit_jax import models  # pylint: disable=import-outside-toplevel

  variables = google_npz.npz_to_tree(arrays, image_size=image_size)
  arch = trees.arch_of(variables)
  arch["image_size"] = trees.native_image_size(
      variables, models.get_model(arch))
  return variables, arch


def params_to_npz(variables, layout: str = "vision_transformer",
                  scan: bool = False) -> "dict[str, np.ndarray]":
  return google_npz.tree_to_npz(variables, layout=layout, scan=scan)


params_to_npz.__doc__ = google_npz.tree_to_npz.__doc__


def load_npz(path: str, name: Optional[str] = None, *, image_size=None,
             **model_overrides):
  """A Google ``.npz`` ViT (vision_transformer or big_vision) ->
  ``(model, variables)``. ``name`` (optional) is checked against the weights;
  ``image_size`` resamples the position embedding."""
  variables = google_npz.npz_to_tree(read_npz(path), image_size=image_size)
  return build.from_tree(variables, name, image_size=image_size,
                         **model_overrides)


def save_npz(variables, path: str, layout: str = "vision_transformer",
             scan: bool = False) -> None:
  """Writes :func:`params_to_npz` to ``path`` (``np.savez``, no pickle)."""
  arrays = params_to_npz(variables, layout=layout, scan=scan)
  with open(path, "wb") as f:
    np.savez(f, **arrays)


# ------------------------------------------------------------- safetensors ---

_ARCH_JSON = ("patch_size", "hidden_size", "num_layers", "num_heads",
              "mlp_dim", "num_classes", "representation_size", "classifier",
              "conv_stem", "num_registers", "layer_scale_init",
              "no_embed_class", "pre_norm", "fc_norm", "patch_bias",
              "qkv_bias", "act", "layer_norm_eps")


def save_safetensors(variables, path: str, *, model=None,
                     layout: str = "vit_jax",
                     metadata: Optional[Mapping[str, Any]] = None) -> None:
  """Writes ``variables`` to a safetensors file.

  Args:
    variables: ``{'params': ..., 'batch_stats': ...}`` (or bare params).
    path: output file.
    model: the Module the variables belong to: its architecture is stored
      (a conv stem's strides, the activation and LayerNorm epsilon are not
      in the weights); else what the tree determines is.
    layout: ``'vit_jax'`` (our tree, bit for bit), ``'timm'``,
      ``'torchvision'`` or ``'transformers'`` (their names, float32).
    metadata: extra JSON-able entries (e.g. ``preprocessing``,
      ``label_names``), stored JSON-encoded in the header.
  """
  variables = trees.wrap(trees.unstack_layers(trees.wrap(variables)))
  from vit_jax import models  # pylint: disable=import-outside-toplevel
  if model is not None:  # every architecture field (RoPE is in no weight)
    arch = models.arch_record(model)
  else:
    arch = {k: v for k, v in trees.arch_of(variables).items()
            if k in _ARCH_JSON}
  if arch.get("conv_stem"):
    arch["conv_stem"] = [list(dataclasses.astuple(c)) if not isinstance(
        c, list) else c for c in arch["conv_stem"]]
  if layout == "vit_jax":
    tensors = trees.flatten(variables)
  elif layout == "timm":
    tensors = params_to_timm(variables)
  elif layout == "torchvision":
    tensors = build.to_state_dict(variables, "torchvision")
  elif layout == "transformers":
    tensors = params_to_transformers(variables)
  else:
    raise ValueError(f"layout={layout!r}: expected 'vit_jax', 'timm', "
                     f"'torchvision' or 'transformers'")
  meta = {"format": "vit_jax" if layout == "vit_jax" else "pt",
          "layout": layout, "arch": arch}
  meta.update(metadata or {})
  files.write_safetensors(tensors, path, meta)


def load_safetensors(path: str, name: Optional[str] = None, *,
                     image_size=None, num_heads: Optional[int] = None,
                     **model_overrides):
  """A safetensors file of any layout -> ``(model, variables, metadata)``
  (metadata JSON-decoded; ``layout`` says which names the file uses)."""
  from vit_jax.weights import layouts  # pylint: disable=import-outside-toplevel

  arrays, meta = read_safetensors(path)
  if meta.get("format") == "vit_jax" or any(k.startswith("params/")
                                            for k in arrays):
    model, variables = build.from_tree(
        trees.unflatten(arrays), name, image_size=image_size,
        arch=meta.get("arch"), **model_overrides)
    meta.setdefault("layout", "vit_jax")
    return model, variables, meta
  meta.setdefault("layout", layouts.detect(list(arrays)) or "unknown")
  model, variables = build.from_state_dict(
      arrays, name, image_size=image_size, num_heads=num_heads,
      **model_overrides)
  return model, variables, meta
