"""Training: mesh and shardings, train state, jitted train/eval steps.

One ``jax.jit`` program per step over a ``Mesh`` of all devices (axes
``('data',)``, or ``('data', 'fsdp')`` when parameters and optimizer state are
sharded), ``NamedSharding`` for the batch and the state, and the state donated
(``donate_argnums``). No ``pmap``. The loop itself is in
:mod:`vit_jax.train_loop`; :func:`train_and_evaluate` is re-exported here.

Fine-tuning from torchvision weights imports torch and torchvision; in one
process they must be imported *before* TensorFlow (tf.data), as ``train.py``
does: importing torchvision's triton after TensorFlow crashes the process.

The train state carries running sums of the loss since the last log event
(``acc``), so a resumed run reports exactly the numbers of an uninterrupted
one and a non-finite loss anywhere in a window is never missed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import urllib.parse
from typing import Any, Dict, Optional, Sequence, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from vit_jax import convert, models

_ARCH_FIELDS = ("hidden_size", "num_layers", "num_heads", "mlp_dim",
                "patch_size")


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps done
  params: Any
  batch_stats: Any  # {} unless the model has BatchNorm (conv stem)
  opt_state: Any
  acc: Dict[str, jax.Array]  # running sums since the last log event

  def items(self) -> Dict[str, Any]:
    """The checkpoint items (see :mod:`vit_jax.checkpoint`)."""
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


# --------------------------------------------------------------------------- #
# Mesh and shardings.
# --------------------------------------------------------------------------- #


def make_mesh(devices: Optional[Sequence[Any]] = None, fsdp: int = 1) -> Mesh:
  """All devices as ``('data',)``, or ``('data', 'fsdp')`` for ``fsdp > 1``
  (``-1``: the fsdp axis spans every device)."""
  devices = list(devices if devices is not None else jax.devices())
  n = len(devices)
  f = n if fsdp == -1 else int(fsdp)
  if f < 1 or n % f:
    raise ValueError(f"config.fsdp={fsdp} must divide the number of devices "
                     f"({n}), or be -1 (all devices) / 1 (data parallel).")
  arr = np.array(devices, dtype=object)
  if f == 1:
    return Mesh(arr, ("data",))
  return Mesh(arr.reshape(n // f, f), ("data", "fsdp"))


def batch_sharding(mesh: Mesh, extra_leading: int = 0) -> NamedSharding:
  """Leading (batch) axis split over every mesh axis."""
  return NamedSharding(mesh, P(*([None] * extra_leading), mesh.axis_names))


def _fsdp_spec(shape: Tuple[int, ...], size: int) -> P:
  """Shards the largest axis divisible by the fsdp size; else replicated."""
  if size <= 1 or not shape:
    return P()
  for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
    if shape[i] % size == 0:
      spec = [None] * len(shape)
      spec[i] = "fsdp"
      return P(*spec)
  return P()


def state_shardings(abstract_state, mesh: Mesh):
  """NamedShardings for every leaf of the state: replicated for data
  parallelism; parameters and optimizer state split over ``fsdp``."""
  size = mesh.shape.get("fsdp", 1)
  return jax.tree_util.tree_map(
      lambda x: NamedSharding(mesh, _fsdp_spec(tuple(x.shape), size)),
      abstract_state)


def global_batch(local: Dict[str, np.ndarray], sharding: NamedSharding):
  """Process-local numpy batch -> global sharded ``jax.Array`` batch."""
  return jax.make_array_from_process_local_data(sharding, local)


def put_global(tree, shardings):
  """Host numpy tree (identical on all processes) -> global arrays."""
  def put(x, s):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])
  return jax.tree_util.tree_map(put, tree, shardings)


# --------------------------------------------------------------------------- #
# Model and initial weights.
# --------------------------------------------------------------------------- #


def model_kwargs(config, num_classes: int) -> Dict[str, Any]:
  """JSON-able keyword arguments of ``models.get_model`` for this config."""
  kw = dict(config.model.to_dict())
  kw["num_classes"] = int(num_classes)
  kw["remat_policy"] = kw.get("remat_policy") or None
  for k in ("dtype", "param_dtype"):
    if k in kw:
      try:
        kw[k] = jnp.dtype(kw[k]).name
      except TypeError:
        raise ValueError(f"config.model.{k}={kw[k]!r} is not a dtype "
                         f"(expected e.g. 'float32' or 'bfloat16').") from None
  return kw


def build_model(model_name: str, kwargs: Dict[str, Any]) -> models.VisionTransformer:
  kw = dict(kwargs)
  for k in ("dtype", "param_dtype"):
    if k in kw:
      kw[k] = jnp.dtype(kw[k])
  return models.get_model(model_name, **kw)


def _torchvision_state_dict(model_name: str, weights: str):
  """State dict + (mean, std) for ``weights`` (a .pth path or torchvision
  name); fails fast offline when the named weights are not cached."""
  is_file = (os.path.sep in weights or os.path.exists(weights) or
             weights.endswith((".pth", ".pt")))
  if is_file:
    if not os.path.isfile(weights):
      raise FileNotFoundError(
          f"config.init_weights={weights!r}: no such file. Expected a "
          f"torchvision {model_name} state dict saved with torch.save(), or a "
          f"torchvision weights name such as 'IMAGENET1K_V1'.")
    return weights
  import torch  # pylint: disable=import-outside-toplevel
  import torchvision  # pylint: disable=import-outside-toplevel
  enum_name = model_name.upper().replace("VIT_", "ViT_") + "_Weights"
  try:
    enum = torchvision.models.get_weight(f"{enum_name}.{weights}")
  except (ValueError, KeyError, AttributeError):
    raise ValueError(
        f"config.init_weights={weights!r}: torchvision has no such weights "
        f"for {model_name}. Use a name like 'IMAGENET1K_V1', a path to a "
        f".pth state dict, or '' to train from scratch.") from None
  cached = os.path.join(torch.hub.get_dir(), "checkpoints",
                        os.path.basename(enum.url))
  if not os.path.exists(cached):
    from vit_jax import input_pipeline  # pylint: disable=import-outside-toplevel
    host = urllib.parse.urlparse(enum.url).hostname
    if not input_pipeline._online(host):  # pylint: disable=protected-access
      raise FileNotFoundError(
          f"torchvision weights {enum_name}.{weights} are not cached at "
          f"{cached!r} and {host} cannot be reached (offline?). Download "
          f"{enum.url} to that path, or set "
          f"--config.init_weights=/path/to/weights.pth.")
  return weights


def init_variables(config, model, num_classes: int):
  """(host variables or None for random init, preprocessing or None)."""
  if not config.init_weights:
    return None, None
  weights = _torchvision_state_dict(config.model_name, config.init_weights)
  # Architecture overrides (custom sizes) describe the checkpoint too.
  kw = {k: config.model[k] for k in _ARCH_FIELDS if k in config.model}
  tv = convert.load_torchvision(config.model_name, weights,
                                image_size=config.image_size,
                                scan_layers=model.scan_layers, **kw)
  variables = jax.tree_util.tree_map(np.asarray, dict(tv.variables))
  params = dict(variables["params"])
  width = params["head"]["kernel"].shape[0] if "head" in params else None
  if width is not None and (config.reset_head or
                            params["head"]["kernel"].shape[1] != num_classes):
    params["head"] = {
        "kernel": np.zeros((width, num_classes), np.float32),
        "bias": np.full((num_classes,), model.head_bias_init, np.float32)}
  variables["params"] = params
  return variables, tv.preprocessing


def check_tree(expected, got, what: str):
  """Raises naming missing, unexpected and mis-shaped leaves."""
  e = {jax.tree_util.keystr(k): v.shape for k, v in
       jax.tree_util.tree_leaves_with_path(expected)}
  g = {jax.tree_util.keystr(k): np.shape(v) for k, v in
       jax.tree_util.tree_leaves_with_path(got)}
  missing = sorted(set(e) - set(g))
  unexpected = sorted(set(g) - set(e))
  shapes = [f"{k}: model {e[k]}, weights {g[k]}" for k in sorted(set(e) & set(g))
            if tuple(e[k]) != tuple(g[k])]
  if missing or unexpected or shapes:
    raise ValueError(
        f"{what} do not match the model:\n  missing: {missing[:10]}\n  "
        f"unexpected: {unexpected[:10]}\n  mis-shaped: {shapes[:10]}")


# --------------------------------------------------------------------------- #
# Steps.
# --------------------------------------------------------------------------- #


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


def make_train_step(model, tx, *, num_classes: int, seed: int,
                    label_smoothing: float = 0.0, mixup_alpha: float = 0.0,
                    grad_accum_steps: int = 1, micro_sharding=None):
  """The (unjitted) train step: state, batch -> state.

  Dropout/mixup rngs are ``fold_in(key(seed), step)``: a function of the
  step, so a resumed run draws the same numbers.
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
    images = batch["image"]
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
          (micro(images), micro(labels), jnp.arange(accum)))
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


def make_eval_step(model, num_classes: int):
  """params, batch_stats, batch -> summed metrics of the masked batch."""
  k = min(5, num_classes)

  def eval_fn(params, batch_stats, batch):
    variables = {"params": params}
    if batch_stats:
      variables["batch_stats"] = batch_stats
    logits = model.apply(variables, batch["image"], train=False)
    logits = logits.astype(jnp.float32)
    labels, mask = batch["label"], batch["mask"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    top1 = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    _, topk = jax.lax.top_k(logits, k)
    in_topk = jnp.any(topk == labels[:, None], axis=-1).astype(jnp.float32)
    return {"loss": jnp.sum(loss * mask), "correct": jnp.sum(top1 * mask),
            "correct5": jnp.sum(in_topk * mask), "count": jnp.sum(mask)}

  return eval_fn


def reset_acc(state: TrainState) -> TrainState:
  return state.replace(acc=jax.tree_util.tree_map(jnp.zeros_like, state.acc))


@dataclasses.dataclass
class Compiled:
  """The jitted functions of one run, bound to its mesh and shardings."""

  init_from_rng: Any
  init_from_variables: Any
  train_step: Any
  eval_step: Any
  reset_acc: Any


def compile_steps(model, tx, config, mesh: Mesh, abstract_state,
                  shardings, num_classes: int) -> Compiled:
  """jit with explicit shardings and the state donated."""
  from_rng, from_variables = make_init_fn(model, tx, config.image_size)
  data = batch_sharding(mesh)
  micro = batch_sharding(mesh, extra_leading=1)
  repl = NamedSharding(mesh, P())
  step = make_train_step(
      model, tx, num_classes=num_classes, seed=int(config.seed),
      label_smoothing=float(config.label_smoothing),
      mixup_alpha=float(config.pp.mixup_alpha),
      grad_accum_steps=int(config.grad_accum_steps), micro_sharding=micro)
  eval_fn = make_eval_step(model, num_classes)
  var_sh = {"params": shardings.params}
  if abstract_state.batch_stats:
    var_sh["batch_stats"] = shardings.batch_stats
  return Compiled(
      init_from_rng=jax.jit(from_rng, out_shardings=shardings),
      init_from_variables=jax.jit(from_variables, in_shardings=(var_sh,),
                                  out_shardings=shardings),
      train_step=jax.jit(step, in_shardings=(shardings, data),
                         out_shardings=shardings, donate_argnums=(0,)),
      eval_step=jax.jit(eval_fn, in_shardings=(shardings.params,
                                               shardings.batch_stats, data),
                        out_shardings=repl),
      reset_acc=jax.jit(reset_acc, in_shardings=(shardings,),
                        out_shardings=shardings, donate_argnums=(0,)),
  )


def abstract_train_state(model, tx, image_size: int):
  from_rng, _ = make_init_fn(model, tx, image_size)
  return jax.eval_shape(from_rng, jax.random.key(0))


def with_shardings(abstract, shardings):
  return jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, shardings)


def num_params(abstract_state) -> int:
  return int(sum(math.prod(x.shape) for x in
                 jax.tree_util.tree_leaves(abstract_state.params)))


def train_and_evaluate(config, workdir: str, **kwargs):
  """See :func:`vit_jax.train_loop.train_and_evaluate`."""
  from vit_jax import train_loop  # pylint: disable=import-outside-toplevel
  return train_loop.train_and_evaluate(config, workdir, **kwargs)


__all__ = ["TrainState", "make_mesh", "state_shardings", "make_train_step",
           "make_eval_step", "compile_steps", "train_and_evaluate"]
