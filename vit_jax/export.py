r"""Deployment artifacts of a ViT: StableHLO, TensorFlow SavedModel, ONNX.

    python -m vit_jax.export --checkpoint vit_b_16.pth --model vit_b_16 \
        --format stablehlo --out vit_b_16.shlo
    python -m vit_jax.export --checkpoint /tmp/digits --format savedmodel \
        --out /tmp/digits_savedmodel --with-preprocessing
    python -m vit_jax.export --checkpoint augreg_Ti_16.npz --format onnx \
        --out ti16.onnx --batch 8

``--checkpoint`` is anything :func:`vit_jax.inference.load` reads. Every
artifact maps images to logits (float32, ``(batch, num_classes)``):

* without ``--with-preprocessing`` it takes what ``model.apply`` takes:
  float32 NHWC images, already resized, cropped and normalised,
  ``(batch, S, S, 3)``;
* with ``--with-preprocessing`` it takes decoded uint8 RGB images
  ``(batch, height, width, 3)`` of any size (one size per call) and does the
  weights' own resize / center crop / normalisation inside (:func:`preprocess`).

The batch dimension is dynamic unless ``--batch`` fixes it. ``--dtype
bfloat16`` computes in bfloat16 (parameters stored in bfloat16); inputs and
logits keep the dtypes above.

Formats and the runtime that reads each:

* ``stablehlo``: one file of ``jax.export`` bytes;
  ``jax.export.deserialize(open(path, 'rb').read()).call(images)`` in any
  JAX program (or :func:`load_stablehlo`, which checks the input first).
* ``savedmodel``: a directory for ``tf.saved_model.load`` / TF Serving whose
  ``serving_default`` signature takes ``images`` and returns ``logits``: the
  same StableHLO module run by TensorFlow's ``XlaCallModule`` op (jax2tf's
  native serialization), parameters stored as TF variables. TensorFlow 2.21
  reads StableHLO 1.13.7, older than what JAX 0.10.2 writes, and cannot
  refine dynamic shapes inside ``stablehlo.composite`` ops (JAX wraps
  ``lax.erf``, our GELU, in one); so the module is rewritten for it: every
  composite becomes a call to its own decomposition (the ops XLA runs for it,
  so the numbers are the same), serialized for TensorFlow's StableHLO
  version (:func:`for_tensorflow`).
* ``onnx``: one ``.onnx`` file for onnxruntime, made from the exact torch
  twin of the model (``vit_jax.convert.to_torchvision_model``, or timm's
  model for layouts torchvision cannot hold) by ``torch.onnx.export``; see
  :mod:`vit_jax.export_onnx`.

What the exported preprocessing computes, against ``vit_jax.predict``'s PIL
path: the same geometry (short side to ``max(resize_size, crop_size)``, the
long side ``int()``-truncated, crop offsets rounded half to even, as
torchvision) and the same antialiased filters (bilinear = triangle, bicubic =
Keys a=-0.5, lanczos = Lanczos-3), as one float resampling straight into the
crop (``jax.image.scale_and_translate``), clipped to [0, 255]. PIL resamples
in two passes and rounds to uint8 after each; that rounding is not done here
(it would make the artifact's output jump between runtimes on ties), so pixel
values differ from PIL's by about 0.3/255 on average (README: Deploying).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from typing import Any, Callable, Optional, Sequence

import numpy as np

FORMATS = ("stablehlo", "savedmodel", "onnx")
DTYPES = ("float32", "bfloat16")
# Attention over more keys than this runs in chunks whose count depends on
# the batch (vit_jax.layers); a dynamic batch then uses XLA's attention.
_MAX_KEYS_FOR_DYNAMIC_BATCH = 256


class ExportError(ValueError):
  """A model, option or artifact that cannot be exported or served."""


@dataclasses.dataclass(frozen=True)
class Servable:
  """What goes into an artifact: the three things a loaded checkpoint has."""

  model: Any
  variables: Any
  preprocessing: Any  # vit_jax.convert.Preprocessing, or None
  image_size: int


def servable(checkpoint, *, preprocessing=None, model_name: Optional[str] = None,
             image_size: Optional[int] = None) -> Servable:
  """The model, variables and preprocessing to export.

  Args:
    checkpoint: a path (or name) :func:`vit_jax.inference.load` accepts; an
      object with ``.model``, ``.variables`` and ``.preprocessing`` (what
      ``load`` returns); or a tuple ``(model, variables)`` or ``(model,
      variables, preprocessing)``.
    preprocessing: overrides the checkpoint's (a ``Preprocessing``).
    model_name, image_size: passed to ``load`` for a path.
  """
  if isinstance(checkpoint, (str, os.PathLike)):
    from vit_jax import inference  # pylint: disable=import-outside-toplevel
    checkpoint = inference.load(os.fspath(checkpoint), model_name=model_name,
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
  if not getattr(model, "num_classes", None) or model.classifier == "unpooled":
    raise ExportError("The model has no classification head: an artifact "
                      "returns logits, so there is nothing to export.")
  size = _image_size(model, variables)
  if pre is not None and int(pre.crop_size) != size:
    raise ExportError(f"The preprocessing crops {pre.crop_size}x"
                      f"{pre.crop_size} images but the model takes "
                      f"{size}x{size}.")
  return Servable(model, variables, pre, size)


def _image_size(model, variables) -> int:
  if model.image_size is not None:
    h, w = (model.image_size if isinstance(model.image_size, (tuple, list))
            else (model.image_size,) * 2)
    if int(h) != int(w):
      raise ExportError(f"Only square inputs are exported; the model takes "
                        f"{h}x{w}.")
    return int(h)
  from vit_jax import convert  # pylint: disable=import-outside-toplevel
  from vit_jax.formats_arch import arch_of  # pylint: disable=import-outside-toplevel
  size = arch_of(convert.unstack_layers(dict(variables)),
                 conv_stem=model.conv_stem)["image_size"]
  if size is None:
    raise ExportError("The position embedding is not a square grid, so the "
                      "input size is unknown: set the model's image_size.")
  return int(size)


# --------------------------------------------------------------------------- #
# The exported computation (JAX).
# --------------------------------------------------------------------------- #


def crop_geometry(height, width, pre, xp=np):
  """torchvision's ``Resize(size) -> CenterCrop(crop)`` geometry in integer
  arithmetic (``height``/``width``: ints or 0-d integer arrays, traced or
  symbolic): the resized ``(new_h, new_w)`` (short side ``size``, long side
  truncated as ``int()``) and the crop's ``(top, left)`` (``round((new -
  crop) / 2)``, half to even, as Python's ``round``)."""
  c = int(pre.crop_size)
  size = max(int(pre.resize_size), c)
  new_h = xp.maximum(size, size * height // width)
  new_w = xp.maximum(size, size * width // height)

  def offset(n):
    d = n - c
    k = d // 2
    return k + (d % 2) * (k % 2)

  return new_h, new_w, offset(new_h), offset(new_w)


def resize_method(pre) -> str:
  interp = str(pre.interpolation).lower()
  if interp not in RESIZE_KERNELS:
    raise ExportError(f"The exported preprocessing supports interpolation "
                      f"{sorted(RESIZE_KERNELS)}, not {pre.interpolation!r}.")
  return interp


# Filters (PIL's BILINEAR, BICUBIC, LANCZOS; jax.image's linear, cubic,
# lanczos3) of a distance x >= 0 in input pixels, written for any array
# namespace ``xp`` (JAX here, torch in vit_jax.export_onnx).
def _triangle(xp, x):
  return xp.relu(1.0 - x)


def _keys_cubic(xp, x):  # a = -0.5
  out = ((1.5 * x - 2.5) * x) * x + 1.0
  out = xp.where(x >= 1.0, ((-0.5 * x + 2.5) * x - 4.0) * x + 2.0, out)
  return xp.where(x >= 2.0, 0.0 * x, out)


def _lanczos3(xp, x):
  r = 3.0
  y = r * xp.sin(np.pi * x) * xp.sin(np.pi * x / r)
  safe = xp.where(x > 1e-3, x, 1.0 + 0.0 * x)
  out = xp.where(x > 1e-3, y / (np.pi ** 2 * safe * safe), 1.0 + 0.0 * x)
  return xp.where(x > r, 0.0 * x, out)


RESIZE_KERNELS = {"bilinear": _triangle, "bicubic": _keys_cubic,
                  "lanczos": _lanczos3}


def resample_weights(xp, n, n_arr, new, offset, out: int, kernel):
  """``(n, out)`` weights taking ``n`` input pixels to the ``out`` pixels
  starting at ``offset`` of the input resized to ``new`` pixels, with the
  antialiased ``kernel`` (stretched by ``n / new`` when shrinking), each
  column normalised to sum 1: ``jax.image.scale_and_translate``'s weights
  (and PIL's), with the distances computed exactly in integers.

  Output pixel i samples the input at ``s = (i + offset + 1/2) n / new -
  1/2``; input pixel j's distance, in kernel units, is ``|s - j| / max(n /
  new, 1) = |(2 (i + offset) + 1) n - (2 j + 1) new| / (2 max(n, new))``.
  """
  i = xp.arange(out)[None, :]
  j = xp.arange(n)[:, None]
  num = (2 * (i + offset) + 1) * n_arr - (2 * j + 1) * new
  x = xp.to_f32(xp.abs(num)) / xp.to_f32(2 * xp.maximum(n_arr, new))
  weights = kernel(xp, x)
  return weights / xp.sum0(weights)


def preprocess_with(xp, images, pre, mean, std):
  """:func:`preprocess` in the array namespace ``xp`` (see ``_JaxOps``)."""
  _, h, w, _ = images.shape
  c = int(pre.crop_size)
  kernel = RESIZE_KERNELS[resize_method(pre)]
  hs, ws = xp.scalar(h), xp.scalar(w)
  new_h, new_w, top, left = crop_geometry(hs, ws, pre, xp)
  wh = resample_weights(xp, h, hs, new_h, top, c, kernel)
  ww = resample_weights(xp, w, ws, new_w, left, c, kernel)
  x = xp.einsum("bhwc,ho->bowc", xp.to_f32(images), wh)
  x = xp.einsum("bowc,wp->bopc", x, ww)
  x = xp.clip(x, 0.0, 255.0) / 255.0
  return (x - mean) / std


class _JaxOps:
  """The few array operations :func:`preprocess_with` needs, in JAX."""

  def __init__(self):
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    self.jnp, self.hi = jnp, jax.lax.Precision.HIGHEST
    self.abs, self.maximum, self.where, self.sin = (
        jnp.abs, jnp.maximum, jnp.where, jnp.sin)

  def arange(self, n):
    return self.jnp.arange(n, dtype=self.jnp.int32)

  def scalar(self, n):
    return self.jnp.asarray(n, self.jnp.int32)

  def to_f32(self, x):
    return x.astype(self.jnp.float32)

  def relu(self, x):
    return self.jnp.maximum(x, 0.0)

  def sum0(self, x):
    return self.jnp.sum(x, axis=0, keepdims=True)

  def clip(self, x, lo, hi):
    return self.jnp.clip(x, lo, hi)

  def einsum(self, spec, a, b):
    return self.jnp.einsum(spec, a, b, precision=self.hi)


def preprocess(images, pre):
  """uint8 ``(batch, H, W, 3)`` -> float32 ``(batch, S, S, 3)``, normalised.

  Resize the short side and center crop (:func:`crop_geometry`) as one
  antialiased resampling of the input straight into the crop, so that any
  H, W give the crop's fixed shape (:func:`resample_weights`: two weight
  matrices computed from H and W), clip to [0, 255], scale to [0, 1],
  normalise with the weights' mean and std.
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  if images.dtype != jnp.uint8:
    raise ExportError(f"Expected uint8 images, got {images.dtype}.")
  return preprocess_with(_JaxOps(), images, pre,
                         jnp.asarray(pre.mean, jnp.float32),
                         jnp.asarray(pre.std, jnp.float32))


def serving_function(s: Servable, *, dtype: str = "float32",
                     with_preprocessing: bool = False,
                     dynamic_batch: bool = True):
  """``(fn, params)``: ``fn(params, images) -> float32 logits``, the function
  every format exports, and the parameters it is exported with (cast to
  ``dtype``)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  if dtype not in DTYPES:
    raise ExportError(f"dtype {dtype!r}: expected one of {DTYPES}")
  if with_preprocessing and s.preprocessing is None:
    raise ExportError("--with-preprocessing needs the weights' preprocessing "
                      "(resize, crop, mean, std): pass a checkpoint, or "
                      "(model, variables, preprocessing).")
  if with_preprocessing:
    resize_method(s.preprocessing)
  model = s.model
  tokens = (s.image_size // model.patch_size) ** 2 + 1
  if (dynamic_batch and tokens > _MAX_KEYS_FOR_DYNAMIC_BATCH and
      model.attention_impl in (None, "matmul")):
    model = model.clone(attention_impl="xla")  # same function, any batch
  params = s.variables
  if dtype == "bfloat16":
    model = model.clone(dtype=jnp.bfloat16)
    params = jax.tree_util.tree_map(
        lambda x: (np.asarray(x).astype(jnp.bfloat16)
                   if jnp.issubdtype(np.asarray(x).dtype, jnp.floating)
                   else np.asarray(x)), params)
  pre = s.preprocessing

  def fn(params, images):
    x = preprocess(images, pre) if with_preprocessing else images
    return model.apply(params, x, train=False).astype(jnp.float32)

  return fn, params


@dataclasses.dataclass(frozen=True)
class InputSpec:
  """The images an artifact takes; ``None`` in ``shape`` is dynamic."""

  shape: tuple
  dtype: str

  def describe(self) -> str:
    names = ("batch", "height", "width")
    dims = [names[i] if d is None else str(d) for i, d in enumerate(self.shape)]
    return f"{self.dtype} ({', '.join(dims)})"

  def jax(self):
    import jax  # pylint: disable=import-outside-toplevel
    names = ("b", "h", "w")
    dims = [names[i] if d is None else str(d) for i, d in enumerate(self.shape)]
    return jax.ShapeDtypeStruct(jax.export.symbolic_shape(", ".join(dims)),
                                np.dtype(self.dtype))

  def check(self, images, what: str = "The artifact"):
    """Raises ExportError unless ``images`` fits this spec."""
    shape, dtype = tuple(np.shape(images)), np.dtype(images.dtype)
    ok = len(shape) == 4 and all(
        want is None or want == got for want, got in zip(self.shape, shape))
    if ok and 0 not in shape and dtype == np.dtype(self.dtype):
      return
    hint = ""
    if len(shape) == 4 and shape[1] == 3 and shape[-1] != 3:
      hint = " It looks like NCHW; transpose with images.transpose(0, 2, 3, 1)."
    raise ExportError(f"{what} takes {self.describe()} NHWC images, got "
                      f"{dtype} {shape}.{hint}")


def input_spec(s: Servable, *, batch: Optional[int] = None,
               with_preprocessing: bool = False) -> InputSpec:
  if batch is not None and int(batch) < 1:
    raise ExportError(f"batch={batch}: expected >= 1 (or None: dynamic)")
  b = None if batch is None else int(batch)
  if with_preprocessing:
    return InputSpec((b, None, None, 3), "uint8")
  return InputSpec((b, s.image_size, s.image_size, s.model.num_channels),
                   "float32")


# --------------------------------------------------------------------------- #
# StableHLO (jax.export).
# --------------------------------------------------------------------------- #


def exported(s: Servable, *, batch=None, dtype="float32",
             with_preprocessing=False, platforms=("cpu",),
             params_as_arguments=False):
  """The ``jax.export.Exported`` of the serving function: ``call(images)``
  (parameters baked in), or ``call(params, images)`` with
  ``params_as_arguments`` (then returns ``(exported, params)``)."""
  import jax  # pylint: disable=import-outside-toplevel

  fn, params = serving_function(s, dtype=dtype,
                                with_preprocessing=with_preprocessing,
                                dynamic_batch=batch is None)
  spec = input_spec(s, batch=batch, with_preprocessing=with_preprocessing).jax()
  platforms = tuple(platforms)
  if params_as_arguments:
    params_spec = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), params)
    return jax.export.export(jax.jit(fn), platforms=platforms)(
        params_spec, spec), params
  return jax.export.export(jax.jit(functools.partial(fn, params)),
                           platforms=platforms)(spec)


def export_stablehlo(s: Servable, out: str, **kwargs) -> str:
  data = exported(s, **kwargs).serialize()
  with open(out, "wb") as f:
    f.write(data)
  return out


class StableHLOArtifact:
  """A deserialized StableHLO artifact that checks its input first."""

  def __init__(self, path: str):
    import jax  # pylint: disable=import-outside-toplevel

    with open(path, "rb") as f:
      self.exported = jax.export.deserialize(bytearray(f.read()))
    aval = self.exported.in_avals[0]
    self.spec = InputSpec(
        tuple(d if isinstance(d, int) else None for d in aval.shape),
        str(aval.dtype))
    self.path = path

  def __call__(self, images):
    self.spec.check(images, f"{self.path}")
    return self.exported.call(images)


def load_stablehlo(path: str) -> Callable:
  """The StableHLO artifact at ``path`` as a callable ``images -> logits``.

  Same as ``jax.export.deserialize(open(path, 'rb').read()).call``, with an
  error naming the expected shape and dtype for other inputs.
  """
  return StableHLOArtifact(path)


# --------------------------------------------------------------------------- #
# SavedModel (jax2tf native serialization, for TensorFlow's StableHLO).
# --------------------------------------------------------------------------- #


def _composites_to_calls(module) -> int:
  """Replaces every ``stablehlo.composite`` op by a ``func.call`` of its
  decomposition (the computation is unchanged); returns how many."""
  from jax.extend.mlir import ir  # pylint: disable=import-outside-toplevel
  from jax.extend.mlir.dialects import func  # pylint: disable=import-outside-toplevel

  composites = []

  def visit(op):
    if op.name == "stablehlo.composite":
      composites.append(op)
    return ir.WalkResult.ADVANCE

  module.operation.walk(visit)
  for op in composites:
    with ir.InsertionPoint(op), op.location:
      call = func.CallOp(list(op.results.types),
                         op.attributes["decomposition"], list(op.operands))
    for old, new in zip(op.results, call.results):
      old.replace_all_uses_with(new)
    op.erase()
  return len(composites)


def tensorflow_stablehlo_version() -> str:
  from tensorflow.compiler.mlir.stablehlo import stablehlo as tf_stablehlo  # pylint: disable=import-outside-toplevel
  return tf_stablehlo.get_current_version()


def for_tensorflow(exp, target: Optional[str] = None):
  """``exp`` with its module rewritten for TensorFlow's ``XlaCallModule``:
  composites turned into calls of their decompositions (TF 2.21's StableHLO
  refines no dynamic shapes inside a composite, but does through calls) and
  serialized for ``target`` (default: the installed TensorFlow's StableHLO
  version, if older than JAX's own target)."""
  from jax.extend.mlir import ir  # pylint: disable=import-outside-toplevel
  from jax.extend.mlir.dialects import stablehlo  # pylint: disable=import-outside-toplevel

  jax_target = stablehlo.get_version_from_compatibility_requirement(
      stablehlo.StablehloCompatibilityRequirement.WEEK_4)
  target = stablehlo.get_smaller_version(
      target or tensorflow_stablehlo_version(), jax_target)
  ctx = ir.Context()
  with ctx, ir.Location.unknown(ctx):
    module = stablehlo.deserialize_portable_artifact(
        ctx, exp.mlir_module_serialized)
    _composites_to_calls(module)
    data = stablehlo.serialize_portable_artifact(module, target)
  return dataclasses.replace(exp, mlir_module_serialized=data)


def export_savedmodel(s: Servable, out: str, *, batch=None, dtype="float32",
                      with_preprocessing=False, platforms=("cpu",)) -> str:
  import jax  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from jax.experimental.jax2tf import jax2tf  # pylint: disable=import-outside-toplevel

  exp, params = exported(s, batch=batch, dtype=dtype,
                         with_preprocessing=with_preprocessing,
                         platforms=platforms, params_as_arguments=True)
  exp = for_tensorflow(exp)
  spec = input_spec(s, batch=batch, with_preprocessing=with_preprocessing)
  module = tf.Module()
  # Parameters as variables (SavedModel's variables/, no 2 GB graph limit),
  # in the order of the exported function's flattened arguments.
  module.params = [tf.Variable(np.asarray(x), trainable=False)
                   for x in jax.tree_util.tree_leaves(params)]

  @tf.function(autograph=False, input_signature=[
      tf.TensorSpec(spec.shape, tf.as_dtype(spec.dtype), name="images")])
  def serve(images):
    # A clear error for another shape (TF Serving checks only the dtype).
    images = tf.ensure_shape(images, spec.shape)
    # jax2tf's native serialization of an Exported: one XlaCallModule op.
    # pylint: disable-next=protected-access
    logits, = jax2tf._run_exported_as_tf([*module.params, images], exp)
    return {"logits": logits}

  module.serve = serve
  tf.saved_model.save(module, out, signatures={"serving_default": serve})
  return out


# --------------------------------------------------------------------------- #
# Export, load, CLI.
# --------------------------------------------------------------------------- #


def export(checkpoint, fmt: str, out: str, *, batch: Optional[int] = None,
           dtype: str = "float32", with_preprocessing: bool = False,
           platforms: Sequence[str] = ("cpu",),
           model_name: Optional[str] = None,
           image_size: Optional[int] = None, preprocessing=None) -> str:
  """Writes ``checkpoint`` as a ``fmt`` artifact at ``out``; returns ``out``.

  Args:
    checkpoint: see :func:`servable` (a path, a loaded checkpoint, or
      ``(model, variables[, preprocessing])``).
    fmt: ``'stablehlo'``, ``'savedmodel'`` or ``'onnx'``.
    out: a file (stablehlo, onnx) or a directory (savedmodel).
    batch: a fixed batch size; ``None`` (default): dynamic.
    dtype: ``'float32'`` or ``'bfloat16'`` (computation and parameters;
      not ONNX: onnxruntime's CPU kernels have no bfloat16).
    with_preprocessing: the artifact takes uint8 ``(batch, H, W, 3)`` images
      of any size and resizes, crops and normalises them itself.
    platforms: for stablehlo / savedmodel, the platforms the module is
      lowered for (e.g. ``('cpu', 'cuda')``).
    model_name, image_size, preprocessing: see :func:`servable`.
  """
  if fmt not in FORMATS:
    raise ExportError(f"format {fmt!r}: expected one of {FORMATS}")
  if dtype not in DTYPES:
    raise ExportError(f"dtype {dtype!r}: expected one of {DTYPES}")
  s = servable(checkpoint, preprocessing=preprocessing, model_name=model_name,
               image_size=image_size)
  kwargs = dict(batch=batch, dtype=dtype, with_preprocessing=with_preprocessing)
  out = os.fspath(out)
  parent = os.path.dirname(os.path.abspath(out))
  os.makedirs(parent, exist_ok=True)
  if fmt == "stablehlo":
    return export_stablehlo(s, out, platforms=platforms, **kwargs)
  if fmt == "savedmodel":
    return export_savedmodel(s, out, platforms=platforms, **kwargs)
  from vit_jax import export_onnx  # pylint: disable=import-outside-toplevel
  return export_onnx.export_onnx(s, out, **kwargs)


def load(fmt: str, path: str) -> Callable:
  """An artifact run by its own runtime, as ``images (numpy) -> logits
  (numpy)``: ``jax.export``, ``tf.saved_model.load`` or onnxruntime."""
  if fmt == "stablehlo":
    art = load_stablehlo(path)
    return lambda images: np.asarray(art(images))
  if fmt == "savedmodel":
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    serve = tf.saved_model.load(path).signatures["serving_default"]
    return lambda images: serve(images=tf.constant(images))["logits"].numpy()
  if fmt == "onnx":
    import onnxruntime as ort  # pylint: disable=import-outside-toplevel
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return lambda images: sess.run(["logits"], {"images": images})[0]
  raise ExportError(f"format {fmt!r}: expected one of {FORMATS}")


def _size_of(path: str) -> int:
  if os.path.isdir(path):
    return sum(os.path.getsize(os.path.join(d, f))
               for d, _, fs in os.walk(path) for f in fs)
  return os.path.getsize(path)


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(
      prog="python -m vit_jax.export",
      description="Export a ViT checkpoint as a StableHLO, TensorFlow "
                  "SavedModel or ONNX artifact (images in, logits out).")
  ap.add_argument("--checkpoint", required=True,
                  help="anything vit_jax.inference.load reads (a training "
                       "workdir, .pth, .npz, .safetensors, torchvision:NAME)")
  ap.add_argument("--format", required=True, choices=FORMATS)
  ap.add_argument("--out", required=True,
                  help="output file (stablehlo, onnx) or directory "
                       "(savedmodel)")
  ap.add_argument("--batch", type=int, default=None,
                  help="fixed batch size (default: dynamic)")
  ap.add_argument("--dtype", choices=DTYPES, default="float32")
  ap.add_argument("--with-preprocessing", action="store_true",
                  help="take uint8 (batch, H, W, 3) images of any size; "
                       "resize, crop and normalise inside")
  ap.add_argument("--platforms", default="cpu",
                  help="stablehlo/savedmodel: comma-separated platforms to "
                       "lower for (cpu, cuda, rocm, tpu)")
  ap.add_argument("--model", default=None,
                  help="variant when the weights cannot tell (vit_b_16)")
  ap.add_argument("--image_size", type=int, default=None,
                  help="export at this resolution (position embedding "
                       "resampled)")
  ap.add_argument("--verify", action="store_true",
                  help="run the artifact in its runtime on random inputs "
                       "(batch 1 and 2) and print its error against JAX")
  return ap


def verify(s: Servable, fmt: str, path: str, *, with_preprocessing=False,
           dtype="float32", batch=None, seed=0) -> float:
  """Largest relative error (max |artifact - JAX| / max |JAX|) of the
  artifact, run by its runtime, against the JAX serving function."""
  import jax  # pylint: disable=import-outside-toplevel

  fn, params = serving_function(s, dtype=dtype,
                                with_preprocessing=with_preprocessing,
                                dynamic_batch=batch is None)
  ref_fn = jax.jit(fn)
  run = load(fmt, path)
  rs = np.random.RandomState(seed)
  worst = 0.0
  for b in ([batch] if batch else [1, 2]):
    if with_preprocessing:
      images = rs.randint(0, 256, (b, s.image_size + 31, s.image_size + 7, 3),
                          dtype=np.uint8)
    else:
      images = rs.standard_normal(
          (b, s.image_size, s.image_size, s.model.num_channels)).astype(
              np.float32)
    ref = np.asarray(ref_fn(params, images))
    got = np.asarray(run(images))
    worst = max(worst, float(np.abs(got - ref).max() / np.abs(ref).max()))
  return worst


def main(argv: Optional[Sequence[str]] = None) -> int:
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  try:  # torchvision before TensorFlow (the other order crashes this stack)
    import torch  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import torchvision  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    pass
  args = _parser().parse_args(argv)
  from vit_jax import inference  # pylint: disable=import-outside-toplevel
  try:
    s = servable(args.checkpoint, model_name=args.model,
                 image_size=args.image_size)
    platforms = tuple(p.strip() for p in args.platforms.split(",") if p.strip())
    out = export(s, args.format, args.out, batch=args.batch, dtype=args.dtype,
                 with_preprocessing=args.with_preprocessing,
                 platforms=platforms)
  except (ExportError, inference.CheckpointError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  spec = input_spec(s, batch=args.batch,
                    with_preprocessing=args.with_preprocessing)
  print(f"wrote {out} ({args.format}, {_size_of(out) / 2 ** 20:.1f} MiB)")
  print(f"  images: {spec.describe()} -> logits: float32 (batch, "
        f"{s.model.num_classes}); computed in {args.dtype}")
  if args.with_preprocessing:
    p = s.preprocessing
    print(f"  preprocessing: resize {p.resize_size}, center crop "
          f"{p.crop_size}, {p.interpolation} (antialiased), mean "
          f"{tuple(round(m, 4) for m in p.mean)}, std "
          f"{tuple(round(v, 4) for v in p.std)}")
  if args.verify:
    err = verify(s, args.format, out, with_preprocessing=args.with_preprocessing,
                 dtype=args.dtype, batch=args.batch)
    print(f"  verify: max relative error against JAX {err:.2e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
