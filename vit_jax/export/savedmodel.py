"""TensorFlow SavedModel of an exported ViT (``vit_jax.export``'s
``savedmodel`` format): jax2tf's native serialization.

The ``jax.export`` module of the serving function runs in TensorFlow's
``XlaCallModule`` op, inside a ``tf.function`` whose ``serving_default``
signature takes ``images`` and returns ``{"logits": ...}`` (a feature
extractor's: ``{"features": ...}``); the parameters
are TF variables (SavedModel's ``variables/``, no 2 GB graph limit).

Why not plain ``jax2tf.convert``: TensorFlow 2.21 fails to run its output
("unregistered operation 'vhlo.composite_v2'", "failed to deserialize
portable artifact using StableHLO_v1.13.7"). JAX 0.10.2 serializes for
StableHLO 1.15 and wraps ``lax.erf`` (our exact GELU) in a
``stablehlo.composite``; TensorFlow reads 1.13.7. Serializing for 1.13.7
alone makes it load and run with a fixed batch, but a dynamic batch then
fails ("'stablehlo.clamp' op has dynamic shapes"): TensorFlow's shape
refinement does not enter composites. :func:`for_tensorflow` therefore
replaces every composite by a call of its own decomposition (the ops XLA
runs for it anyway: the numbers do not change) and serializes the module for
the installed TensorFlow's StableHLO version. The model's own (non-export)
numerics are untouched.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from vit_jax.export import base


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


def export_savedmodel(s, out: str, *, batch=None, dtype="float32",
                      with_preprocessing=False, platforms=("cpu",)) -> str:
  """Writes the SavedModel of the servable ``s`` (see the module docstring)."""
  import jax  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from jax.experimental.jax2tf import jax2tf  # pylint: disable=import-outside-toplevel

  exp, params = base.exported(
      s, batch=batch, dtype=dtype, with_preprocessing=with_preprocessing,
      platforms=platforms, params_as_arguments=True)
  exp = for_tensorflow(exp)
  spec = base.input_spec(s, batch=batch,
                               with_preprocessing=with_preprocessing)
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
    out, = jax2tf._run_exported_as_tf([*module.params, images], exp)
    return {s.output: out}

  module.serve = serve
  tf.saved_model.save(module, out, signatures={"serving_default": serve})
  return out
