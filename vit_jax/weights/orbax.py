"""Our own Orbax training checkpoints, read for inference.

Layout of ``<workdir>/checkpoints/<step>/`` (one Orbax composite per step,
written by :class:`vit_jax.train.checkpoint.CheckpointManager`)::

    variables/   {'params': ..., ('batch_stats': ...)}   (StandardSave)
    train/       {'step', 'opt_state', 'acc'}             (StandardSave)
    meta/        JSON: model name and kwargs, image_size, mean, std,
                 label_names, dataset, step, the resolved config

Orbax writes a step into a temporary directory and renames it when every
process is done, so a step directory that exists is complete.

    model, variables, info = load_for_inference("/path/to/workdir")
    logits = model.apply(variables, images, train=False)
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Dict, Optional, Tuple

import jax
import orbax.checkpoint as ocp

from vit_jax import models
from vit_jax.weights import trees

ITEMS = ("variables", "train", "meta")
STEP_RE = re.compile(r"^\d+$")


def not_read_only_notice(record) -> bool:
  return not str(record.msg).startswith("Given directory is read only")


def handlers():
  return {"variables": ocp.StandardCheckpointHandler(),
          "train": ocp.StandardCheckpointHandler(),
          "meta": ocp.JsonCheckpointHandler()}


def restore_meta(manager, step: int) -> Dict[str, Any]:
  """The JSON ``meta`` item of ``step`` (an Orbax ``CheckpointManager``)."""
  out = manager.restore(
      int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
  return out["meta"]


def restore_variables_on(manager, step: int, sharding) -> Any:
  """Restores only ``variables`` of ``step`` with every array on
  ``sharding``."""
  tree = manager.item_metadata(step)["variables"]
  if tree is None:
    raise ValueError(f"Checkpoint step {step} in {manager.directory} has no "
                     f"'variables' item.")
  tree = getattr(tree, "tree", tree)
  abstract = jax.tree_util.tree_map(
      lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding),
      tree)
  out = manager.restore(int(step), args=ocp.args.Composite(
      variables=ocp.args.StandardRestore(abstract)))
  return out["variables"]


def open_read_only(directory: str):
  """An Orbax ``CheckpointManager`` that never writes (nor deletes a
  temporary step)."""
  options = ocp.CheckpointManagerOptions(
      create=False, read_only=True, cleanup_tmp_directories=False,
      enable_async_checkpointing=False, save_interval_steps=0)
  log = logging.getLogger("absl")
  log.addFilter(not_read_only_notice)  # we asked for read-only
  try:
    return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                                 item_names=ITEMS, item_handlers=handlers())
  finally:
    log.removeFilter(not_read_only_notice)


def _has_steps(d: str) -> bool:
  return os.path.isdir(d) and any(
      STEP_RE.match(n) or ".orbax-checkpoint-tmp" in n for n in os.listdir(d))


def resolve_checkpoint(path: str) -> Tuple[str, Optional[int]]:
  """``path`` (workdir, its ``checkpoints/``, or a step dir) ->
  ``(checkpoints_dir, step or None for the latest)``."""
  path = os.path.abspath(os.path.expanduser(str(path)))
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"No checkpoint at {path!r}: the path does not exist. Expected a "
        f"training workdir (containing checkpoints/), its checkpoints/ "
        f"directory, or one step directory inside it.")
  name = os.path.basename(path)
  if ".orbax-checkpoint-tmp" in name:
    raise ValueError(
        f"{path!r} is a half-written (temporary) checkpoint that was never "
        f"completed; it cannot be loaded. Use a completed step directory or "
        f"the checkpoints/ directory (the latest complete step is used).")
  if STEP_RE.match(name) and os.path.isdir(os.path.join(path, "variables")):
    return os.path.dirname(path), int(name)
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return os.path.join(path, "checkpoints"), None
  if _has_steps(path):
    return path, None
  raise FileNotFoundError(
      f"No checkpoint found at {path!r}: expected a training workdir "
      f"(containing checkpoints/), its checkpoints/ directory (containing "
      f"numbered step directories), or a step directory (containing "
      f"variables/ and meta/).")


def build_model(meta: Dict[str, Any], **overrides) -> models.VisionTransformer:
  """The :class:`~vit_jax.models.VisionTransformer` a checkpoint's ``meta``
  describes (:func:`vit_jax.models.from_record`)."""
  return models.from_record(meta["model_name"], meta["model_kwargs"],
                            **overrides)


def load_for_inference(path: str):
  """Loads a training checkpoint for inference, on the default backend.

  The variables are restored onto this process's first device of JAX's
  default backend (the GPU or TPU where there is one), so predict, evaluate
  and visualize run there, and ``JAX_PLATFORMS`` may name an accelerator
  alone.

  Args:
    path: a training workdir, its ``checkpoints/`` directory (the latest
      complete step is used) or one step directory (``checkpoints/1000``).

  Returns:
    ``(model, variables, info)``: a float32, non-scanned, dropout-free
    :class:`~vit_jax.models.VisionTransformer` (its attention kernel chosen
    by this backend); ``{'params': ...}`` (plus
    ``batch_stats`` if the model has any) that match it; and a dict with
    ``label_names`` (list of str or None), ``image_size`` (int), ``mean`` and
    ``std`` (3 floats, [0, 1] pixel units), ``dataset``, ``step``,
    ``num_classes``, ``model_name`` and the training ``config``.

  Raises:
    FileNotFoundError: ``path`` holds no (complete) checkpoint.
    ValueError: ``path`` is a half-written checkpoint.
  """
  ckpt_dir, step = resolve_checkpoint(path)
  mngr = open_read_only(ckpt_dir)
  try:
    steps = list(mngr.all_steps())
    if step is None:
      if not steps:
        raise FileNotFoundError(
            f"No complete checkpoint in {ckpt_dir!r}: expected numbered step "
            f"directories written by train.py (temporary, half-written ones "
            f"are never loaded).")
      step = max(steps)
    elif step not in steps:
      raise ValueError(f"Checkpoint step {step} in {ckpt_dir!r} is incomplete "
                       f"or unreadable; complete steps: {sorted(steps)}.")
    meta = restore_meta(mngr, step)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    variables = restore_variables_on(mngr, step, device)
  finally:
    mngr.close()
  variables = trees.unstack_layers(dict(variables))
  # attention_impl=None: this backend's own kernel (a run trained with
  # 'cudnn' on a GPU is still read on a CPU); the numbers are the same.
  model = build_model(meta, dtype="float32", param_dtype="float32",
                      scan_layers=False, remat_policy=None, dropout_rate=0.0,
                      attention_dropout_rate=0.0, drop_path_rate=0.0,
                      attention_impl=None)
  info = {
      "label_names": meta.get("label_names"),
      "image_size": int(meta["image_size"]),
      "mean": tuple(float(x) for x in meta["mean"]),
      "std": tuple(float(x) for x in meta["std"]),
      "dataset": meta.get("dataset"),
      "step": int(step),
      "num_classes": meta["model_kwargs"].get("num_classes"),
      "model_name": meta["model_name"],
      "config": meta.get("config"),
      # NaFlex runs: the evaluation's sequence length.
      "naflex_seq_len": meta.get("naflex_seq_len"),
  }
  return model, variables, info
