"""The training loop, top to bottom: processes and mesh, input, model and
jitted steps, train state (resumed or initial), then the loop of steps with
its metrics, evaluations and checkpoints.

    from vit_jax import train_loop
    train_loop.train_and_evaluate(config, "/tmp/run")

Data flows one way: tfds -> tf.data on each host (:mod:`vit_jax.data.batches`)
-> global arrays (``batches.start_global``) -> the jitted step
(:mod:`vit_jax.train.step`, on the mesh of :mod:`vit_jax.train.sharding`) -> metrics
(:mod:`vit_jax.train.metrics`) and checkpoints (:mod:`vit_jax.train.checkpoint`).

Restarting with the same workdir resumes from the newest intact checkpoint
(or ``config.resume_from_step``) and reproduces the uninterrupted run's
numbers: data order, augmentation and dropout are functions of
``(seed, step)`` and the loss accumulators are part of the checkpoint. Rows of
metrics.jsonl after the restored step (written by the killed run) are
dropped, then a ``start`` row with the run's facts is added.

A SIGTERM to any process makes every process save a checkpoint after the
same step and return normally; every wait for the other processes is bounded
by ``config.peer_timeout_seconds`` (:mod:`vit_jax.train.multihost`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Dict, Optional, Sequence

import jax

from vit_jax.train import (checkpoint, host_memory, metrics, multihost, optim, sharding, init as train_init, step as train_step)
from vit_jax.data import console, preprocessing, synthetic
from vit_jax.models import kernels


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
  impl = config.model.get("attention_impl")
  if impl is not None and impl not in kernels.ATTENTION_IMPLS:
    raise ValueError(
        f"config.model.attention_impl={impl!r}: expected None (the backend "
        f"chooses) or one of {', '.join(map(repr, kernels.ATTENTION_IMPLS))}.")
  if float(config.pp.mixup_alpha) < 0:
    raise ValueError(f"config.pp.mixup_alpha={config.pp.mixup_alpha} must be "
                     f">= 0 (0 disables mixup).")
  lens = config.get("naflex_seq_lens")
  if lens is not None:
    if not lens or not all(isinstance(n, int) and n > 0 for n in lens):
      raise ValueError(f"config.naflex_seq_lens={lens}: expected a tuple of "
                       f"positive sequence lengths, e.g. (64, 144).")
    if float(config.pp.mixup_alpha):
      raise ValueError("config.pp.mixup_alpha: mixup blends two images "
                       "pixel by pixel, which NaFlex batches (each image its "
                       "own shape) cannot; set it to 0 with naflex_seq_lens.")
    if config.pp.crop not in ("inception", "resize"):
      raise ValueError(f"config.pp.crop={config.pp.crop!r}: NaFlex batches "
                       f"take 'inception' (a random crop, resized to the "
                       f"step's length keeping its aspect ratio) or 'resize' "
                       f"(the whole image).")


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
      naflex_seq_lens=(list(config.naflex_seq_lens)
                       if config.get("naflex_seq_lens") else None),
      total_steps=int(config.total_steps),
      warmup_steps=optim.warmup_steps(config),
      init_weights=config.init_weights or None, resumed_from_step=latest,
      mean=list(mean), std=list(std), backend=jax.default_backend(),
      jax_version=jax.__version__, time=time.time())


def _resume_hint(ckpt: checkpoint.CheckpointManager) -> str:
  """What survives a stop: the last complete checkpoint (directory listing
  only, safe from the watchdog thread)."""
  return resume_hint(ckpt.directory)


def resume_hint(checkpoint_dir: str) -> str:
  """What survives a stop: the last complete checkpoint in
  ``checkpoint_dir`` (a directory listing: safe from any thread, and after
  an interrupt)."""
  steps = checkpoint.complete_steps(checkpoint_dir)
  if not steps:
    return (f"There is no complete checkpoint in {checkpoint_dir} yet: the "
            f"same command starts again from step 0.")
  return (f"The last complete checkpoint is step {steps[-1]} in "
          f"{checkpoint_dir}: start every process again with the same command "
          f"to resume from it.")


def train_and_evaluate(config, workdir: str, *,
                       devices: Optional[Sequence[Any]] = None,
                       stated: Sequence[str] = ()) -> Dict[str, Any]:
  """Trains ``config`` in ``workdir`` (resuming if it has checkpoints).

  Args:
    config: a (locked) ConfigDict from ``configs/``.
    workdir: output directory (checkpoints/, config.json, metrics.jsonl,
      TensorBoard events, curves.png).
    devices: the devices of the mesh (default: all of ``jax.devices()``).
    stated: the config fields the user set (train.py: its ``--config.*``
      overrides, e.g. ``'model.num_heads'``). Fine-tuning, the weights
      decide the architecture; stated model fields are applied or refused
      against them, the recipe's are used only where they describe them
      (:func:`vit_jax.train.init.load_initial_weights`).

  Returns:
    The last train and eval metrics, plus ``step``, ``preempted``,
    ``stopped_by`` (``'SIGTERM'`` or ``'Ctrl-C'`` when preempted),
    ``checkpoint_step`` and the final ``state`` (a TrainState).
  """
  workdir = os.path.abspath(workdir)
  pidx, pcount = jax.process_index(), jax.process_count()
  total = int(config.total_steps)

  # ---- Processes and mesh: one mesh over every device of every process.
  mesh = sharding.make_mesh(devices, int(config.fsdp))
  validate_config(config, mesh.size, pcount)
  data_sh = sharding.batch_sharding(mesh)
  ckpt_dir = os.path.join(workdir, "checkpoints")

  # ---- Input: the dataset's metadata (each process reads its own slice).
  # tf.data for real datasets; the synthetic one is made on the devices
  # and imports no TensorFlow.
  if synthetic.is_synthetic(config):
    batches = None
    src = synthetic.get_source(config)
  else:
    from vit_jax.data import batches, sources  # pylint: disable=import-outside-toplevel
    src = sources.get_source(config)

  # ---- Model, optimizer, the train state's shape and shardings.
  init = train_init.load_initial_weights(config, stated)  # None: scratch
  model_kw = train_init.model_kwargs(config, src.num_classes, init)
  # Fine-tuning, the model is the weights' (and so is its name).
  model_name = init.model_name if init is not None else config.model_name
  note = init.note if init is not None else ""
  model = train_init.build_model(model_name, model_kw)
  naflex_lens = config.get("naflex_seq_lens")
  if naflex_lens and model.naflex is None:
    raise ValueError(
        "config.naflex_seq_lens needs a NaFlex model: start from NaFlex "
        "weights (SigLIP 2 NaFlex, timm's naflexvit_*) or from scratch "
        "(config.init_weights=''), not from fixed-grid weights.")
  schedule = optim.make_schedule(config)
  tx = optim.make_optimizer(config, schedule)
  abstract = train_step.abstract_train_state(model, tx, int(config.image_size))
  shardings = sharding.state_shardings(abstract, mesh)

  # ---- Train state: resumed from the newest intact checkpoint, or initial.
  peer_timeout = float(config.get("peer_timeout_seconds", 300))
  waits = multihost.Waits(peer_timeout,
                          process_index=pidx, process_count=pcount)
  with waits.waiting("the checkpoint directory to be opened (Orbax's barrier)"):
    ckpt = checkpoint.CheckpointManager(
        ckpt_dir, keep=int(config.keep_checkpoints),
        async_save=bool(config.async_checkpointing),
        timeout_s=peer_timeout)
  waits.where = lambda: _resume_hint(ckpt)

  def agree_on(step):
    with waits.waiting("the checkpoint to resume from (every process looks)"):
      multihost.agree(step, "the checkpoint step to resume from")

  abstract_items = sharding.with_shardings(abstract, shardings).items()
  latest, notes = ckpt.resume_step(abstract_items,
                                   config.get("resume_from_step"),
                                   primary=pidx == 0, sync=agree_on)
  if pidx == 0:
    for note in notes:
      print(f"warning: {note}", file=sys.stderr, flush=True)
  host_vars = None
  if latest is not None:
    with waits.waiting(f"checkpoint {latest} to be restored (Orbax's barriers)",
                       latest):
      items, saved = ckpt.restore(latest, abstract_items)
    state = train_step.TrainState.from_items(items)
    mean, std = tuple(saved["mean"]), tuple(saved["std"])
    start = int(latest)
  else:
    host_vars = train_init.initial_variables(config, init, abstract)
    mean, std = preprocessing.run_normalization(
        config, init.preprocessing if init else None)
    start = 0
  # The steps normalise the uint8 batches with the run's (mean, std).
  fns = train_step.compile_steps(model, tx, config, mesh, abstract, shardings,
                                 src.num_classes, mean=mean, std=std)
  if latest is None:
    if host_vars is None:
      state = fns.init_from_rng(jax.random.key(int(config.seed)))
    else:
      var_sh = {"params": shardings.params}
      if abstract.batch_stats:
        var_sh["batch_stats"] = shardings.batch_stats
      state = fns.init_from_variables(sharding.put_global(host_vars, var_sh))
  del init, host_vars  # the host copy of the initial weights

  # ---- Outputs: config.json, metrics.jsonl (a start row), TensorBoard.
  config_dict = json.loads(json.dumps(config.to_dict(), default=str))
  meta = dict(model_name=model_name, model_kwargs=model_kw,
              image_size=int(config.image_size), mean=list(mean),
              naflex_seq_len=max(naflex_lens) if naflex_lens else None,
              std=list(std), label_names=src.label_names, dataset=src.name,
              num_classes=src.num_classes, config=config_dict)
  writer = metrics.MetricsWriter(workdir, enabled=pidx == 0,
                                 tensorboard=bool(config.tensorboard))
  if pidx == 0:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      json.dump(config_dict, f, indent=2, sort_keys=True)
  writer.truncate_after(start)
  n_params = train_step.num_params(abstract)
  writer.write(start, **_facts(config, src, mesh, start, latest,
                               model_name, n_params, mean, std),
               **({"model_source": note} if note else {}))
  if note:
    writer.print(note)
  writer.print(
      f"{model_name} ({n_params:,} params) on {src.name} "
      f"({src.num_train:,} train / {src.num_eval:,} eval, {src.num_classes} "
      f"classes): {mesh.size} device(s) {dict(mesh.shape)}, {pcount} "
      f"process(es), batch {config.batch_size}, steps {start} -> {total}"
      + (f" (resumed from checkpoint {latest})" if latest is not None else ""))

  # ---- Data from step `start`: tf.data -> uint8 global arrays (the steps
  # normalise them on the devices), double-buffered.
  # NaFlex: each step's length drawn from (seed, step), one compilation per
  # length; evaluation at the longest.
  if batches is None:  # synthetic: made on the devices, from (seed, step)
    train_batches = synthetic.train_batches(config, src, data_sh,
                                            start_step=start)
    eval_batches = lambda: synthetic.eval_batches(config, src, data_sh)  # noqa: E731
  else:
    train_ds = batches.train_dataset(
        config, src, local_batch=int(config.batch_size) // pcount,
        start_step=start, process_index=pidx, process_count=pcount,
        naflex=(model.patch_size, tuple(naflex_lens)) if naflex_lens else None)
    eval_ds, _ = batches.eval_dataset(
        config, src, local_batch=int(config.eval_batch_size) // pcount,
        process_index=pidx, process_count=pcount,
        naflex=(model.patch_size, max(naflex_lens)) if naflex_lens else None)
    train_batches = batches.start_global(train_ds, data_sh)
    eval_batches = lambda: batches.start_global(eval_ds, data_sh)  # noqa: E731

  # ---- The loop.
  last_train: Dict[str, float] = {}
  last_eval: Dict[str, float] = {}
  saved_step = latest
  progress = metrics.Progress(start, total)
  first_ckpt = (start // int(config.checkpoint_every) + 1) * int(
      config.checkpoint_every)

  def check_finite(acc, upto):
    if int(acc["nonfinite"]) or not math.isfinite(float(acc["loss_sum"])):
      with waits.waiting("the last checkpoint's commit", upto):
        ckpt.wait()
      good = ckpt.latest_step()
      kept = (f"the last good checkpoint (step {good}) in {ckpt.directory} is "
              f"intact" if good is not None else
              f"there is no checkpoint yet (the first would have been at step "
              f"{min(first_ckpt, total)}); a new run starts from step 0")
      raise FloatingPointError(
          f"Training diverged: non-finite loss or gradient (loss sum "
          f"{float(acc['loss_sum'])}) in the {int(acc['count'])} step(s) "
          f"ending at step {upto}. Stopped without saving; {kept}. Lower "
          f"config.learning_rate, keep config.grad_clip_norm > 0, or check "
          f"the data.")

  def evaluate(step):
    progress.pause()
    t0 = time.perf_counter()
    with waits.waiting("the evaluation's all-reduce", step):
      s = train_step.evaluate(fns.eval_step, state.params, state.batch_stats,
                              eval_batches())
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

  step, preempted, vote, stopped_by = start, False, None, None
  heap = host_memory.HeapGuard()
  console.start_up_done()  # later objects collected as Python's defaults say
  with multihost.Preemption(data_sh) as preemption:
    while step < total:
      heap.step()
      # Dispatching a step can block on the previous one's all-reduce (its
      # donated buffers): a wait for the other processes too.
      with waits.waiting(f"step {step + 1}'s dispatch (step {step}'s "
                         f"all-reduce)", step + 1):
        state, next_vote = fns.train_step(state, next(train_batches),
                                          preemption.votes())
      step += 1
      if vote is not None:
        # Every process's SIGTERM vote, as of the previous step: the same
        # value on every process, so all of them stop after this step.
        with waits.waiting(f"step {step - 1} of the other processes (its "
                           f"all-reduce)", step):
          preempted = bool(sharding.to_host(vote))
      vote = next_vote
      if step == start + 1 and step % int(config.log_every) and step < total:
        # Keep compilation out of img/s and the ETA.
        with waits.waiting("the first step of every process (compilation "
                           "included)", step):
          jax.block_until_ready(state.step)
        progress.restart(step)
      is_last = step == total
      # A preempted run saves its loss sums unlogged, so the resumed run logs
      # the very windows (and numbers) of an uninterrupted one.
      is_log = step % int(config.log_every) == 0 or is_last
      is_ckpt = (step % int(config.checkpoint_every) == 0 or is_last or
                 preempted)
      if is_log or is_ckpt:
        with waits.waiting("the step's all-reduce (its metrics)", step):
          acc = sharding.to_host(state.acc)
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
        with waits.waiting("the metrics' reset (the step's all-reduce)", step):
          state = fns.reset_acc(state)
      if is_ckpt:
        progress.pause()
        with waits.waiting("the checkpoint's save to start (Orbax's barriers; "
                           "the previous save's commit)", step):
          ckpt.save(step, state.items(), dict(meta, step=step))
        saved_step = step
        progress.resume()
      if step % int(config.eval_every) == 0 or is_last:
        last_eval = evaluate(step)
      if preempted:
        stopped_by = multihost.stop_reason()
        writer.print(f"{stopped_by}: saved a checkpoint at step {step} in "
                     f"{ckpt.directory}; exiting. Run the same command to "
                     f"resume.")
        break
  # The input pipeline's threads stop now, while the checkpoint commits,
  # not whenever the generator happens to be collected.
  train_batches.close()

  with waits.waiting(f"checkpoint {saved_step}'s commit by every process",
                     step):
    ckpt.close()
  waits.close()
  if pidx == 0 and config.write_plots:
    metrics.write_plots(workdir)
  writer.close()
  return dict(step=step, preempted=preempted, stopped_by=stopped_by,
              checkpoint_step=saved_step, state=state, **last_train,
              **last_eval)
