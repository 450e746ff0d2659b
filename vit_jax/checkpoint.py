"""Checkpoints: an Orbax ``CheckpointManager`` for training, and
:func:`load_for_inference` for everything that only needs the model.

Layout of ``<workdir>/checkpoints/<step>/`` (one Orbax composite per step)::

    variables/   {'params': ..., ('batch_stats': ...)}   (StandardSave)
    train/       {'step', 'opt_state', 'acc'}             (StandardSave)
    meta/        JSON: model name and kwargs, image_size, mean, std,
                 label_names, dataset, step, the resolved config

Orbax writes a step into a temporary directory and renames it when every
process is done, so a step directory that exists is complete; temporary
(half-written) ones are ignored by ``all_steps`` and deleted when a manager
is created. Saves are asynchronous (``wait`` blocks until they are durable).

    model, variables, info = load_for_inference("/path/to/workdir")
    logits = model.apply(variables, images, train=False)
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from vit_jax import convert, models

ITEMS = ("variables", "train", "meta")


def _handlers():
  return {"variables": ocp.StandardCheckpointHandler(),
          "train": ocp.StandardCheckpointHandler(),
          "meta": ocp.JsonCheckpointHandler()}


class CheckpointManager:
  """Saves and restores training state; thin layer over Orbax's manager."""

  def __init__(self, directory: str, *, keep: int = 3,
               async_save: bool = True, read_only: bool = False):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(max(1, keep)),
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=not read_only,
        create=not read_only,
        read_only=read_only,
    )
    self.manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=ITEMS,
        item_handlers=_handlers())

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def all_steps(self):
    return list(self.manager.all_steps())

  def save(self, step: int, items: Dict[str, Any], meta: Dict[str, Any]):
    """Starts an (async) save of ``items['variables']``, ``items['train']``
    and the JSON ``meta`` at ``step``."""
    args = ocp.args.Composite(
        variables=ocp.args.StandardSave(items["variables"]),
        train=ocp.args.StandardSave(items["train"]),
        meta=ocp.args.JsonSave(meta))
    self.manager.save(int(step), args=args, force=True)

  def restore(self, step: int, abstract_items: Dict[str, Any]
              ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Restores ``step`` onto the shardings of ``abstract_items`` (trees of
    ``jax.ShapeDtypeStruct`` with ``sharding``): any mesh, any device count."""
    args = ocp.args.Composite(
        variables=ocp.args.StandardRestore(abstract_items["variables"]),
        train=ocp.args.StandardRestore(abstract_items["train"]),
        meta=ocp.args.JsonRestore())
    try:
      out = self.manager.restore(int(step), args=args)
    except ValueError as e:
      raise ValueError(
          f"Checkpoint step {step} in {self.directory} does not match the "
          f"train state of this config (a different model, optimizer or "
          f"gradient clipping than the run that wrote it?). Resume with the "
          f"original config or use a new --workdir. Orbax: {e}") from e
    return {"variables": out["variables"], "train": out["train"]}, out["meta"]

  def restore_meta(self, step: int) -> Dict[str, Any]:
    out = self.manager.restore(
        int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    return out["meta"]

  def restore_variables_on(self, step: int, sharding) -> Any:
    """Restores only ``variables`` with every array on ``sharding``."""
    tree = self.manager.item_metadata(step)["variables"]
    if tree is None:
      raise ValueError(f"Checkpoint step {step} in {self.directory} has no "
                       f"'variables' item.")
    tree = getattr(tree, "tree", tree)
    abstract = jax.tree_util.tree_map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding),
        tree)
    out = self.manager.restore(int(step), args=ocp.args.Composite(
        variables=ocp.args.StandardRestore(abstract)))
    return out["variables"]

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


# --------------------------------------------------------------------------- #
# Inference.
# --------------------------------------------------------------------------- #

_STEP_RE = re.compile(r"^\d+$")


def _has_steps(d: str) -> bool:
  return os.path.isdir(d) and any(
      _STEP_RE.match(n) or ".orbax-checkpoint-tmp" in n for n in os.listdir(d))


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
  if _STEP_RE.match(name) and os.path.isdir(os.path.join(path, "variables")):
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
  """The :class:`~vit_jax.models.VisionTransformer` described by ``meta``."""
  kwargs = dict(meta["model_kwargs"])
  for key in ("dtype", "param_dtype"):
    if isinstance(kwargs.get(key), str):
      kwargs[key] = jnp.dtype(kwargs[key])
  kwargs.update(overrides)
  return models.get_model(meta["model_name"], **kwargs)


def load_for_inference(path: str):
  """Loads a training checkpoint for inference, on the CPU.

  Args:
    path: a training workdir, its ``checkpoints/`` directory (the latest
      complete step is used) or one step directory (``checkpoints/1000``).

  Returns:
    ``(model, variables, info)``: a float32, non-scanned, dropout-free
    :class:`~vit_jax.models.VisionTransformer`; ``{'params': ...}`` (plus
    ``batch_stats`` if the model has any) that match it; and a dict with
    ``label_names`` (list of str or None), ``image_size`` (int), ``mean`` and
    ``std`` (3 floats, [0, 1] pixel units), ``dataset``, ``step``,
    ``num_classes``, ``model_name`` and the training ``config``.

  Raises:
    FileNotFoundError: ``path`` holds no (complete) checkpoint.
    ValueError: ``path`` is a half-written checkpoint.
  """
  ckpt_dir, step = resolve_checkpoint(path)
  mngr = CheckpointManager(ckpt_dir, read_only=True, async_save=False)
  try:
    steps = mngr.all_steps()
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
    meta = mngr.restore_meta(step)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    variables = mngr.restore_variables_on(step, cpu)
  finally:
    mngr.manager.close()
  variables = convert.unstack_layers(dict(variables))
  model = build_model(meta, dtype=jnp.float32, param_dtype=jnp.float32,
                      scan_layers=False, remat_policy=None, dropout_rate=0.0,
                      attention_dropout_rate=0.0, drop_path_rate=0.0)
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
  }
  return model, variables, info
