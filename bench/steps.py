"""The JAX steps every benchmark times or compiles (one definition).

``infer``: ``model.apply``; ``train``: forward + softmax cross-entropy +
backward + AdamW update, jitted with the parameters and optimizer state
donated (updated in place instead of allocated anew each step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax


def adamw(lr: float = 1e-3, weight_decay: float = 0.05):
  return optax.adamw(lr, weight_decay=weight_decay)


def _infer(model, variables, images):
  return model.apply(variables, images, train=False)


def lower(model, mode: str, variables, x, y, tx=None, *, donate=True,
          compiler_options=None):
  """The ``mode`` step lowered on the shapes of ``variables`` (arrays or
  ``jax.ShapeDtypeStruct``s) and the batch ``x``, ``y``."""
  if mode == "infer":
    return jax.jit(functools.partial(_infer, model),
                   compiler_options=compiler_options).lower(variables, x)

  def train_step(params, opt_state, images, labels):
    def loss_fn(p):
      logits = model.apply({"params": p}, images, train=True)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), labels).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  p = variables["params"]
  return jax.jit(train_step, donate_argnums=(0, 1) if donate else (),
                 compiler_options=compiler_options).lower(
                     p, jax.eval_shape(tx.init, p), x, y)


def runner(compiled, mode: str, variables, x, y, tx=None):
  """One synchronous step of ``compiled`` per call on its own state, updated
  in place; returns the logits or the loss."""
  if mode == "infer":
    return lambda: compiled(variables, x).block_until_ready()
  state = [variables["params"], tx.init(variables["params"])]

  def run():
    state[0], state[1], loss = compiled(state[0], state[1], x, y)
    jax.block_until_ready(state)
    return loss.block_until_ready()
  return run


def perturbed(variables, seed: int = 0):
  """Every parameter plus 0.02 * N(0, 1) (seeded), so that every one matters
  (a zero head would make every loss log(classes))."""
  rs = np.random.RandomState(seed)
  return jax.tree_util.tree_map(lambda x: np.asarray(x) + 0.02 * (
      rs.standard_normal(np.shape(x)).astype(np.float32)), variables)


def peak_bytes(compiled) -> dict:
  """XLA's buffer assignment for a compiled step: arguments, outputs,
  temporaries, and the peak estimate arguments + outputs - aliased + temp
  (donated inputs alias outputs, so they count once)."""
  m = compiled.memory_analysis()
  d = {k: int(getattr(m, k + "_size_in_bytes"))
       for k in ("argument", "output", "alias", "temp")}
  d["peak"] = d["argument"] + d["output"] - d["alias"] + d["temp"]
  return d
