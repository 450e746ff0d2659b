"""The train state and the jitted steps: init, train, eval; the eval loop.

One ``jax.jit`` program per step over the mesh (:mod:`vit_jax.train.sharding`),
with explicit in/out shardings and the state donated. No ``pmap``.

The train state carries running sums of the loss since the last log event
(``acc``), so a resumed run reports exactly the numbers of an uninterrupted
one and a non-finite loss anywhere in a window is never missed.

The jitted train step also takes every process's SIGTERM vote (one int per
device) and returns their maximum, replicated: the processes learn about a
preemption notice through the step's own all-reduce, so they all stop after
the same step (:mod:`vit_jax.train.multihost`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Iterable

import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from vit_jax.train import sharding as sharding_lib

EVAL_SUMS = ("loss", "correct", "correct5", "count")


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps done
  params: Any
  batch_stats: Any  # {} unless the model has BatchNorm (conv stem)
  opt_state: Any
  acc: Dict[str, jax.Array]  # running sums since the last log event

  def items(self) -> Dict[str, Any]:
    """The checkpoint items (see :mod:`vit_jax.train.checkpoint`)."""
    variables = {"params": self.params}
    if self.batch_stats:
      variables["batch_stats"] = self.batch_stats
    return {"variables": variables,
            "train": {"step": self.step, "opt_state": self.opt_state,
                      "acc": self.acc}}

  @classmethod
  def from_items(cls, items) -> "TrainState":
    v, t = items["variables"], items["train"]
    return cls(step=t["step"], params=v["params"],
               batch_stats=v.get("batch_stats", {}), opt_state=t["opt_state"],
               acc=t["acc"])


def zero_acc() -> Dict[str, jax.Array]:
  return {"loss_sum": jnp.zeros((), jnp.float32),
          "grad_norm_sum": jnp.zeros((), jnp.float32),
          "count": jnp.zeros((), jnp.int32),
          "nonfinite": jnp.zeros((), jnp.int32)}


def reset_acc(state: TrainState) -> TrainState:
  return state.replace(acc=jax.tree_util.tree_map(jnp.zeros_like, state.acc))


def make_init_fn(model, tx, image_size: int):
  """rng or host variables -> TrainState (run under jit with out_shardings)."""
  def from_variables(variables):
    params = variables["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      batch_stats=variables.get("batch_stats", {}),
                      opt_state=tx.init(params), acc=zero_acc())

  def from_rng(rng):
    x = jnp.zeros((1, image_size, image_size, model.num_channels), jnp.float32)
    variables = model.init({"params": rng}, x, train=False)
    return from_variables(flax.core.unfreeze(variables))
  return from_rng, from_variables


def abstract_train_state(model, tx, image_size: int):
  from_rng, _ = make_init_fn(model, tx, image_size)
  return jax.eval_shape(from_rng, jax.random.key(0))


def num_params(abstract_state) -> int:
  return int(sum(math.prod(x.shape) for x in
                 jax.tree_util.tree_leaves(abstract_state.params)))


def normalize_images(images, mean=None, std=None):
  """The model's input from a batch's images, on the device.

  uint8 images (the input pipeline's, :mod:`vit_jax.data.batches`) are
  pixels: ``(x / 255 - mean) / std`` per channel in float32, the same numbers
  as the host's normalisation (``vit_jax.data.transforms._normalize``). Floating-point
  images are taken as already normalised and returned as they are.

  Raises:
    ValueError: uint8 images without ``mean`` and ``std``.
  """
  if images.dtype != jnp.uint8:
    return images
  if mean is None or std is None:
    raise ValueError("uint8 images need the normalisation's mean and std "
                     "(3 floats each, [0, 1] pixel units): pass mean= and "
                     "std= when making the step.")
  x = images.astype(jnp.float32) / 255.0
  return ((x - jnp.asarray(mean, jnp.float32)) /
          jnp.asarray(std, jnp.float32))


def model_inputs(batch, mean=None, std=None):
  """The model's input from a batch: its normalised images
  (:func:`normalize_images`), or for a NaFlex batch (``patches``,
  ``patch_coord``, ``patch_valid``) the dict with its uint8 patches
  normalised per channel (each patch is (y, x, channel) pixels)."""
  if "patches" not in batch:
    return normalize_images(batch["image"], mean, std)
  p = batch["patches"]
  if p.dtype == jnp.uint8:
    b, n, k = p.shape
    p = normalize_images(p.reshape(b, n, k // 3, 3), mean, std).reshape(
        b, n, k)
  return {"patches": p, "patch_coord": batch["patch_coord"],
          "patch_valid": batch["patch_valid"]}


def make_train_step(model, tx, *, num_classes: int, seed: int,
                    label_smoothing: float = 0.0, mixup_alpha: float = 0.0,
                    grad_accum_steps: int = 1, micro_sharding=None,
                    mean=None, std=None):
  """The (unjitted) train step: state, batch -> state.

  Dropout/mixup rngs are ``fold_in(key(seed), step)``: a function of the
  step, so a resumed run draws the same numbers. uint8 images are
  normalised with ``mean``/``std`` in the step (:func:`normalize_images`).
  """
  accum = int(grad_accum_steps)

  def loss_fn(params, batch_stats, images, labels, rng):
    variables = {"params": params}
    if batch_stats:
      variables["batch_stats"] = batch_stats
      logits, upd = model.apply(variables, images, train=True,
                                rngs={"dropout": rng}, mutable=["batch_stats"])
      batch_stats = upd["batch_stats"]
    else:
      logits = model.apply(variables, images, train=True,
                           rngs={"dropout": rng})
    loss = optax.softmax_cross_entropy(logits.astype(jnp.float32), labels)
    return loss.mean(), batch_stats

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step_fn(state: TrainState, batch):
    rng = jax.random.fold_in(jax.random.key(seed), state.step)
    rng, mix_rng = jax.random.split(rng)
    images = model_inputs(batch, mean, std)
    labels = jax.nn.one_hot(batch["label"], num_classes, dtype=jnp.float32)
    if label_smoothing:
      labels = optax.smooth_labels(labels, label_smoothing)
    if mixup_alpha:
      lam = jax.random.beta(mix_rng, mixup_alpha, mixup_alpha)
      images = lam * images + (1 - lam) * jnp.roll(images, 1, axis=0)
      labels = lam * labels + (1 - lam) * jnp.roll(labels, 1, axis=0)

    if accum == 1:
      (loss, batch_stats), grads = grad_fn(state.params, state.batch_stats,
                                           images, labels, rng)
    else:
      def micro(x):  # (B, ...) -> (accum, B/accum, ...), every device busy
        x = x.reshape((x.shape[0] // accum, accum) + x.shape[1:])
        x = jnp.swapaxes(x, 0, 1)
        if micro_sharding is not None:
          x = jax.lax.with_sharding_constraint(x, micro_sharding)
        return x

      def body(carry, xs):
        g_sum, l_sum, bs = carry
        im, lb, i = xs
        (l, bs), g = grad_fn(state.params, bs, im, lb, jax.random.fold_in(rng, i))
        return (jax.tree_util.tree_map(jnp.add, g_sum, g), l_sum + l, bs), None

      zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
      (grads, loss, batch_stats), _ = jax.lax.scan(
          body, (zeros, jnp.zeros((), jnp.float32), state.batch_stats),
          (jax.tree_util.tree_map(micro, images), micro(labels),
           jnp.arange(accum)))
      grads = jax.tree_util.tree_map(lambda g: g / accum, grads)
      loss = loss / accum

    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    acc = {"loss_sum": state.acc["loss_sum"] + loss,
           "grad_norm_sum": state.acc["grad_norm_sum"] + grad_norm,
           "count": state.acc["count"] + 1,
           "nonfinite": state.acc["nonfinite"] + (~finite).astype(jnp.int32)}
    return state.replace(step=state.step + 1, params=params,
                         batch_stats=batch_stats, opt_state=opt_state, acc=acc)

  return step_fn


def make_eval_step(model, num_classes: int, mean=None, std=None):
  """params, batch_stats, batch -> summed metrics of the masked batch
  (uint8 images normalised with ``mean``/``std``: :func:`normalize_images`)."""
  k = min(5, num_classes)

  def eval_fn(params, batch_stats, batch):
    variables = {"params": params}
    if batch_stats:
      variables["batch_stats"] = batch_stats
    logits = model.apply(variables, model_inputs(batch, mean, std),
                         train=False)
    logits = logits.astype(jnp.float32)
    labels, mask = batch["label"], batch["mask"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    top1 = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    _, topk = jax.lax.top_k(logits, k)
    in_topk = jnp.any(topk == labels[:, None], axis=-1).astype(jnp.float32)
    return {"loss": jnp.sum(loss * mask), "correct": jnp.sum(top1 * mask),
            "correct5": jnp.sum(in_topk * mask), "count": jnp.sum(mask)}

  return eval_fn


def evaluate(eval_step, params, batch_stats,
             batches: Iterable[Any]) -> Dict[str, float]:
  """The eval loop (training's periodic eval and ``vit_jax.evaluate``).

  Args:
    eval_step: a jitted :func:`make_eval_step`.
    params: the model's parameters.
    batch_stats: its BatchNorm statistics (``{}`` if none).
    batches: eval batches with ``image``, ``label`` and ``mask`` (global
      arrays, or numpy for a single device); padding examples have
      ``mask == 0``.

  Returns:
    Sums over every real example: ``loss`` (cross-entropy), ``correct``
    (top-1), ``correct5`` (top-5, or top-``num_classes``) and ``count``.
  """
  sums = [eval_step(params, batch_stats, b) for b in batches]
  total = dict.fromkeys(EVAL_SUMS, 0.0)
  for s in sharding_lib.to_host(sums):
    for k in total:
      total[k] += float(s[k])
  return total


def _vote(step):
  """Wraps the train step: also the maximum of every device's vote."""
  def step_and_vote(state, batch, votes):
    return step(state, batch), jnp.max(votes)
  return step_and_vote


@dataclasses.dataclass
class Compiled:
  """The jitted functions of one run, bound to its mesh and shardings.

  ``train_step(state, batch, votes) -> (state, max(votes))``: ``votes`` has
  one int32 per device, sharded like the batch
  (:meth:`vit_jax.train.multihost.Preemption.votes`).
  """

  init_from_rng: Any
  init_from_variables: Any
  train_step: Any
  eval_step: Any
  reset_acc: Any


def compile_steps(model, tx, config, mesh: Mesh, abstract_state,
                  shardings, num_classes: int, mean=None,
                  std=None) -> Compiled:
  """jit with explicit shardings and the state donated; uint8 batches are
  normalised with ``mean``/``std`` inside the train and eval steps."""
  from_rng, from_variables = make_init_fn(model, tx, config.image_size)
  data = sharding_lib.batch_sharding(mesh)
  micro = sharding_lib.batch_sharding(mesh, extra_leading=1)
  repl = sharding_lib.replicated(mesh)
  step = make_train_step(
      model, tx, num_classes=num_classes, seed=int(config.seed),
      label_smoothing=float(config.label_smoothing),
      mixup_alpha=float(config.pp.mixup_alpha),
      grad_accum_steps=int(config.grad_accum_steps), micro_sharding=micro,
      mean=mean, std=std)
  eval_fn = make_eval_step(model, num_classes, mean=mean, std=std)
  var_sh = {"params": shardings.params}
  if abstract_state.batch_stats:
    var_sh["batch_stats"] = shardings.batch_stats
  return Compiled(
      init_from_rng=jax.jit(from_rng, out_shardings=shardings),
      init_from_variables=jax.jit(from_variables, in_shardings=(var_sh,),
                                  out_shardings=shardings),
      train_step=jax.jit(_vote(step), in_shardings=(shardings, data, data),
                         out_shardings=(shardings, repl), donate_argnums=(0,)),
      eval_step=jax.jit(eval_fn, in_shardings=(shardings.params,
                                               shardings.batch_stats, data),
                        out_shardings=repl),
      reset_acc=jax.jit(reset_acc, in_shardings=(shardings,),
                        out_shardings=shardings, donate_argnums=(0,)),
  )
