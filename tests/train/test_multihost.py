"""vit_jax.train.multihost in one process: the watchdog that bounds waits, the
SIGTERM flag and its vote. (Two real processes: test_train_multihost.py.)"""

import os
import signal
import threading
import time

import jax
import numpy as np
import pytest

import train_helpers  # noqa: F401  (repo on sys.path)
from vit_jax.train import multihost, sharding


class _Exit:
  """Records the watchdog's exit instead of ending the test process."""

  def __init__(self):
    self.codes = []
    self.called = threading.Event()

  def __call__(self, code):
    self.codes.append(code)
    self.called.set()


def _waits(timeout, exit_fn, **kw):
  return multihost.Waits(timeout, process_index=1, process_count=2,
                         exit_fn=exit_fn, **kw)


def test_a_wait_past_the_timeout_names_process_step_and_what(capfd):
  ended = _Exit()
  waits = _waits(0.3, ended, where=lambda: "The last complete checkpoint is "
                 "step 20 in /x/checkpoints: start every process again.")
  t0 = time.monotonic()
  with waits.waiting("step 40 of the other processes (its all-reduce)", 41):
    assert ended.called.wait(5)
  assert 0.25 < time.monotonic() - t0 < 3
  assert ended.codes == [multihost.EXIT_CODE]
  err = capfd.readouterr().err
  assert ("train.py: error: process 1 of 2 waited 0.3 s at step 41 for step "
          "40 of the other processes (its all-reduce), and stops" in err), err
  assert "The last complete checkpoint is step 20 in /x/checkpoints" in err
  assert "config.peer_timeout_seconds=0.3" in err
  waits.close()


def test_waits_within_the_timeout_and_one_process_never_stop():
  ended = _Exit()
  waits = _waits(0.5, ended)
  for step in range(5):  # each wait is short; the deadline restarts
    with waits.waiting("a short wait", step):
      time.sleep(0.2)
  time.sleep(0.6)  # nothing watched between waits
  assert not ended.called.is_set()
  waits.close()
  alone = multihost.Waits(0.01, process_index=0, process_count=1,
                          exit_fn=ended)
  with alone.waiting("nobody"):
    time.sleep(0.1)
  assert not alone.enabled and not ended.called.is_set()


class JaxRuntimeError(RuntimeError):
  """Stands in for jax.errors.JaxRuntimeError (matched by name)."""


def test_a_collective_that_loses_its_peer_stops_at_once(capfd):
  ended = _Exit()
  waits = _waits(60, ended, limit="--distributed_timeout")
  try:
    with waits.waiting("the evaluation's all-reduce", 60):
      raise JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: [pair.cc:538] "
                            "Read error [127.0.0.1]:1: Connection reset by "
                            "peer")
  except JaxRuntimeError:
    pass
  assert ended.codes == [multihost.EXIT_CODE]
  err = capfd.readouterr().err
  assert ("process 1 of 2 lost another process at step 60 while waiting for "
          "the evaluation's all-reduce (JaxRuntimeError: UNKNOWN: Gloo" in err)
  waits.close()


def test_sigterm_sets_the_vote_for_this_run_only():
  mesh = sharding.make_mesh(jax.devices()[:1])
  data = sharding.batch_sharding(mesh)
  before = signal.getsignal(signal.SIGTERM)
  with multihost.Preemption(data) as p:
    assert not p.received and int(np.asarray(p.votes()).max()) == 0
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.time() + 5
    while not p.received and time.time() < deadline:
      time.sleep(0.01)
    assert p.received
    votes = p.votes()
    assert votes.shape == (1,) and int(np.asarray(votes)[0]) == 1
  assert signal.getsignal(signal.SIGTERM) == before  # restored
  with multihost.Preemption(data) as p:
    assert not p.received  # consumed by the run that saw it
  assert multihost.agree(7, "a step") == 7  # one process agrees with itself


def test_a_first_ctrl_c_is_a_stop_request_a_second_one_interrupts(capfd):
  mesh = sharding.make_mesh(jax.devices()[:1])
  before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
  try:
    assert multihost.install_sigterm_handler(ctrl_c=True)
    with multihost.Preemption(sharding.batch_sharding(mesh)) as p:
      os.kill(os.getpid(), signal.SIGINT)
      for _ in range(1000):  # the handler runs between bytecodes
        if p.received:
          break
        time.sleep(0.001)
      assert p.received and multihost.stop_reason() == "Ctrl-C"
      assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
      with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    assert not p.received
    assert "Ctrl-C: stopping after this step, with a checkpoint" in (
        capfd.readouterr().err)
  finally:
    signal.signal(signal.SIGINT, before[0])
    signal.signal(signal.SIGTERM, before[1])
