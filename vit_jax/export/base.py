"""The servable (model, variables, preprocessing, input size) and the one
JAX function every format exports: images -> float32 logits, optionally
with the weights' preprocessing inside; a NaFlex model's takes the NaFlex
dict (patches, coordinates, mask) with a symbolic sequence length."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Optional

import numpy as np

from vit_jax.export.preprocessing import preprocess, resize_method
from vit_jax.export.types import (DTYPES, OUTPUTS, ExportError, InputSpec,
                                  NaFlexInputSpec)


@dataclasses.dataclass(frozen=True)
class Servable:
  """What goes into an artifact: the three things a loaded checkpoint has."""

  model: Any
  variables: Any
  preprocessing: Any  # vit_jax.convert.Preprocessing, or None
  image_size: int
  output: str = "logits"  # or 'features': see OUTPUTS


def servable(checkpoint, *, preprocessing=None,
             model_name: Optional[str] = None,
             image_size: Optional[int] = None,
             output: Optional[str] = None) -> Servable:
  """The model, variables and preprocessing to export.

  Args:
    checkpoint: a path (or name) :func:`vit_jax.weights.load` accepts; an
      object with ``.model``, ``.variables`` and ``.preprocessing`` (what
      ``load`` returns); or a tuple ``(model, variables)`` or ``(model,
      variables, preprocessing)``.
    preprocessing: overrides the checkpoint's (a ``Preprocessing``).
    model_name: passed to ``load`` for a path; for a loaded model without
      an input size of its own (rotary positions only), its pretrained
      record's input size.
    image_size: the artifact's input size: passed to ``load`` for a path;
      for a loaded model, its learned position embedding is resampled to
      it (a model with rotary positions only takes it as it is).
    output: what the artifact returns: ``'logits'``, or ``'features'``
      (``forward_features``: the tokens after the final norm, (B, prefix +
      N, D); SAM's neck's (B, h, w, C) map). Default: the logits, or the
      features of a model without a classification head (SAM's released
      encoders, DINOv2's backbones).

  The input size is ``image_size``, else the model's own (its
  ``image_size``, its position embedding's grid), else its
  preprocessing's crop, else ``model_name``'s pretrained record's.
  """
  if isinstance(checkpoint, (str, os.PathLike)):
    from vit_jax import weights  # pylint: disable=import-outside-toplevel
    checkpoint = weights.load(os.fspath(checkpoint), model_name=model_name,
                              image_size=image_size)
  if isinstance(checkpoint, (tuple, list)):
    if len(checkpoint) not in (2, 3):
      raise ExportError(f"Expected (model, variables) or (model, variables, "
                        f"preprocessing), got a sequence of {len(checkpoint)}")
    model, variables, pre = (tuple(checkpoint) + (None,))[:3]
  elif hasattr(checkpoint, "model") and hasattr(checkpoint, "variables"):
    model, variables = checkpoint.model, checkpoint.variables
    pre = getattr(checkpoint, "preprocessing", None)
  else:
    raise ExportError(f"Cannot export {type(checkpoint).__name__}: expected a "
                      f"checkpoint path, a loaded checkpoint or (model, "
                      f"variables[, preprocessing]).")
  pre = preprocessing if preprocessing is not None else pre
  headless = (not getattr(model, "num_classes", None) or
              model.classifier == "unpooled")
  if output is None:
    output = "features" if headless else "logits"
  if output not in OUTPUTS:
    raise ExportError(f"output {output!r}: expected one of {OUTPUTS}")
  if output == "logits" and headless:
    raise ExportError("The model has no classification head, so it has no "
                      "logits to export: export its features "
                      "(output='features', --output features).")
  if is_naflex(model):  # any image shape: no input size
    if output != "logits":
      raise ExportError("A NaFlex artifact returns logits (its features are "
                        "a padded, masked sequence): export output='logits'.")
    return Servable(model, variables, pre, 0)
  if image_size is not None:
    model, variables = _at_size(model, variables, image_size)
    size = int(image_size)
    if pre is not None and preprocessing is None:
      pre = pre.resized(size)  # the weights' recipe at the size asked
  else:
    size = _image_size(model, variables, pre, model_name)
  if pre is not None and int(pre.crop_size) != size:
    raise ExportError(f"The preprocessing crops {pre.crop_size}x"
                      f"{pre.crop_size} images but the model takes "
                      f"{size}x{size}.")
  return Servable(model, variables, pre, size, output)


def _at_size(model, variables, image_size):
  """(model, variables) for square ``image_size`` inputs: a learned
  position embedding made for another grid resampled (as timm does), the
  model's own fixed size replaced."""
  from vit_jax import models  # pylint: disable=import-outside-toplevel
  from vit_jax.weights import posemb, trees  # pylint: disable=import-outside-toplevel
  h, w = models.pair(image_size)
  if h != w:
    raise ExportError(f"Only square inputs are exported; image_size "
                      f"{image_size} is not.")
  if h % model.patch_size and (model.image_size is None or models.pair(
      model.image_size) != (h, w)):
    raise ExportError(f"image_size {h} is not a multiple of the patch size "
                      f"{model.patch_size}: expected e.g. "
                      f"{max(1, h // model.patch_size) * model.patch_size}.")
  layered = trees.unstack_layers(trees.wrap(variables))
  if trees.native_image_size(layered, model) not in (None, h):
    layered = posemb.resize_posemb(
        layered, h, model.patch_size,
        num_prefix_tokens=trees.pos_prefix_rows(model), method="timm")
    variables = (trees.stack_layers(layered) if model.scan_layers
                 else layered)
  if model.image_size is not None and models.pair(model.image_size) != (h, w):
    model = model.clone(image_size=None)
  return model, variables


def is_naflex(model) -> bool:
  """A NaFlex model: its artifact takes the NaFlex dict (patches,
  coordinates, mask) with a symbolic sequence length."""
  return getattr(model, "naflex", None) is not None


def _image_size(model, variables, pre=None, model_name=None) -> int:
  """The model's own input size (its ``image_size``, or its position
  embedding's grid), else its preprocessing's crop, else ``model_name``'s
  pretrained record's; an error naming what to pass without any."""
  if model.image_size is not None:
    h, w = (model.image_size if isinstance(model.image_size, (tuple, list))
            else (model.image_size,) * 2)
    if int(h) != int(w):
      raise ExportError(f"Only square inputs are exported; the model takes "
                        f"{h}x{w}.")
    return int(h)
  from vit_jax.weights import trees  # pylint: disable=import-outside-toplevel
  flat = trees.params_of(trees.unstack_layers(trees.wrap(variables)))
  if "pos_embedding" in flat.get("Transformer", {}).get("posembed_input", {}):
    size = trees.native_image_size(
        trees.unstack_layers(trees.wrap(variables)), model)
    if size is None:
      raise ExportError(
          "The position embedding is not a square grid, so the input size "
          "is unknown: pass image_size (--image-size) for a square one.")
    return int(size)
  if pre is not None:  # rotary positions only: the weights' recipe says
    return int(pre.crop_size)
  if model_name:
    from vit_jax.weights import pretrained  # pylint: disable=import-outside-toplevel
    if pretrained.is_name(model_name):
      return int(pretrained.lookup(model_name).input_size[-1])
  raise ExportError(
      "The model has no learned position embedding (rotary positions only, "
      "as DINOv3's), so the weights do not say its input size: pass "
      "image_size (--image-size), a preprocessing, or the model_name of its "
      "pretrained record (e.g. 'vit_small_patch16_dinov3').")


def serving_function(s: Servable, *, dtype: str = "float32",
                     with_preprocessing: bool = False,
                     dynamic_batch: bool = True):
  """``(fn, params)``: ``fn(params, images) -> float32 logits`` (or
  features: ``s.output``), the function every format exports, and the
  parameters it is exported with (cast to ``dtype``)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  if dtype not in DTYPES:
    raise ExportError(f"dtype {dtype!r}: expected one of {DTYPES}")
  if with_preprocessing and is_naflex(s.model):
    raise ExportError(
        "--with-preprocessing: a NaFlex model's resize depends on each "
        "image's shape (a token budget); export it without, and prepare its "
        "patches with vit_jax.data.naflex.batch_images.")
  if with_preprocessing and s.preprocessing is None:
    raise ExportError("--with-preprocessing needs the weights' preprocessing "
                      "(resize, crop, mean, std): pass a checkpoint, or "
                      "(model, variables, preprocessing).")
  if with_preprocessing:
    resize_method(s.preprocessing)
  from vit_jax.models import kernels  # pylint: disable=import-outside-toplevel

  model = s.model
  tokens = (s.image_size // model.patch_size) ** 2 + model.num_prefix_tokens
  # The CPU attention path splits longer sequences into chunks whose count
  # depends on the batch size; a dynamic batch uses XLA's attention instead
  # (the same function). So does a NaFlex model, whose sequence length may
  # be symbolic.
  if ((is_naflex(model) or (dynamic_batch and
                            tokens > kernels.FUSED_ATTENTION_MAX_KEYS)) and
      model.attention_impl in (None, "matmul")):
    model = model.clone(attention_impl="xla")
  params = s.variables
  if dtype == "bfloat16":
    model = model.clone(dtype=jnp.bfloat16)
    params = jax.tree_util.tree_map(
        lambda x: (np.asarray(x).astype(jnp.bfloat16)
                   if jnp.issubdtype(np.asarray(x).dtype, jnp.floating)
                   else np.asarray(x)), params)
  pre = s.preprocessing

  method = model.forward_features if s.output == "features" else None

  def fn(params, images):
    x = preprocess(images, pre) if with_preprocessing else images
    return model.apply(params, x, train=False, method=method).astype(
        jnp.float32)

  return fn, params


def output_shape(s: Servable, *, batch: Optional[int] = None) -> tuple:
  """The artifact's output shape, ``None`` for the dynamic batch: (batch,
  classes) for logits; the features' own ((batch, tokens, width), or SAM's
  (batch, h, w, channels))."""
  import jax  # pylint: disable=import-outside-toplevel
  if s.output == "logits":
    return (batch, int(s.model.num_classes))
  fn, params = serving_function(s)
  spec = input_spec(s, batch=1)
  shape = jax.eval_shape(fn, params, jax.ShapeDtypeStruct(
      (1, *spec.shape[1:]), np.dtype(spec.dtype))).shape
  return (batch, *shape[1:])


def input_spec(s: Servable, *, batch: Optional[int] = None,
               with_preprocessing: bool = False,
               seq_len: Optional[int] = None):
  """What the artifact takes: an :class:`InputSpec` of images, or for a
  NaFlex model a :class:`NaFlexInputSpec` (``seq_len`` None: symbolic)."""
  if batch is not None and int(batch) < 1:
    raise ExportError(f"batch={batch}: expected >= 1 (or None: dynamic)")
  b = None if batch is None else int(batch)
  if is_naflex(s.model):
    if seq_len is not None and int(seq_len) < 1:
      raise ExportError(f"seq_len={seq_len}: expected >= 1 (or None: "
                        f"symbolic)")
    p = s.model.patch_size
    return NaFlexInputSpec(b, None if seq_len is None else int(seq_len),
                           p * p * s.model.num_channels)
  if seq_len is not None:
    raise ExportError("seq_len: only a NaFlex model takes a sequence of "
                      "patches; this one takes images")
  if with_preprocessing:
    return InputSpec((b, None, None, 3), "uint8")
  return InputSpec((b, s.image_size, s.image_size, s.model.num_channels),
                   "float32")


def exported(s: Servable, *, batch=None, dtype="float32",
             with_preprocessing=False, platforms=("cpu",),
             params_as_arguments=False, seq_len=None):
  """The ``jax.export.Exported`` of the serving function: ``call(images)``
  (parameters baked in), or ``call(params, images)`` with
  ``params_as_arguments`` (then returns ``(exported, params)``). A NaFlex
  model's takes the NaFlex dict, its sequence length symbolic unless
  ``seq_len`` fixes it."""
  import jax  # pylint: disable=import-outside-toplevel

  fn, params = serving_function(s, dtype=dtype,
                                with_preprocessing=with_preprocessing,
                                dynamic_batch=batch is None)
  spec = input_spec(s, batch=batch, with_preprocessing=with_preprocessing,
                    seq_len=seq_len).jax()
  platforms = tuple(platforms)
  if params_as_arguments:
    params_spec = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
        params)
    return jax.export.export(jax.jit(fn), platforms=platforms)(
        params_spec, spec), params
  return jax.export.export(jax.jit(functools.partial(fn, params)),
                           platforms=platforms)(spec)
