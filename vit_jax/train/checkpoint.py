"""The training run's checkpoints: an Orbax ``CheckpointManager`` that
saves, checks and resumes (reading one for inference is the weights layer's
:func:`vit_jax.weights.orbax.load_for_inference`).

Layout of ``<workdir>/checkpoints/<step>/`` (one Orbax composite per step)::

    variables/   {'params': ..., ('batch_stats': ...)}   (StandardSave)
    train/       {'step', 'opt_state', 'acc'}             (StandardSave)
    meta/        JSON: model name and kwargs, image_size, mean, std,
                 label_names, dataset, step, the resolved config

Orbax writes a step into a temporary directory and renames it when every
process is done, so a step directory that exists is complete; temporary
(half-written) ones are ignored by ``all_steps`` and deleted when a manager
is created. Saves are asynchronous (``wait`` blocks until they are durable).

A complete step can still be damaged afterwards (files truncated or lost):
:meth:`CheckpointManager.resume_step` checks every candidate (files present,
non-empty, metadata readable, the tree of this run's train state) and resumes
from the newest intact one, moving the damaged ones to
``<workdir>/checkpoints.set_aside/``. A save that would not fit on the disk
fails before it starts, naming the step, the space needed and free.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax
import orbax.checkpoint as ocp

from vit_jax.weights import orbax
from vit_jax.weights.check import check_keys

SET_ASIDE = "checkpoints.set_aside"
# Orbax's JSON files (and the 'meta' item's): they must parse.
_JSON_FILES = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "metadata")


class DamagedCheckpointError(ValueError):
  """A complete checkpoint whose files are damaged (truncated, missing)."""


class CheckpointSaveError(RuntimeError):
  """A checkpoint could not be written (e.g. the disk is full)."""


def _not_disk_full_report(record) -> bool:
  """Drops Orbax's own reports (with tracebacks, one per writer thread) of a
  full disk: :class:`CheckpointSaveError` says it once, with the step, the
  space and the checkpoint to resume from."""
  exc = record.exc_info[1] if record.exc_info else None
  return not (_is_disk_full(Exception(record.getMessage())) or
              (exc is not None and _is_disk_full(exc)))


def _is_orphaned_write_callback(unraisable) -> bool:
  """The unraisable error of a write Orbax abandoned: when one array's write
  fails (a full disk), Orbax's save coroutine raises and its event loop is
  closed while tensorstore's other writes of that save are still running;
  each of them, finishing, calls ``loop.call_soon_threadsafe`` on the closed
  loop from tensorstore's thread, which raises RuntimeError('Event loop is
  closed') with nobody to catch it. The save's failure itself reaches the
  caller as :class:`CheckpointSaveError`."""
  exc = unraisable.exc_value
  if not (isinstance(exc, RuntimeError) and
          str(exc) == "Event loop is closed"):
    return False
  frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
  return frames[-2:] == ["call_soon_threadsafe", "_check_closed"]


def _install_orphan_filter():
  """Once per process: :func:`_is_orphaned_write_callback` errors are not
  printed (they come from a save that already failed, and may arrive until
  the process ends); every other unraisable error goes to the previous
  hook."""
  previous = sys.unraisablehook
  if getattr(previous, "_vit_jax_orphans", False):
    return

  def hook(unraisable):
    if not _is_orphaned_write_callback(unraisable):
      previous(unraisable)
  hook._vit_jax_orphans = True  # pylint: disable=protected-access
  sys.unraisablehook = hook


def _leaf_shapes(tree) -> Dict[str, Any]:
  """{'a/b/0/c': leaf} with dict keys, attributes and indices alike (Orbax
  stores named tuples as dicts)."""
  def name(k):
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        return str(getattr(k, attr))
    return str(k)
  return {"/".join(name(k) for k in path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _size_on_disk(path: str) -> int:
  """Bytes allocated to the files under ``path``."""
  total = 0
  for root, _, files in os.walk(path):
    for f in files:
      st = os.stat(os.path.join(root, f))
      total += getattr(st, "st_blocks", 0) * 512 or st.st_size
  return total


def _mb(n: float) -> str:
  return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB"


def _is_disk_full(e: BaseException) -> bool:
  text = str(e)
  return (getattr(e, "errno", None) == 28 or "No space left on device" in text
          or "os_error_code='28'" in text)


def complete_steps(directory: str) -> List[int]:
  """The complete checkpoints' steps in ``directory``, from its listing
  (a step's directory is named by its number once Orbax has committed it;
  until then it is a temporary name): safe from any thread, and without a
  manager."""
  try:
    names = os.listdir(directory)
  except OSError:
    return []
  return sorted(int(n) for n in names if orbax.STEP_RE.match(n))


class CheckpointManager:
  """Saves and restores training state; thin layer over Orbax's manager.

  Args:
    directory: the checkpoints directory (``<workdir>/checkpoints``).
    keep: how many of the newest checkpoints to keep.
    async_save: write in a background thread (``wait`` blocks).
    read_only: never write (inference).
    timeout_s: the longest Orbax's background commit waits for the other
      processes (seconds; None: Orbax's default).
  """

  def __init__(self, directory: str, *, keep: int = 3,
               async_save: bool = True, read_only: bool = False,
               timeout_s: Optional[float] = None):
    self.directory = os.path.abspath(directory)
    self._pending: Optional[int] = None  # step of an unfinished async save
    self._need = "?"  # the space a checkpoint takes, for errors
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(max(1, keep)),
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=not read_only,
        create=not read_only,
        read_only=read_only,
        save_interval_steps=0 if read_only else 1,
        async_options=(ocp.AsyncOptions(timeout_secs=int(math.ceil(timeout_s)))
                       if timeout_s else None),
    )
    # Orbax warns that a read-only manager is read-only: we asked for it.
    self._log = logging.getLogger("absl")
    self._log.addFilter(orbax.not_read_only_notice)
    try:
      self.manager = ocp.CheckpointManager(
          self.directory, options=options, item_names=orbax.ITEMS,
          item_handlers=orbax.handlers())
    finally:
      self._log.removeFilter(orbax.not_read_only_notice)
    if not read_only:
      self._log.addFilter(_not_disk_full_report)
      _install_orphan_filter()

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def all_steps(self):
    return list(self.manager.all_steps())

  def complete_steps(self) -> List[int]:
    """Complete steps from a directory listing (safe from any thread)."""
    return complete_steps(self.directory)

  # ------------------------------------------------------------------ save

  def save(self, step: int, items: Dict[str, Any], meta: Dict[str, Any]):
    """Starts an (async) save of ``items['variables']``, ``items['train']``
    and the JSON ``meta`` at ``step``.

    Raises:
      CheckpointSaveError: the previous (async) save failed, or this one
        would not fit on the disk (checked before writing anything).
    """
    self._finish_pending()
    self._check_space(step, items)
    args = ocp.args.Composite(
        variables=ocp.args.StandardSave(items["variables"]),
        train=ocp.args.StandardSave(items["train"]),
        meta=ocp.args.JsonSave(meta))
    try:
      self.manager.save(int(step), args=args, force=True)
    except Exception as e:  # pylint: disable=broad-except
      self._raise_save_error(step, e)
    self._pending = int(step)

  def _check_space(self, step: int, items):
    """Fails before writing when the checkpoint cannot fit: it needs about
    the size of the previous one (or of its arrays, for the first)."""
    steps = self.complete_steps()
    if steps:
      need = _size_on_disk(os.path.join(self.directory, str(steps[-1])))
      how = f"the size of checkpoint {steps[-1]}"
    else:
      need = sum(x.size * x.dtype.itemsize
                 for x in jax.tree_util.tree_leaves(items))
      how = "the size of its arrays"
    self._need = f"about {_mb(need)} ({how})"
    free = shutil.disk_usage(self.directory).free
    if free < need:
      raise self._save_error(
          step, f"{self.directory} has {_mb(free)} free and a checkpoint of "
          f"this run takes {self._need}")

  def _finish_pending(self):
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      step, self._pending = self._pending, None
      self._raise_save_error(step, e)
    self._pending = None

  def _raise_save_error(self, step, e: BaseException):
    if _is_disk_full(e):
      free = shutil.disk_usage(self.directory).free
      raise self._save_error(
          step, f"no space left on device ({_mb(free)} free; a checkpoint of "
          f"this run takes {self._need} plus its metadata)") from e
    raise self._save_error(step, f"{type(e).__name__}: {e}") from e

  def _save_error(self, step, why: str) -> CheckpointSaveError:
    steps = [s for s in self.complete_steps() if step is None or s < step]
    if not steps:
      prev = ("There is no earlier checkpoint: the run restarts from step 0. "
              "Free some space (or use a --workdir on a larger disk) and run "
              "the same command.")
    else:
      damage = self.find_damage(steps[-1])
      prev = (f"The previous checkpoint (step {steps[-1]}) is intact (checked:"
              f" every file present, non-empty and its metadata readable). "
              f"Free some space (or move the workdir to a larger disk) and run"
              f" the same command to resume from it." if damage is None else
              f"The previous checkpoint (step {steps[-1]}) is damaged too: "
              f"{damage}.")
    return CheckpointSaveError(
        f"Could not save the checkpoint of step {step} in {self.directory}: "
        f"{why}. {prev}")

  def wait(self):
    self._finish_pending()

  def close(self):
    try:
      self._finish_pending()
    finally:
      self.manager.close()
      self._log.removeFilter(_not_disk_full_report)

  # --------------------------------------------------------------- restore

  def find_damage(self, step: int) -> Optional[str]:
    """What is wrong with the files of complete step ``step`` (None: they
    look intact): a missing item, an empty file, unreadable metadata."""
    root = os.path.join(self.directory, str(step))
    for item in orbax.ITEMS:
      if not os.path.isdir(os.path.join(root, item)):
        return f"{item}/ is missing"
    for dirpath, _, files in os.walk(root):
      for f in sorted(files):
        path = os.path.join(dirpath, f)
        rel = os.path.relpath(path, root)
        if os.path.getsize(path) == 0:
          return f"{rel} is empty (0 bytes)"
        if f in _JSON_FILES or os.path.basename(dirpath) == "array_metadatas":
          try:
            with open(path) as fh:
              json.load(fh)
          except (ValueError, UnicodeDecodeError) as e:
            return f"{rel} is not valid JSON ({e})"
    try:
      self.manager.item_metadata(int(step))
    except Exception as e:  # pylint: disable=broad-except
      return f"Orbax cannot read its metadata ({type(e).__name__}: {e})"
    return None

  def check_matches(self, step: int, abstract_items: Dict[str, Any]):
    """Raises ValueError naming the leaves when ``step`` holds another train
    state (model, optimizer...) than ``abstract_items``."""
    meta = self.manager.item_metadata(int(step))
    got, want = {}, {}
    for item in ("variables", "train"):
      tree = getattr(meta[item], "tree", meta[item])
      got.update({f"{item}/{k}": tuple(v.shape)
                  for k, v in _leaf_shapes(tree).items()})
      want.update({f"{item}/{k}": tuple(v.shape) for k, v in
                   _leaf_shapes(abstract_items[item]).items()})
    try:
      check_keys(got, want, "the train state of this config")
    except ValueError as e:
      raise ValueError(
          f"Checkpoint step {step} in {self.directory} does not match the "
          f"train state of this config (a different model, optimizer or "
          f"gradient clipping than the run that wrote it?). Resume with the "
          f"original config or use a new --workdir.\n{e}") from None

  def set_aside(self, step: int, why: str) -> str:
    """Moves step ``step`` out of the way (to ``checkpoints.set_aside/``),
    so a resumed run can write that step again; returns where."""
    dest_dir = os.path.join(os.path.dirname(self.directory), SET_ASIDE)
    os.makedirs(dest_dir, exist_ok=True)
    dest = os.path.join(dest_dir, f"{step}-{why}")
    k = 1
    while os.path.exists(dest):
      k += 1
      dest = os.path.join(dest_dir, f"{step}-{why}-{k}")
    os.rename(os.path.join(self.directory, str(step)), dest)
    return dest

  def resume_step(self, abstract_items: Dict[str, Any],
                  resume_from_step: Optional[int] = None, *,
                  primary: bool = True,
                  sync: Callable[[Optional[int]], None] = lambda step: None
                  ) -> Tuple[Optional[int], List[str]]:
    """The step to resume from (None: start afresh) and what was done.

    The newest complete step whose files are intact, or
    ``resume_from_step`` (0: start afresh). Damaged steps, and with
    ``resume_from_step`` the newer ones, are moved to ``checkpoints.set_aside``
    by the ``primary`` process. ``sync(step)`` is a barrier of every process
    (that also checks they all chose the same step), before and after the
    moves.

    Raises:
      DamagedCheckpointError: ``resume_from_step`` is damaged, or every
        checkpoint is.
      ValueError: the chosen step holds another train state, or
        ``resume_from_step`` does not exist.
    """
    steps = sorted(self.all_steps(), reverse=True)
    notes, moves, chosen = [], [], None
    if resume_from_step is not None:
      n = int(resume_from_step)
      if n and n not in steps:
        raise ValueError(
            f"config.resume_from_step={n}: there is no complete checkpoint of "
            f"step {n} in {self.directory}; complete steps: {sorted(steps)} "
            f"(0 starts afresh).")
      if n:
        damage = self.find_damage(n)
        if damage is not None:
          raise DamagedCheckpointError(
              f"Checkpoint step {n} in {self.directory} (config."
              f"resume_from_step) is damaged: {damage}.")
        self.check_matches(n, abstract_items)
        chosen = n
      moves = [(s, f"newer-than-{n}" if n else "before-a-fresh-start")
               for s in steps if s > n or not n]
    else:
      for s in steps:
        damage = self.find_damage(s)
        if damage is None:
          self.check_matches(s, abstract_items)
          chosen = s
          break
        moves.append((s, "damaged"))
        notes.append(f"checkpoint step {s} in {self.directory} is damaged: "
                     f"{damage}.")
      if moves and chosen is None:
        raise DamagedCheckpointError(
            f"Every checkpoint in {self.directory} is damaged "
            f"({'; '.join(notes)}). Move them away, or pass "
            f"--config.resume_from_step=0 to set them aside and start afresh.")
    sync(chosen)  # every process has looked before anything moves
    for s, why in moves:
      dest = (self.set_aside(s, why) if primary else
              os.path.join(os.path.dirname(self.directory), SET_ASIDE))
      notes.append(f"moved step {s} to {dest}.")
    if moves:
      how = (f"config.resume_from_step={resume_from_step}"
             if resume_from_step is not None else "the newest intact one")
      notes.append(f"Resuming from step {chosen} ({how}); "
                   f"--config.resume_from_step=N picks another."
                   if chosen is not None else "Starting afresh.")
      sync(chosen)
      self.manager.reload()
    return chosen, notes

  def restore(self, step: int, abstract_items: Dict[str, Any]
              ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Restores ``step`` onto the shardings of ``abstract_items`` (trees of
    ``jax.ShapeDtypeStruct`` with ``sharding``): any mesh, any device count.

    Raises:
      ValueError: the step holds another train state (model, optimizer...).
      DamagedCheckpointError: its files cannot be read.
    """
    damage = self.find_damage(step)
    if damage is not None:
      raise DamagedCheckpointError(
          f"Checkpoint step {step} in {self.directory} is damaged: {damage}.")
    self.check_matches(step, abstract_items)
    args = ocp.args.Composite(
        variables=ocp.args.StandardRestore(abstract_items["variables"]),
        train=ocp.args.StandardRestore(abstract_items["train"]),
        meta=ocp.args.JsonRestore())
    try:
      out = self.manager.restore(int(step), args=args)
    except Exception as e:  # pylint: disable=broad-except
      raise DamagedCheckpointError(
          f"Checkpoint step {step} in {self.directory} could not be read: "
          f"{type(e).__name__}: {e}. Pass --config.resume_from_step=N to "
          f"resume from another step.") from e
    return {"variables": out["variables"], "train": out["train"]}, out["meta"]

  def restore_meta(self, step: int) -> Dict[str, Any]:
    return orbax.restore_meta(self.manager, step)

  def restore_variables_on(self, step: int, sharding) -> Any:
    """Restores only ``variables`` with every array on ``sharding``."""
    return orbax.restore_variables_on(self.manager, step, sharding)
