"""torchvision <-> Flax: the public face of :mod:`vit_jax.weights` for
torchvision's ViTs, and position-embedding / layer-stacking helpers.

    model, variables = convert.from_torchvision(state_dict, "vit_b_16")
    state_dict = convert.to_torchvision(variables)   # strict=True loadable

The key mapping is the ``TORCHVISION`` table of
:mod:`vit_jax.weights.layouts`; torch is imported lazily, only to produce
torch tensors or models, so ``from vit_jax import convert`` works without it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence


from vit_jax.data.preprocessing import Preprocessing  # noqa: F401  (public name)
from vit_jax.weights import build, files, saving, twins
from vit_jax.weights.check import check_keys  # noqa: F401
from vit_jax.weights.posemb import (  # noqa: F401
    resample_patch_embed, resample_posemb, resize_posemb)
from vit_jax.weights.trees import stack_layers, unstack_layers  # noqa: F401

__all__ = [
    "from_torchvision",
    "to_torchvision",
    "to_torchvision_model",
    "load_torchvision",
    "params_to_torchvision",
    "load_state_dict_file",
    "resample_posemb",
    "resize_posemb",
    "resample_patch_embed",
    "stack_layers",
    "unstack_layers",
    "Preprocessing",
]


def from_torchvision(state_dict, name: str, *, image_size=None,
                     **model_overrides):
  """torchvision ViT weights -> ``(model, variables)``.

  Args:
    state_dict: a torchvision ``VisionTransformer`` state dict (torch tensors
      or numpy arrays; a ``torch.nn.Module`` is accepted too).
    name: the variant, e.g. ``"vit_b_16"`` (gives the heads, which a state
      dict does not store, and is checked against the weights).
    image_size: resolution to use the model at. The position embedding is
      resampled from the checkpoint's grid exactly as torchvision's
      ``interpolate_embeddings`` does. ``None`` keeps the checkpoint's.
    **model_overrides: other :class:`~vit_jax.models.VisionTransformer`
      fields (dtype, dropout_rate, scan_layers, ...); architecture fields
      (num_layers, hidden_size, ...) describe a custom-size checkpoint;
      ``conv_stem`` gives a conv stem's strides.

  ``num_classes``, ``representation_size`` and a conv stem are read from the
  weights. Missing, unexpected and mis-shaped keys are reported together.
  """
  return build.from_state_dict(state_dict, name, layout="torchvision",
                               image_size=image_size, **model_overrides)


def params_to_torchvision(variables):
  """Our tree (per-layer or scanned) -> torchvision's state dict, as numpy
  arrays in torchvision's own key order (no torch needed)."""
  return saving.to_state_dict(variables, "torchvision")


def to_torchvision(variables):
  """Flax variables -> a torchvision state dict of torch tensors.

  Loads with ``strict=True`` into ``torchvision.models.<name>(num_classes=...,
  image_size=..., representation_size=...)`` built to match (see
  :func:`to_torchvision_model`, which does that for you).
  """
  return saving.to_torch(params_to_torchvision(variables))


def to_torchvision_model(variables, name, conv_stem=None, **arch_overrides):
  """Builds the matching torchvision ``VisionTransformer`` and loads
  ``variables`` into it with ``strict=True``. A conv stem's strides are
  ``conv_stem``'s (e.g. ``model.conv_stem``), else inferred as on load."""
  return twins.torchvision_model(variables, name, conv_stem=conv_stem,
                                 **arch_overrides)


def load_state_dict_file(path: str):
  """A ``.pth``/``.pt`` state dict as numpy arrays, read without running
  pickled code (``torch.load(weights_only=True)``); unwraps training
  checkpoints' ``{'model': ...}`` / ``{'state_dict': ...}``."""
  return files.read_torch(path)


class TorchvisionWeights(NamedTuple):
  model: Any
  variables: Any
  preprocessing: Preprocessing
  categories: Optional[Sequence[str]] = None


def load_torchvision(name: str, weights: str = "IMAGENET1K_V1", *,
                     image_size=None, **model_overrides) -> TorchvisionWeights:
  """torchvision's released weights (or a ``.pth`` file) as Flax variables.

  ``weights`` is a torchvision weights name (``"IMAGENET1K_V1"``,
  ``"IMAGENET1K_SWAG_E2E_V1"``, ...; downloaded through torch.hub, hash
  checked, read with ``weights_only=True``) or a path to a saved state dict.
  Returns ``(model, variables, preprocessing, categories)``; the model runs
  at the resolution the weights expect unless ``image_size`` is given.
  """
  from vit_jax import weights as weights_lib  # pylint: disable=import-outside-toplevel

  is_file = "/" in weights or weights.endswith((".pth", ".pt", ".bin"))
  source = weights if is_file else f"torchvision:{weights}"
  try:
    loaded = weights_lib.load(source, model_name=name, image_size=image_size,
                              **model_overrides)
  except weights_lib.CheckpointError as e:
    raise ValueError(str(e)) from e
  return TorchvisionWeights(loaded.model, loaded.variables,
                            loaded.preprocessing,
                            None if is_file else loaded.label_names)
