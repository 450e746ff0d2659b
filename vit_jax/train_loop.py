"""The training loop: data -> jitted steps -> metrics, evals and checkpoints.

    from vit_jax import train_lib
    train_lib.train_and_evaluate(config, "/tmp/run")

Restarting with the same workdir resumes from the latest complete checkpoint
and reproduces the uninterrupted run's numbers: data order, augmentation and
dropout are functions of ``(seed, step)`` and the loss accumulators are part of
the checkpoint. Rows of metrics.jsonl after the restored step (written by the
killed run) are dropped, then a ``start`` row with the run's facts is added.
SIGTERM saves a checkpoint at the current step and returns normally.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from typing import Any, Dict, Optional, Sequence

import jax
import numpy as np

from vit_jax import checkpoint, input_pipeline, metrics, optim, train_lib


class _Preemption:
  """SIGTERM -> save a checkpoint and stop, at the same step on every process.

  One process: a Python SIGTERM handler sets a flag checked once per step.
  Several processes: JAX's preemption service (started by
  ``jax.distributed.initialize``) catches SIGTERM on any of them and agrees
  on a step (``multihost_utils.reached_preemption_sync_point``); without the
  service, the processes all-gather their flags every step.
  """

  def __init__(self):
    self.flag = False
    self._old = None
    self._service = False

  def __enter__(self):
    if jax.process_count() > 1:
      from jax._src import distributed  # pylint: disable=import-outside-toplevel
      self._service = (
          distributed.global_state.preemption_sync_manager is not None)
    if not self._service:
      try:
        self._old = signal.signal(signal.SIGTERM, self._handle)
      except ValueError:  # not the main thread: no handler, never preempted
        self._old = None
    return self

  def _handle(self, signum, frame):
    del signum, frame
    self.flag = True

  def __exit__(self, *exc):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)

  def requested(self, step: int) -> bool:
    if jax.process_count() == 1:
      return self.flag
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    if self._service:
      return bool(multihost_utils.reached_preemption_sync_point(step))
    flags = multihost_utils.process_allgather(np.int32(self.flag))
    return bool(np.any(flags))


def _fetch(tree):
  """Replicated (possibly multi-process) arrays -> host numpy."""
  def get(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      x = x.addressable_data(0)
    return np.asarray(x)
  return jax.tree_util.tree_map(get, tree)


def validate_config(config, num_devices: int, num_processes: int):
  """Clear errors for settings that cannot work, before any heavy work."""
  def positive(name):
    if int(config[name]) <= 0:
      raise ValueError(f"config.{name}={config[name]} must be positive.")

  for name in ("total_steps", "batch_size", "eval_batch_size", "log_every",
               "eval_every", "checkpoint_every", "grad_accum_steps",
               "image_size", "keep_checkpoints"):
    positive(name)
  b, a = int(config.batch_size), int(config.grad_accum_steps)
  if b % num_devices:
    raise ValueError(
        f"config.batch_size={b} is not divisible by the number of devices "
        f"({num_devices} across {num_processes} process(es)): every device "
        f"needs the same share. Use a multiple of {num_devices}, e.g. "
        f"{max(1, b // num_devices) * num_devices}.")
  if b % (a * num_devices):
    raise ValueError(
        f"config.batch_size={b} with grad_accum_steps={a} gives micro-batches "
        f"of {b / a:g}, which must be divisible by the {num_devices} devices: "
        f"batch_size must be a multiple of {a * num_devices}.")
  e = int(config.eval_batch_size)
  if e % num_devices:
    raise ValueError(
        f"config.eval_batch_size={e} is not divisible by the number of "
        f"devices ({num_devices}). Use a multiple of {num_devices}.")
  if not 0.0 <= float(config.label_smoothing) < 1.0:
    raise ValueError(f"config.label_smoothing={config.label_smoothing} must be "
                     f"in [0, 1).")
  if float(config.pp.mixup_alpha) < 0:
    raise ValueError(f"config.pp.mixup_alpha={config.pp.mixup_alpha} must be "
                     f">= 0 (0 disables mixup).")


def _facts(config, src, mesh, start, latest, model_name, n_params, mean, std):
  return dict(
      event="start", num_devices=int(mesh.size),
      num_processes=jax.process_count(),
      mesh={k: int(v) for k, v in mesh.shape.items()},
      global_batch_size=int(config.batch_size),
      local_batch_size=int(config.batch_size) // jax.process_count(),
      grad_accum_steps=int(config.grad_accum_steps),
      dataset=src.name, num_train_examples=src.num_train,
      num_eval_examples=src.num_eval, num_classes=src.num_classes,
      model=model_name, num_params=n_params, image_size=int(config.image_size),
      total_steps=int(config.total_steps),
      warmup_steps=optim.warmup_steps(config),
      init_weights=config.init_weights or None, resumed_from_step=latest,
      mean=list(mean), std=list(std), backend=jax.default_backend(),
      jax_version=jax.__version__, time=time.time())


def evaluate(fns, state, eval_ds, sharding) -> Dict[str, float]:
  """Sums of loss / correct / count over every (masked) eval example."""
  sums = []
  for batch in input_pipeline.as_numpy(eval_ds):
    sums.append(fns.eval_step(state.params, state.batch_stats,
                              train_lib.global_batch(batch, sharding)))
  total = {k: 0.0 for k in ("loss", "correct", "correct5", "count")}
  for s in _fetch(sums):
    for k in total:
      total[k] += float(s[k])
  return total


def train_and_evaluate(config, workdir: str, *,
                       devices: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
  """Trains ``config`` in ``workdir`` (resuming if it has checkpoints).

  Args:
    config: a (locked) ConfigDict from ``configs/``.
    workdir: output directory (checkpoints/, config.json, metrics.jsonl,
      TensorBoard events, curves.png).
    devices: the devices of the mesh (default: all of ``jax.devices()``).

  Returns:
    The last train and eval metrics, plus ``step``, ``preempted``,
    ``checkpoint_step`` and the final ``state`` (a TrainState).
  """
  workdir = os.path.abspath(workdir)
  pidx, pcount = jax.process_index(), jax.process_count()
  mesh = train_lib.make_mesh(devices, int(config.fsdp))
  validate_config(config, mesh.size, pcount)
  local_batch = int(config.batch_size) // pcount
  local_eval_batch = int(config.eval_batch_size) // pcount
  total = int(config.total_steps)

  src = input_pipeline.get_source(config)
  model_kw = train_lib.model_kwargs(config, src.num_classes)
  model = train_lib.build_model(config.model_name, model_kw)
  schedule = optim.make_schedule(config)
  tx = optim.make_optimizer(config, schedule)
  abstract = train_lib.abstract_train_state(model, tx, int(config.image_size))
  shardings = train_lib.state_shardings(abstract, mesh)
  fns = train_lib.compile_steps(model, tx, config, mesh, abstract, shardings,
                                src.num_classes)
  data_sh = train_lib.batch_sharding(mesh)

  ckpt = checkpoint.CheckpointManager(
      os.path.join(workdir, "checkpoints"), keep=int(config.keep_checkpoints),
      async_save=bool(config.async_checkpointing))
  latest = ckpt.latest_step()
  if latest is not None:
    items, saved = ckpt.restore(
        latest, train_lib.with_shardings(abstract, shardings).items())
    state = train_lib.TrainState.from_items(items)
    mean, std = tuple(saved["mean"]), tuple(saved["std"])
    start = int(latest)
  else:
    host_vars, init_pp = train_lib.init_variables(config, model,
                                                  src.num_classes)
    mean, std = input_pipeline.normalization(config, init_pp)
    if host_vars is None:
      state = fns.init_from_rng(jax.random.key(int(config.seed)))
    else:
      want = {"params": abstract.params}
      if abstract.batch_stats:
        want["batch_stats"] = abstract.batch_stats
      train_lib.check_tree(want, host_vars,
                           f"Initial weights {config.init_weights!r}")
      var_sh = {"params": shardings.params}
      if abstract.batch_stats:
        var_sh["batch_stats"] = shardings.batch_stats
      state = fns.init_from_variables(train_lib.put_global(host_vars, var_sh))
    start = 0

  config_dict = json.loads(json.dumps(config.to_dict(), default=str))
  meta = dict(model_name=config.model_name, model_kwargs=model_kw,
              image_size=int(config.image_size), mean=list(mean),
              std=list(std), label_names=src.label_names, dataset=src.name,
              num_classes=src.num_classes, config=config_dict)
  writer = metrics.MetricsWriter(workdir, enabled=pidx == 0,
                                 tensorboard=bool(config.tensorboard))
  if pidx == 0:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(config_dict, f, indent=2, sort_keys=True)
  writer.truncate_after(start)
  n_params = train_lib.num_params(abstract)
  writer.write(start, **_facts(config, src, mesh, start, latest,
                               config.model_name, n_params, mean, std))
  writer.print(
      f"{config.model_name} ({n_params:,} params) on {src.name} "
      f"({src.num_train:,} train / {src.num_eval:,} eval, {src.num_classes} "
      f"classes): {mesh.size} device(s) {dict(mesh.shape)}, {pcount} "
      f"process(es), batch {config.batch_size}, steps {start} -> {total}"
      + (f" (resumed from checkpoint {latest})" if latest is not None else ""))

  train_ds = input_pipeline.train_dataset(
      config, src, local_batch=local_batch, start_step=start,
      process_index=pidx, process_count=pcount, mean=mean, std=std)
  eval_ds, _ = input_pipeline.eval_dataset(
      config, src, local_batch=local_eval_batch, process_index=pidx,
      process_count=pcount, mean=mean, std=std)
  train_iter = input_pipeline.as_numpy(train_ds)

  last_train: Dict[str, float] = {}
  last_eval: Dict[str, float] = {}
  saved_step = latest
  progress = metrics.Progress(start, total)
  step = start
  preempted = False

  def check_finite(acc, upto):
    if int(acc["nonfinite"]) or not math.isfinite(float(acc["loss_sum"])):
      ckpt.wait()
      good = ckpt.latest_step()
      raise FloatingPointError(
          f"Training diverged: non-finite loss or gradient (loss sum "
          f"{float(acc['loss_sum'])}) in the {int(acc['count'])} step(s) "
          f"ending at step {upto}. Stopped without saving; the last good "
          f"checkpoint (step {good}) in {ckpt.directory} is intact. Lower "
          f"config.learning_rate, keep config.grad_clip_norm > 0, or check "
          f"the data.")

  def do_eval():
    progress.pause()
    t0 = time.perf_counter()
    s = evaluate(fns, state, eval_ds, data_sh)
    if int(round(s["count"])) != src.num_eval:
      raise RuntimeError(f"Evaluation counted {s['count']} examples, the "
                         f"split has {src.num_eval}.")
    row = {"eval_loss": s["loss"] / s["count"],
           "eval_accuracy": s["correct"] / s["count"]}
    if src.num_classes >= 5:
      row["eval_top5_accuracy"] = s["correct5"] / s["count"]
    writer.write(step, **row, eval_examples=int(s["count"]),
                 eval_seconds=round(time.perf_counter() - t0, 3))
    writer.print(f"eval  {step:>{len(str(total))}}/{total} | loss "
                 f"{row['eval_loss']:.4f} | accuracy "
                 f"{100 * row['eval_accuracy']:.2f}% ({int(s['count'])} "
                 f"examples)")
    progress.resume()
    return row

  with _Preemption() as preemption:
    while step < total:
      batch = train_lib.global_batch(next(train_iter), data_sh)
      state = fns.train_step(state, batch)
      step += 1
      if step == start + 1 and step % int(config.log_every) and step < total:
        # Keep compilation out of img/s and the ETA.
        jax.block_until_ready(state.step)
        progress.restart(step)
      is_last = step == total
      preempted = preemption.requested(step)
      # A preempted run saves its loss sums unlogged, so the resumed run logs
      # the very windows (and numbers) of an uninterrupted one.
      is_log = step % int(config.log_every) == 0 or is_last
      is_ckpt = (step % int(config.checkpoint_every) == 0 or is_last or
                 preempted)
      if is_log or is_ckpt:
        acc = _fetch(state.acc)
        check_finite(acc, step)
      if is_log and int(acc["count"]):
        rate, eta = progress.tick(step)
        n = int(acc["count"])
        last_train = {
            "train_loss": float(acc["loss_sum"]) / n,
            "grad_norm": float(acc["grad_norm_sum"]) / n,
            "learning_rate": float(schedule(step - 1)),
            "img_per_sec": rate * int(config.batch_size),
            "epoch": step * int(config.batch_size) / max(1, src.num_train)}
        writer.write(step, **last_train)
        writer.print(metrics.progress_line(
            step, total, last_train["train_loss"], last_train["learning_rate"],
            last_train["img_per_sec"], eta))
        state = fns.reset_acc(state)
      if is_ckpt:
        progress.pause()
        ckpt.save(step, state.items(), dict(meta, step=step))
        saved_step = step
        progress.resume()
      if step % int(config.eval_every) == 0 or is_last:
        last_eval = do_eval()
      if preempted:
        writer.print(f"SIGTERM: saved a checkpoint at step {step} in "
                     f"{ckpt.directory}; exiting. Run the same command to "
                     f"resume.")
        break

  ckpt.close()
  if pidx == 0 and config.write_plots:
    metrics.write_plots(workdir)
  writer.close()
  return dict(step=step, preempted=preempted, checkpoint_step=saved_step,
              state=state, **last_train, **last_eval)
