"""Our tree -> the PyTorch libraries' state dicts and files, with the
architecture record a file carries beside its weights.

* :func:`to_state_dict` (numpy, float32) in torchvision's, timm's or
  transformers' names (the transformers image tower chosen from the tree);
* :func:`save_safetensors`: ours bit for bit (with the architecture,
  preprocessing and label names in its header) or a library's layout;
* :func:`save_npz`: Google's ``.npz`` layouts.

Every layout is a table of :mod:`vit_jax.weights.layouts`; this module only
chooses one and writes.
"""

from __future__ import annotations

import collections
from typing import Any, Mapping, Optional

import numpy as np

from vit_jax import models
from vit_jax.weights import build, files, google_npz, layouts, trees

LIBRARY_LAYOUTS = ("torchvision", "timm", "transformers")


def transformers_layout(variables) -> str:
  """Which transformers image tower holds this tree
  (:func:`vit_jax.weights.layouts.transformers_layout_of`): SigLIP's (a MAP
  head), CLIP's (a pre-norm), AIMv2's (RMSNorm), DINOv3's (RoPE only),
  DINOv2's or DINOv2 with registers' (LayerScale or SwiGLU), I-JEPA's (the
  mean of the patches, no class token), else ViT's."""
  return layouts.transformers_layout_of(trees.arch_of(variables))


def to_state_dict(variables, layout: str
                  ) -> "collections.OrderedDict[str, np.ndarray]":
  """Our tree (per-layer or scanned) -> ``layout``'s state dict (numpy,
  float32, in the library's own key order), which the library's model
  loads with ``strict=True``.

  ``layout``: ``'torchvision'``, ``'timm'``, ``'transformers'`` (the tower
  :func:`transformers_layout` picks: ``ViTForImageClassification`` with a
  ``vit.`` prefix when there is a head, else ``ViTModel`` with ``pooler``
  for ``pre_logits``) or one of the transformers towers by name
  (``'transformers_vit_mae'``, ``'transformers_ijepa'`` (with a head under
  ``ijepa.``), ``'transformers_dinov2'``, ``'transformers_dinov2_reg'``,
  ``'transformers_dinov3'``, ``'transformers_clip'``,
  ``'transformers_siglip'``, ``'transformers_aimv2'``,
  ``'transformers_beit'``, ``'transformers_data2vec_vision'`` (with a head
  under ``beit.`` / ``data2vec_vision.``), ``'transformers_sam'``).
  ``'timm'`` is VisionTransformer's, Eva's, Beit's, VisionTransformerSAM's,
  Cait's or VisionTransformerRelPos's names, as the tree needs
  (:func:`vit_jax.weights.layouts.timm_layout_of`)."""
  variables = trees.wrap(trees.unstack_layers(trees.wrap(variables)))
  if layout == "transformers":
    layout = transformers_layout(variables)
  sd = build.to_state_dict(variables, layout)
  prefix = _CLASSIFIER_PREFIX.get(layout)
  if prefix is None or "classifier.weight" not in sd:
    return sd
  if "pooler.dense.weight" in sd:
    raise ValueError("transformers' ViTForImageClassification has no pooler: "
                     "a tree with both pre_logits and a head cannot be "
                     "exported to it.")
  return collections.OrderedDict(
      (k if k.startswith("classifier.") else prefix + k, v)
      for k, v in sd.items())


# The ...ForImageClassification models' prefix of their encoder's keys.
_CLASSIFIER_PREFIX = {"transformers": "vit.", "transformers_beit": "beit.",
                      "transformers_data2vec_vision": "data2vec_vision.",
                      "transformers_ijepa": "ijepa."}


def to_torch(state_dict) -> "collections.OrderedDict":
  """numpy arrays -> torch tensors (torch imported here only). The state
  dicts made here (writable, contiguous, their own memory) become tensors
  without a copy; any other array is copied."""
  import torch  # pylint: disable=import-outside-toplevel

  def tensor(v):
    own = (isinstance(v, np.ndarray) and v.flags.writeable and
           v.flags.owndata and v.flags.c_contiguous and v.dtype.isnative)
    return torch.from_numpy(v if own else np.array(v))
  return collections.OrderedDict(
      (k, tensor(v)) for k, v in state_dict.items())


def save_safetensors(variables, path: str, *, model=None,
                     layout: str = "vit_jax",
                     metadata: Optional[Mapping[str, Any]] = None) -> None:
  """Writes ``variables`` to a safetensors file.

  Args:
    variables: ``{'params': ..., 'batch_stats': ...}`` (or bare params).
    path: output file.
    model: the Module the variables belong to: its architecture is stored
      (:func:`vit_jax.models.arch_record`: a conv stem's strides, the
      activation and LayerNorm epsilon are not in the weights); else what
      the tree determines is.
    layout: ``'vit_jax'`` (our tree, bit for bit), ``'timm'``,
      ``'torchvision'`` or ``'transformers'`` (their names, float32).
    metadata: extra JSON-able entries (e.g. ``preprocessing``,
      ``label_names``), stored JSON-encoded in the header.
  """
  variables = trees.wrap(trees.unstack_layers(trees.wrap(variables)))
  arch = models.arch_record(model if model is not None
                            else trees.arch_of(variables))
  if layout == "vit_jax":
    tensors = trees.flatten(variables)
  elif layout in LIBRARY_LAYOUTS:
    tensors = to_state_dict(variables, layout)
  else:
    raise ValueError(f"layout={layout!r}: expected 'vit_jax', "
                     f"{', '.join(map(repr, LIBRARY_LAYOUTS))}")
  meta = {"format": "vit_jax" if layout == "vit_jax" else "pt",
          "layout": layout, "arch": arch}
  meta.update(metadata or {})
  files.write_safetensors(tensors, path, meta)


def save_npz(variables, path: str, layout: str = "vision_transformer",
             scan: bool = False) -> None:
  """Writes :func:`vit_jax.weights.google_npz.tree_to_npz` to ``path``
  (``np.savez``, no pickle)."""
  arrays = google_npz.tree_to_npz(variables, layout=layout, scan=scan)
  with open(path, "wb") as f:
    np.savez(f, **arrays)
