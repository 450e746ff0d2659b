"""Several processes training together: how they agree to stop, and how long
one waits for the others.

**Preemption.** A SIGTERM (a scheduler's preemption notice) to *any* process
stops *every* process after the same step, with a checkpoint; in
``train.py`` a first Ctrl-C does the same (a second one stops at once). The signal
handler only sets a flag. Every train step takes each process's flag as one
int32 per device and returns their maximum, replicated
(:func:`vit_jax.train.step.compile_steps`); after dispatching step ``s`` the
loop reads step ``s - 1``'s maximum, so every process reads the same value
and stops after the same step, with no separate sync point to miss.

JAX's preemption service (``multihost_utils.reached_preemption_sync_point``)
is not used. It agrees on ``max(last step each process reported) + 1`` and a
process stops only at that exact step; Orbax's asynchronous-checkpoint thread
also reports to it, from the background, the step of the checkpoint it is
finalising -- an older step than the one the training loop is at. A notice
arriving just then made the processes agree on a step the fastest process had
already passed: the others stopped there and waited forever in the
checkpoint's barrier while it waited in the next step's all-reduce.

**Bounded waits.** Every place where a process waits for the others (a
step's all-reduce, evaluation, a checkpoint barrier or commit, start-up,
restore) runs inside :meth:`Waits.waiting`. A watchdog thread ends the process
when a wait exceeds ``config.peer_timeout_seconds``, with an error naming the
process, the step and what it waited for: the wait itself (a gloo collective,
a coordination-service barrier) cannot be interrupted from Python.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Callable, List, Optional, Tuple

import numpy as np

EXIT_CODE = 1
BACKSTOP_S = 10.0  # after a wait's limit, if the watchdog could not speak

_sigterm = threading.Event()  # a stop request: SIGTERM, or a first Ctrl-C
_reason = []  # what asked first: "SIGTERM" or "Ctrl-C"


def _on_sigterm(signum, frame):
  del signum, frame
  if not _sigterm.is_set():
    _reason[:] = ["SIGTERM"]
  _sigterm.set()


def _on_ctrl_c(signum, frame):
  """A first Ctrl-C (SIGINT) is a stop request, as SIGTERM: every process
  saves a checkpoint after the same step and exits; a second one raises
  KeyboardInterrupt at once (``train.py`` then names the last complete
  checkpoint)."""
  del signum, frame
  signal.signal(signal.SIGINT, signal.default_int_handler)
  if not _sigterm.is_set():
    _reason[:] = ["Ctrl-C"]
  _sigterm.set()
  try:  # os.write: safe wherever the main thread was interrupted
    os.write(2, b"\nCtrl-C: stopping after this step, with a checkpoint "
                b"(Ctrl-C again: stop now, losing the steps since the last "
                b"checkpoint)\n")
  except OSError:
    pass


def stop_reason() -> str:
  """What asked this process to stop: ``'SIGTERM'`` or ``'Ctrl-C'``
  (``'SIGTERM'`` where the request came from another process's vote)."""
  return _reason[0] if _reason else "SIGTERM"


def install_sigterm_handler(ctrl_c: bool = False) -> bool:
  """Makes SIGTERM (and with ``ctrl_c`` a first Ctrl-C) a stop request
  (see :class:`Preemption`) from now on.

  ``train.py`` calls this first thing, so a notice during start-up counts too.
  Returns False outside the main thread (where Python cannot handle signals).
  """
  try:
    signal.signal(signal.SIGTERM, _on_sigterm)
    if ctrl_c:
      signal.signal(signal.SIGINT, _on_ctrl_c)
  except ValueError:  # not the main thread
    return False
  return True


class Preemption:
  """SIGTERM -> stop every process after the same step, with a checkpoint.

  Use as a context manager around the loop: it installs the handler (unless
  one is) and restores the previous one afterwards.
  """

  def __init__(self, data_sharding):
    self._sharding = data_sharding
    self._votes = {}
    self._old = None

  def __enter__(self):
    try:
      # Also replaces JAX's own SIGTERM handler (its preemption service),
      # if a caller initialised jax.distributed with the service on.
      self._old = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: never preempted
      self._old = None
    return self

  def __exit__(self, *exc):
    if self._old is not None and self._old is not _on_sigterm:
      signal.signal(signal.SIGTERM, self._old)
    _sigterm.clear()  # consumed by this run
    _reason.clear()

  @property
  def received(self) -> bool:
    """Whether this process has had a SIGTERM."""
    return _sigterm.is_set()

  def votes(self):
    """This process's vote (1 after a SIGTERM) on each of its devices, as a
    global array sharded like the batch."""
    import jax  # pylint: disable=import-outside-toplevel

    v = int(self.received)
    if v not in self._votes:
      local = np.full((len(self._sharding.addressable_devices),), v, np.int32)
      self._votes[v] = jax.make_array_from_process_local_data(
          self._sharding, local)
    return self._votes[v]


def _peer_lost(e: BaseException) -> bool:
  """A collective that failed because a peer's connection broke."""
  text = str(e)
  return type(e).__name__ == "JaxRuntimeError" and any(
      s in text for s in ("Gloo", "Connection reset", "Connection closed",
                          "Socket closed"))


def agree(value: Optional[int], what: str) -> Optional[int]:
  """Checks that every process holds the same ``value`` (a collective: run
  it inside :meth:`Waits.waiting`); returns it.

  Raises:
    ValueError: naming each process's value (e.g. processes that do not see
      the same workdir).
  """
  import jax  # pylint: disable=import-outside-toplevel

  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  got = multihost_utils.process_allgather(
      np.int32(-1 if value is None else value))
  values = [None if int(v) < 0 else int(v) for v in np.ravel(got)]
  if len(set(values)) > 1:
    raise ValueError(
        f"The processes disagree on {what}: "
        + ", ".join(f"process {i}: {v}" for i, v in enumerate(values))
        + ". Do they all see the same --workdir (a shared disk)?")
  return value


class Waits:
  """Bounds every wait of this process for the others.

  Args:
    timeout_s: the longest wait, in seconds (``<= 0``: unbounded).
    process_index: this process (None: not known yet).
    process_count: all processes (None: not known yet); with one there is
      nobody to wait for and nothing is watched.
    where: returns a sentence about what survives (the last complete
      checkpoint), added to the error.
    limit: the setting that sets ``timeout_s``, named in the error.
    prog: names the program in the error.
    exit_fn: ends the process (``os._exit``; replaceable in tests).
  """

  def __init__(self, timeout_s: float, *, process_index: Optional[int],
               process_count: Optional[int],
               where: Callable[[], str] = lambda: "",
               limit: str = "config.peer_timeout_seconds",
               prog: str = "train.py",
               exit_fn: Callable[[int], None] = os._exit):
    self.timeout_s = float(timeout_s)
    self.process_index = process_index
    self.process_count = process_count
    self.where = where
    self.limit = limit
    self.prog = prog
    self._exit = exit_fn
    self.enabled = (process_count is None or process_count > 1) and (
        self.timeout_s > 0)
    self._stack: List[Tuple[str, Optional[int], float]] = []
    self._cv = threading.Condition()
    self._thread = None
    self._closed = False

  @contextlib.contextmanager
  def waiting(self, what: str, step: Optional[int] = None):
    """Watches the enclosed wait for the other processes.

    Args:
      what: what the process waits for ("step 41's all-reduce ...").
      step: the training step, for the error.
    """
    if not self.enabled:
      yield
      return
    with self._cv:
      if self._thread is None:
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="vit_jax-waits")
        self._thread.start()
      self._stack.append((what, step, time.monotonic() + self.timeout_s))
      self._arm_backstop()
      self._cv.notify()
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      if _peer_lost(e):  # a collective's connection to a dead peer broke
        self._stop(self.message(what, step, cause=e))
      raise
    finally:
      with self._cv:
        self._stack.pop()
        self._arm_backstop()
        self._cv.notify()

  def _arm_backstop(self):
    """The watchdog thread needs the GIL; a wait inside native code that
    holds it would silence the watchdog. faulthandler's timer runs without
    the GIL: BACKSTOP_S after the watchdog's deadline it prints every
    thread's stack and ends the process (exit code 1)."""
    if self._stack:
      left = self._stack[-1][2] - time.monotonic()
      faulthandler.dump_traceback_later(max(1.0, left + BACKSTOP_S),
                                        exit=True)
    else:
      faulthandler.cancel_dump_traceback_later()

  def close(self):
    with self._cv:
      self._closed = True
      if self.enabled:
        faulthandler.cancel_dump_traceback_later()
      self._cv.notify()

  def message(self, what: str, step: Optional[int],
              cause: Optional[BaseException] = None) -> str:
    """The error: who waited, at which step, for what; what survives."""
    who = ("this process" if self.process_index is None else
           f"process {self.process_index} of {self.process_count}")
    at = f" at step {step}" if step is not None else ""
    where = self.where()
    where = f" {where}" if where else ""
    if cause is not None:
      first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
      return (f"{self.prog}: error: {who} lost another process{at} while "
              f"waiting for {what} ({type(cause).__name__}: {first}): it died "
              f"or was killed (see its log).{where}")
    return (f"{self.prog}: error: {who} waited {self.timeout_s:g} s{at} for "
            f"{what}, and stops: another process died, was stopped, is "
            f"stuck or never started (see its log).{where} The limit is "
            f"{self.limit}={self.timeout_s:g}.")

  def _stop(self, msg: str):
    try:
      sys.stdout.flush()
    except Exception:  # pylint: disable=broad-except
      pass
    print(msg, file=sys.stderr, flush=True)
    self._exit(EXIT_CODE)

  def _watch(self):
    with self._cv:
      while not self._closed:
        if not self._stack:
          self._cv.wait()
          continue
        what, step, deadline = self._stack[-1]
        left = deadline - time.monotonic()
        if left > 0:
          self._cv.wait(left)
          continue
        self._stop(self.message(what, step))
        return
