"""Checkpoint formats beyond torchvision: timm, Hugging Face transformers,
Google ``.npz`` and safetensors: the public face of :mod:`vit_jax.weights`.

    model, variables = formats.from_timm(state_dict, "vit_small_patch14_reg4_dinov2")
    state_dict = formats.to_timm(variables)            # timm loads it strictly
    model, variables = formats.from_transformers("path/to/vit-base-patch16-224")
    state_dict = formats.to_transformers(variables)

Every format maps onto the one parameter tree of :mod:`vit_jax.models`
through a table (:mod:`vit_jax.weights.layouts`) or, for Google's files, a
short list of fix-ups (:mod:`vit_jax.weights.google_npz`). Files are read
without pickle; torch is imported only to produce torch tensors. Nothing
here has logic of its own: each name is a weights-layer function.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from vit_jax.weights import build, files, google_npz, saving
from vit_jax.weights.google_npz import (  # noqa: F401  (public names)
    convert_pre_linen, npz_to_params, posemb_sincos_2d)
from vit_jax.weights.files import read_npz, read_safetensors  # noqa: F401
from vit_jax.weights.saving import save_npz, save_safetensors  # noqa: F401

__all__ = [
    "from_timm", "to_timm", "params_to_timm",
    "from_transformers", "to_transformers", "params_to_transformers",
    "from_state_dict",
    "load_npz", "save_npz", "npz_to_params", "params_to_npz", "read_npz",
    "load_safetensors", "save_safetensors", "read_safetensors",
    "convert_pre_linen", "posemb_sincos_2d",
]


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
  classic ViTs. Without a name: exact GELU, epsilon 1e-6, the width's heads
  (a CLIP tower, whose activation differs by its source, is refused).
  The model's ``apply`` is timm's ``forward``; ``forward_features`` is timm's
  ``forward_features``. ``image_size`` resamples the position embedding.
  """
  return build.from_state_dict(state_dict, name, layout="timm",
                               image_size=image_size, num_heads=num_heads,
                               **model_overrides)


def params_to_timm(variables, layout: Optional[str] = None):
  """Our tree -> a timm ``VisionTransformer`` state dict (numpy), which
  ``timm.create_model(name, num_classes=..., img_size=...)`` loads with
  ``strict=True`` (a ``classifier='gap'`` tree: a model built with
  ``class_token=False, global_pool='avg'``). timm's class (its names) is
  the one the tree needs (:func:`vit_jax.weights.layouts.timm_layout_of`),
  or ``layout`` where two hold it: a relative position table with the
  class token's rows and no key bias is Beit's (default) as much as
  VisionTransformerRelPos's (``layout='timm_relpos'``)."""
  return saving.to_state_dict(variables, layout or "timm")


def to_timm(variables, layout: Optional[str] = None):
  """Like :func:`params_to_timm`, as torch tensors."""
  return saving.to_torch(params_to_timm(variables, layout))


def from_transformers(state_dict_or_dir,
                      config: Optional[Mapping[str, Any]] = None, *,
                      image_size=None, **model_overrides):
  """Hugging Face transformers weights -> ``(model, variables)``: ``ViTModel``
  / ``ViTForImageClassification``, ``ViTMAEModel`` (or a
  ``ViTMAEForPreTraining``'s encoder, its decoder left out with a warning:
  the encoder on every patch, in order), ``IJepaModel`` /
  ``IJepaForImageClassification`` (the mean of the patches), and the image
  towers ``Dinov2Model``, ``CLIPVisionModel`` (or a ``CLIPModel``'s vision
  half), ``SiglipVisionModel`` (or a ``SiglipModel``'s) and
  ``SamVisionModel`` (or a ``SamModel``'s vision encoder:
  ``forward_features`` is its neck map, NHWC).

  ``state_dict_or_dir``: a state dict (``model.state_dict()``, or a model),
  or a directory written by ``save_pretrained`` (``config.json`` +
  ``model.safetensors``). The architecture comes from ``config`` (a
  ``ViTConfig``, or its dict) or the directory's ``config.json``; without
  one, transformers' defaults (exact GELU, LayerNorm epsilon 1e-12). A
  ``ViTModel``'s pooler becomes ``pre_logits`` (Dense + tanh): with no
  classifier, ``apply`` returns its ``pooler_output``.
  """
  return build.from_transformers(state_dict_or_dir, config,
                                 image_size=image_size, **model_overrides)


def params_to_transformers(variables, layout: Optional[str] = None):
  """Our tree -> transformers' state dict (numpy), which the matching model
  loads with ``load_state_dict(strict=True)``. ``layout`` (default: from
  the tree, :func:`vit_jax.weights.saving.transformers_layout`):
  ``'transformers'`` (``ViTForImageClassification``: ``vit.`` prefix and
  ``classifier`` when there is a head; else ``ViTModel``, with ``pooler``
  for ``pre_logits``; ViTMAEModel loads ViTModel's keys without a pooler),
  ``'transformers_ijepa'`` (a tree that averages the patches without a
  class token: ``IJepaModel``, ``IJepaForImageClassification`` with an
  ``ijepa.`` prefix), ``'transformers_dinov2'``, ``'transformers_clip'``
  or ``'transformers_siglip'`` (the image towers)."""
  return saving.to_state_dict(variables, layout or "transformers")


def to_transformers(variables, layout: Optional[str] = None):
  """Like :func:`params_to_transformers`, as torch tensors."""
  return saving.to_torch(params_to_transformers(variables, layout))


def from_state_dict(state_dict, name: Optional[str] = None, **kwargs):
  """A torchvision, timm or transformers ViT state dict, whichever names it
  uses -> ``(model, variables)``; the size is read from the shapes."""
  return build.from_state_dict(state_dict, name, **kwargs)


def params_to_npz(variables, layout: str = "vision_transformer",
                  scan: bool = False):
  return google_npz.tree_to_npz(variables, layout=layout, scan=scan)


params_to_npz.__doc__ = google_npz.tree_to_npz.__doc__


def load_npz(path: str, name: Optional[str] = None, *, image_size=None,
             **model_overrides):
  """A Google ``.npz`` ViT (vision_transformer or big_vision; an R50+ViT
  hybrid as Google's module computes it) -> ``(model, variables)``.
  ``name`` (optional) is checked against the weights; ``image_size``
  resamples the position embedding."""
  return build.from_npz(files.read_npz(path), name, image_size=image_size,
                        **model_overrides)


def load_safetensors(path: str, name: Optional[str] = None, *,
                     image_size=None, num_heads: Optional[int] = None,
                     **model_overrides):
  """A safetensors file of any layout -> ``(model, variables, metadata)``
  (metadata JSON-decoded; ``layout`` says which names the file uses)."""
  return build.from_safetensors(path, name, image_size=image_size,
                                num_heads=num_heads, **model_overrides)
