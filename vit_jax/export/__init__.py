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

A NaFlex model (SigLIP 2 NaFlex, timm's ``naflexvit_*``) takes the NaFlex
dict instead (``patches`` float32 (batch, seq_len, P*P*3), ``patch_coord``
int32 (batch, seq_len, 2), ``patch_valid`` bool (batch, seq_len);
:func:`vit_jax.data.naflex.batch_images` makes it from images of any
shape), as StableHLO, with a symbolic sequence length unless ``--seq-len``
fixes it: one artifact runs every length.

A model without a classification head (SAM's released image encoders,
self-supervised backbones), or any model with ``--output features``, is
exported as a feature extractor: its artifact returns ``forward_features``
(float32; the tokens after the final norm, ``(batch, prefix + N, D)``, or
SAM's neck's ``(batch, h, w, C)`` map) under the name ``features``.

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

import dataclasses
import os
import tempfile
from typing import Callable, Optional, Sequence

import numpy as np

from vit_jax.export import base, stablehlo
from vit_jax.export.base import (  # noqa: F401  (public names)
    Servable, exported, input_spec, output_shape, servable, serving_function)
from vit_jax.export.stablehlo import (  # noqa: F401
    StableHLOArtifact, export_stablehlo, load_stablehlo)
from vit_jax.export.types import (  # noqa: F401
    DTYPES, FORMATS, OUTPUTS, ExportError, InputSpec, NaFlexInputSpec)
from vit_jax.weights import trees


def export(checkpoint, fmt: str, out: str, *, batch: Optional[int] = None,
           dtype: str = "float32", with_preprocessing: bool = False,
           platforms: Sequence[str] = ("cpu",),
           model_name: Optional[str] = None,
           image_size: Optional[int] = None, preprocessing=None,
           seq_len: Optional[int] = None, output: Optional[str] = None) -> str:
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
    model_name, image_size, preprocessing, output: see :func:`servable`
      (``output`` for a path or loaded checkpoint; a :class:`Servable`
      keeps its own).
    seq_len: a NaFlex model's fixed sequence length; ``None`` (default):
      symbolic (StableHLO only).
  """
  if fmt not in FORMATS:
    raise ExportError(f"format {fmt!r}: expected one of {FORMATS}")
  if dtype not in DTYPES:
    raise ExportError(f"dtype {dtype!r}: expected one of {DTYPES}")
  if isinstance(checkpoint, Servable):
    s = checkpoint
    if output is not None and output != s.output:
      s = dataclasses.replace(s, output=output)
  else:
    s = base.servable(checkpoint, preprocessing=preprocessing,
                      model_name=model_name, image_size=image_size,
                      output=output)
  kwargs = dict(batch=batch, dtype=dtype, with_preprocessing=with_preprocessing)
  if base.is_naflex(s.model) and fmt != "stablehlo":
    raise ExportError(
        f"format {fmt!r}: a NaFlex model (a NaFlex dict in, its sequence "
        f"length symbolic) is exported as 'stablehlo'.")
  out = os.fspath(out)
  parent = os.path.dirname(os.path.abspath(out))
  os.makedirs(parent, exist_ok=True)
  if fmt == "stablehlo":
    if base.is_naflex(s.model):
      kwargs["seq_len"] = seq_len
    return stablehlo.export_stablehlo(s, out, platforms=platforms, **kwargs)
  if fmt == "savedmodel":
    from vit_jax.export import savedmodel as export_tf  # pylint: disable=import-outside-toplevel
    return export_tf.export_savedmodel(s, out, platforms=platforms, **kwargs)
  from vit_jax.export import onnx as export_onnx  # pylint: disable=import-outside-toplevel
  return export_onnx.export_onnx(s, out, **kwargs)


def load(fmt: str, path: str) -> Callable:
  """An artifact run by its own runtime, as ``images (numpy) -> logits
  (numpy)`` (or features: its one output): ``jax.export``,
  ``tf.saved_model.load`` or onnxruntime."""
  if fmt == "stablehlo":
    art = load_stablehlo(path)
    return lambda images: np.asarray(art(images))
  if fmt == "savedmodel":
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    serve = tf.saved_model.load(path).signatures["serving_default"]
    name, = serve.structured_outputs
    return lambda images: serve(images=tf.constant(images))[name].numpy()
  if fmt == "onnx":
    import onnxruntime as ort  # pylint: disable=import-outside-toplevel
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = sess.get_outputs()[0].name
    return lambda images: sess.run([name], {"images": images})[0]
  raise ExportError(f"format {fmt!r}: expected one of {FORMATS}")


@dataclasses.dataclass(frozen=True)
class Verified:
  """What :func:`verify` found: the largest relative error of the artifact
  against JAX, and what was compared (``note`` says when it was not the
  artifact itself)."""

  max_rel_err: float
  note: str = ""

  def __float__(self):
    return self.max_rel_err


def verify(s: Servable, fmt: str, path: str, *, with_preprocessing=False,
           dtype="float32", batch=None, seed=0, seq_lens=None) -> Verified:
  """Largest relative error (max |artifact - JAX| / max |JAX|) of the
  artifact, run by its runtime, against the JAX serving function, on random
  inputs (batch 1 and 7, or ``batch``). A NaFlex artifact: NaFlex batches
  of random images of different shapes at two sequence lengths
  (``seq_lens``, default (32, 77); the artifact's own if it fixed one),
  the same symbolic program for both.

  It cannot pass for want of a signal: a head whose kernel is all zero (a
  fresh head) gives every image the same logits, which say nothing about
  the rest of the network. Then a copy of the model with a random head is
  exported the same way and checked instead, and the result says so."""
  head = trees.params_of(trees.unstack_layers(trees.wrap(s.variables))).get(
      "head", {}).get("kernel")
  if base.is_naflex(s.model):
    spec = load_stablehlo(path).spec
    lens = ((spec.seq_len,) if spec.seq_len is not None else
            tuple(seq_lens or (32, 77)))
  else:
    lens, spec = None, None
  if head is None or s.output != "logits" or np.any(np.asarray(head)):
    return Verified(_max_rel_err(s, fmt, path, with_preprocessing, dtype,
                                 batch, seed, lens))
  probe = _with_random_head(s, seed)
  suffix = {"stablehlo": ".shlo", "onnx": ".onnx"}.get(fmt, "")
  with tempfile.TemporaryDirectory(prefix="vit_jax_verify_") as d:
    out = export(probe, fmt, os.path.join(d, "random_head" + suffix),
                 batch=batch, dtype=dtype,
                 with_preprocessing=with_preprocessing,
                 seq_len=spec.seq_len if spec is not None else None)
    err = _max_rel_err(probe, fmt, out, with_preprocessing, dtype, batch,
                       seed, lens)
  return Verified(err, "the model's head is all zero (a fresh head: every "
                  "image gets the same logits, which cannot show an error), "
                  "so a copy with a random head was exported the same way "
                  "and checked instead")


def _with_random_head(s: Servable, seed: int) -> Servable:
  variables = trees.wrap(trees.unstack_layers(trees.wrap(s.variables)))
  params = dict(variables["params"])
  kernel = np.asarray(params["head"]["kernel"])
  rng = np.random.default_rng(seed)
  params["head"] = dict(params["head"], kernel=(
      rng.standard_normal(kernel.shape) / np.sqrt(kernel.shape[0])).astype(
          kernel.dtype))
  model = s.model.clone(scan_layers=False)
  return dataclasses.replace(s, model=model,
                             variables=dict(variables, params=params))


def _naflex_inputs(s: Servable, b: int, seq_len: int, rs):
  """A NaFlex batch of ``b`` random images of random shapes (each within
  ``seq_len`` patches), padded to ``seq_len``."""
  from vit_jax.data import naflex  # pylint: disable=import-outside-toplevel
  p, c = s.model.patch_size, s.model.num_channels
  samples = []
  for _ in range(b):
    gh = rs.randint(1, seq_len + 1)
    gw = rs.randint(1, seq_len // gh + 1)
    x = rs.standard_normal((gh * p, gw * p, c)).astype(np.float32)
    samples.append(dict(zip(naflex.KEYS, naflex.patchify(x, p))))
  return naflex.collate(samples, seq_len)


def _max_rel_err(s, fmt, path, with_preprocessing, dtype, batch, seed,
                 seq_lens=None) -> float:
  import jax  # pylint: disable=import-outside-toplevel

  fn, params = base.serving_function(s, dtype=dtype,
                                     with_preprocessing=with_preprocessing,
                                     dynamic_batch=batch is None)
  ref_fn = jax.jit(fn)
  run = load(fmt, path)
  rs = np.random.RandomState(seed)
  worst = 0.0
  cases = [(b, None) for b in ([batch] if batch else [1, 7])]
  if seq_lens:  # NaFlex: each length, a batch size each
    sizes = [batch or (1, 3)[i % 2] for i in range(len(seq_lens))]
    cases = list(zip(sizes, seq_lens))
  for b, seq_len in cases:
    if seq_len is not None:
      images = _naflex_inputs(s, b, int(seq_len), rs)
    elif with_preprocessing:
      images = rs.randint(0, 256, (b, s.image_size + 31, s.image_size + 7, 3),
                          dtype=np.uint8)
    else:
      images = rs.standard_normal(
          (b, s.image_size, s.image_size, s.model.num_channels)).astype(
              np.float32)
    ref = np.asarray(ref_fn(params, images), np.float64)
    got = np.asarray(run(images), np.float64)
    scale = np.abs(ref).max()
    if not scale > 0:
      raise ExportError(f"verify: the JAX {s.output} are all zero, so no "
                        f"relative error can be measured.")
    worst = max(worst, float(np.abs(got - ref).max() / scale))
  return worst
