"""The JAX steps every benchmark times or compiles (one definition).

``train_step`` is forward + softmax cross-entropy + backward + AdamW update,
jitted with the parameters and optimizer state donated (the buffers are
updated in place instead of allocated anew each step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax


def adamw(lr: float = 1e-3, weight_decay: float = 0.05):
  return optax.adamw(lr, weight_decay=weight_decay)


def make_infer_step(model, compiler_options=None):
  return jax.jit(functools.partial(_infer, model),
                 compiler_options=compiler_options)


def _infer(model, variables, images):
  return model.apply(variables, images, train=False)


def make_train_step(model, tx, *, donate: bool = True, compiler_options=None):
  def train_step(params, opt_state, images, labels):
    def loss_fn(p):
      logits = model.apply({"params": p}, images, train=True)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), labels).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(train_step, donate_argnums=(0, 1) if donate else (),
                 compiler_options=compiler_options)


def abstract_train_args(model, tx, batch: int, image_size: int):
  """ShapeDtypeStructs of (params, opt_state, images, labels): enough to
  lower and compile the train step without allocating the model."""
  from vit_jax import models  # pylint: disable=import-outside-toplevel
  params = jax.eval_shape(
      lambda: models.init_params(model, image_size))["params"]
  opt_state = jax.eval_shape(tx.init, params)
  images = jax.ShapeDtypeStruct((batch, image_size, image_size, 3),
                                jnp.float32)
  labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
  return params, opt_state, images, labels


def peak_bytes(compiled) -> dict:
  """XLA's buffer assignment for a compiled step: arguments, outputs,
  temporaries, and the peak estimate arguments + outputs - aliased + temp
  (donated inputs alias outputs, so they count once)."""
  m = compiled.memory_analysis()
  d = {k: int(getattr(m, k + "_size_in_bytes"))
       for k in ("argument", "output", "alias", "temp")}
  d["peak"] = d["argument"] + d["output"] - d["alias"] + d["temp"]
  return d
