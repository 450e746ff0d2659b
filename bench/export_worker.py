"""Benchmark child for a deployment runtime (``bench/export.py``).

Started by :mod:`bench.worker` for the frameworks ``stablehlo``,
``savedmodel`` and ``onnxruntime``, which hands over its ``_serve`` (the
protocol) and ``_inputs`` (the same images as every contestant). Setup,
untimed: read the torch worker's weights, build the model
(``convert.from_torchvision``), export it with :func:`vit_jax.export.export`
(dynamic batch) into ``artifact_dir`` (``bench/export.py``'s, shared by
the batch sizes of one run: a later batch size loads the artifact made for
the first, keyed by format and weights) or a temporary directory, load the
artifact with its own runtime. A timed step is one call of the artifact on
the batch, with the input already in the runtime's own array type and the
result waited for.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time

import numpy as np

from bench import mlas_isa

FORMATS = {"stablehlo": "stablehlo", "savedmodel": "savedmodel",
           "onnxruntime": "onnx"}
SUFFIX = {"stablehlo": ".shlo", "savedmodel": "", "onnx": ".onnx"}


def _runner(fmt: str, path: str, images: np.ndarray):
  """(step, info): one synchronous call of the artifact on ``images``."""
  if fmt == "stablehlo":
    import jax  # pylint: disable=import-outside-toplevel
    from bench import ynnpack_isa  # pylint: disable=import-outside-toplevel
    from vit_jax import export  # pylint: disable=import-outside-toplevel
    ynnpack_isa.apply_from_environment()  # --isa avx2
    art = export.load_stablehlo(path)
    x = jax.device_put(images)
    return (lambda: art(x).block_until_ready()), {"jax": jax.__version__}
  if fmt == "savedmodel":
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    serve = tf.saved_model.load(path).signatures["serving_default"]
    x = tf.constant(images)
    return (lambda: serve(images=x)["logits"].numpy()), {
        "tensorflow": tf.__version__}
  import onnxruntime as ort  # pylint: disable=import-outside-toplevel
  capped = os.path.join("mlas_avx2", "")
  if os.environ.get(mlas_isa.ENV) and capped not in ort.__file__:
    raise RuntimeError(f"--isa avx2: onnxruntime was imported from "
                       f"{ort.__file__}, not from the capped copy")
  sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
  return (lambda: sess.run(["logits"], {"images": images})[0]), {
      "onnxruntime": ort.__version__ + (
          " (MLAS capped at AVX2)" if capped in ort.__file__ else ""),
      "intra_op_threads": sess.get_session_options().intra_op_num_threads}


def _export_jax2onnx(model, variables, path):
  """The same serving function through jax2onnx (for the comparison of ONNX
  routes only: jax2onnx's pins conflict with ours, see bench/README.md)."""
  from jax2onnx import to_onnx  # pylint: disable=import-outside-toplevel
  from vit_jax import export  # pylint: disable=import-outside-toplevel

  s = export.servable((model, variables))
  fn, params = export.serving_function(s)
  size = s.image_size
  to_onnx(lambda x: fn(params, x), [("B", size, size, 3)],
          input_names=["images"], output_names=["logits"],
          return_mode="file", output_path=path)


def runtime_main(framework: str, spec, serve, inputs):
  t0 = time.perf_counter()
  if framework == "onnxruntime":  # the exporter needs torchvision
    mlas_isa.apply_from_environment()  # --isa avx2, before any import of it
    import torch  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import torchvision  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  from vit_jax import convert, export  # pylint: disable=import-outside-toplevel

  fmt = FORMATS[framework]
  route = spec.get("onnx_route") or "default"
  cache = spec.get("artifact_dir")
  if cache:  # one artifact per (format, route, weights), for every batch
    with open(spec["weights_in"], "rb") as f:
      digest = hashlib.sha256(f.read()).hexdigest()[:16]
    folder = os.path.join(cache, f"{fmt}-{route}-{digest}")
  else:
    folder = tempfile.mkdtemp(prefix=f"vit_bench_{fmt}_")
  name = "artifact" + SUFFIX[fmt]
  path = os.path.join(folder, name)
  reused = os.path.exists(path)
  export_s = 0.0
  if not reused:
    with np.load(spec["weights_in"]) as f:
      state_dict = {k: f[k] for k in f.files}
    model, variables = convert.from_torchvision(state_dict, spec["name"])
    # Written into a folder of its own and renamed whole (with any side
    # files the format writes), so a later batch size never finds half an
    # artifact.
    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    t = time.perf_counter()
    if route == "jax2onnx":
      _export_jax2onnx(model, variables, os.path.join(partial, name))
    else:
      export.export((model, variables), fmt, os.path.join(partial, name))
    export_s = time.perf_counter() - t
    if os.path.isdir(folder):  # mkdtemp's empty folder
      os.rmdir(folder)
    os.rename(partial, folder)
  images, _ = inputs(spec)
  step, info = _runner(fmt, path, images)
  setup_s = time.perf_counter() - t0
  t = time.perf_counter()
  check = np.asarray(step(), np.float32)  # first call: compiles / plans
  first_s = time.perf_counter() - t
  for _ in range(spec["warmup"]):
    step()
  check = np.asarray(check, np.float64).ravel()[:spec["check_size"]].tolist()
  info.update(export_s=export_s, first_call_s=first_s, artifact_reused=reused)
  serve(step, check, info, setup_s, first_s)
