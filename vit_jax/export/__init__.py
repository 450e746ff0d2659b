r"""Deployment artifacts of a ViT: StableHLO, TensorFlow SavedModel, ONNX.

    python -m vit_jax.export --checkpoint vit_b_16.pth --model vit_b_16 \
        --format stablehlo --out vit_b_16.shlo
    python -m vit_jax.export --checkpoint /tmp/digits --format savedmodel \
        --out /tmp/digits_savedmodel --with-preprocessing
    python -m vit_jax.export --checkpoint augreg_Ti_16.npz --format onnx \
        --out ti16.onnx --batch 8

``--checkpoint`` is anything :func:`vit_jax.weights.load` reads. Every
artifact maps images to logits (float32, ``(batch, num_classes)``):

* without ``--with-preprocessing`` it takes what ``model.apply`` takes:
  float32 NHWC images, already resized, cropped and normalised,
  ``(batch, S, S, 3)``;
* with ``--with-preprocessing`` it takes decoded uint8 RGB images
  ``(batch, height, width, 3)`` of any size (one size per call) and does the
  weights' own resize / center crop / normalisation inside
  (:mod:`vit_jax.export.preprocessing`).

The batch dimension is dynamic unless ``--batch`` fixes it. ``--dtype
bfloat16`` computes in bfloat16 (parameters stored in bfloat16); inputs and
logits keep the dtypes above.

Formats, each read by its own runtime:

* ``stablehlo`` (here): one file of ``jax.export`` bytes;
  ``jax.export.deserialize(open(path, 'rb').read()).call(images)`` in any
  JAX program (or :func:`load_stablehlo`, which checks the input first).
* ``savedmodel`` (:mod:`vit_jax.export.savedmodel`): a directory for
  ``tf.saved_model.load`` / TF Serving whose ``serving_default`` signature
  takes ``images`` and returns ``logits``: the same module in TensorFlow's
  ``XlaCallModule`` op (jax2tf's native serialization), rewritten for the
  StableHLO version TensorFlow reads.
* ``onnx`` (:mod:`vit_jax.export.onnx`): one ``.onnx`` file for
  onnxruntime, made from the exact torch twin of the model by
  ``torch.onnx.export``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from typing import Any, Callable, Optional, Sequence

import numpy as np

from vit_jax.export.preprocessing import preprocess, resize_method

FORMATS = ("stablehlo", "savedmodel", "onnx")
DTYPES = ("float32", "bfloat16")


class ExportError(ValueError):
  """A model, option or artifact that cannot be exported or served."""


@dataclasses.dataclass(frozen=True)
class Servable:
  """What goes into an artifact: the three things a loaded checkpoint has."""

  model: Any
  variables: Any
  preprocessing: Any  # vit_jax.convert.Preprocessing, or None
  image_size: int


def servable(checkpoint, *, preprocessing=None,
             model_name: Optional[str] = None,
             image_size: Optional[int] = None) -> Servable:
  """The model, variables and preprocessing to export.

  Args:
    checkpoint: a path (or name) :func:`vit_jax.weights.load` accepts; an
      object with ``.model``, ``.variables`` and ``.preprocessing`` (what
      ``load`` returns); or a tuple ``(model, variables)`` or ``(model,
      variables, preprocessing)``.
    preprocessing: overrides the checkpoint's (a ``Preprocessing``).
    model_name, image_size: passed to ``load`` for a path.
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
  from vit_jax.weights import trees  # pylint: disable=import-outside-toplevel
  size = trees.native_image_size(
      trees.unstack_layers(trees.wrap(variables)), model)
  if size is None:
    raise ExportError("The position embedding is not a square grid, so the "
                      "input size is unknown: set the model's image_size.")
  return int(size)


# --------------------------------------------------------------------------- #
# The exported computation (JAX).
# --------------------------------------------------------------------------- #


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
  from vit_jax.models import kernels  # pylint: disable=import-outside-toplevel

  model = s.model
  tokens = (s.image_size // model.patch_size) ** 2 + model.num_prefix_tokens
  # The CPU attention path splits longer sequences into chunks whose count
  # depends on the batch size; a dynamic batch uses XLA's attention instead
  # (the same function).
  if (dynamic_batch and tokens > kernels.FUSED_ATTENTION_MAX_KEYS and
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
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
        params)
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
    from vit_jax.export import savedmodel as export_tf  # pylint: disable=import-outside-toplevel
    return export_tf.export_savedmodel(s, out, platforms=platforms, **kwargs)
  from vit_jax.export import onnx as export_onnx  # pylint: disable=import-outside-toplevel
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
                  help="anything vit_jax.weights.load reads (a training "
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
                       "(batch 1 and 7) and print its error against JAX")
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
  for b in ([batch] if batch else [1, 7]):
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
  from vit_jax import weights  # pylint: disable=import-outside-toplevel
  try:
    s = servable(args.checkpoint, model_name=args.model,
                 image_size=args.image_size)
    platforms = tuple(p.strip() for p in args.platforms.split(",") if p.strip())
    out = export(s, args.format, args.out, batch=args.batch, dtype=args.dtype,
                 with_preprocessing=args.with_preprocessing,
                 platforms=platforms)
  except (ExportError, weights.CheckpointError, ValueError) as e:
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
    err = verify(s, args.format, out,
                 with_preprocessing=args.with_preprocessing, dtype=args.dtype,
                 batch=args.batch)
    print(f"  verify: max relative error against JAX {err:.2e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
