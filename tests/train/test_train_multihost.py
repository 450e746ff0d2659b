"""Two local processes (jax.distributed on 127.0.0.1, gloo collectives, two
CPU devices each) train together through train.py's multi-process flags.

The signal and kill tests train on synthetic batches (coordination, not
data: no TensorFlow in their workers); the first trains on the digits.

A SIGTERM to either process -- mid-run, while a checkpoint is being saved,
during evaluation, before the first step -- stops both after the same step
with a checkpoint; the restarted pair resumes from it and ends with
identical parameters. A peer killed with SIGKILL makes the survivor stop
with an error naming the step and what it waited for, and the pair resumes
from the last complete checkpoint.

Every test has hard limits (a few seconds of slack over
``peer_timeout_seconds``), kills its children when it fails and shows their
stderr. Test-only hooks in the worker (``VIT_JAX_TEST_PAUSE``) hold one
process still at a chosen point, so the signal lands exactly there.
"""

import json
import os
import re
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

from train_helpers import PYTHON, REPO, env, start_rows, tiny_overrides

PEER_TIMEOUT = 20  # config.peer_timeout_seconds in these runs
START_LIMIT = 240  # s for a pair to start and reach a step (busy, not idle)
EXIT_LIMIT = PEER_TIMEOUT + 25  # s for both to exit once they should

_WORKER = r"""
import json, os, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from vit_jax.train import multihost
from vit_jax.data import console
multihost.install_sigterm_handler()  # as train.py does, first thing
console.lean_start_up()
console.quiet_native_logs()
pid, port, workdir, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
overrides = json.loads(overrides)
argv = ["train.py", "--config=configs/digits.py", f"--workdir={workdir}",
        f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
        f"--process_id={pid}", "--distributed_timeout=120"]
argv += [f"--config.{k}={v}" for k, v in overrides.items()]
sys.argv = argv  # config_flags finds --config.* overrides in sys.argv
import numpy as np
import train  # train.py: its flags and jax.distributed set-up
import jax
from vit_jax.train import checkpoint, step as train_step
from vit_jax import train as train_lib

def pause_at(kind, step):
  # Test hook: this process stands still at a chosen point for a while.
  open(os.path.join(workdir, f"paused_{kind}_{pid}"), "w").write(str(step))
  time.sleep(float(os.environ["PAUSE_SECONDS"]))

hook = os.environ.get("VIT_JAX_TEST_PAUSE", "")  # "<process>:<save|eval>:<step>"
if hook and hook.split(":")[0] == pid:
  _, kind, at = hook.split(":")
  if kind == "save":
    save = checkpoint.CheckpointManager.save
    def paused_save(self, step, *a, **k):
      save(self, step, *a, **k)
      if step == int(at):
        pause_at("save", step)
    checkpoint.CheckpointManager.save = paused_save
  elif kind == "eval":
    evaluate = train_step.evaluate
    def paused_evaluate(*a, **k):
      out = evaluate(*a, **k)
      pause_at("eval", at)
      return out
    train_step.evaluate = paused_evaluate
open(os.path.join(workdir, f"started_{pid}"), "w").write("")
train.flags.FLAGS(argv)
train._init_distributed()
assert jax.process_count() == 2 and len(jax.devices()) == 4
out = train_lib.train_and_evaluate(train._CONFIG.value, workdir)
flat = {jax.tree_util.keystr(k): np.asarray(v.addressable_data(0))
        for k, v in jax.tree_util.tree_leaves_with_path(out["state"].params)}
np.savez(os.path.join(workdir, f"params_{pid}.npz"), **flat)
print("RESULT " + json.dumps({"step": out["step"], "preempted": out["preempted"],
                              "eval_accuracy": out.get("eval_accuracy"),
                              "train_loss": out.get("train_loss")}), flush=True)
"""


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _overrides(data="synthetic", **kw):
  """The pair's run: 120 steps of the tiny model. The signal and kill tests
  check coordination, not data: they train on ``synthetic`` batches made on
  the devices (no TensorFlow in the workers: 5-6 s of CPU less per
  process); the digits (tf.data, each process its own rows of a real
  split) in :func:`test_two_processes_train_together`."""
  o = tiny_overrides(total_steps=120, log_every=10, eval_every=60,
                     checkpoint_every=20, peer_timeout_seconds=PEER_TIMEOUT)
  if data == "synthetic":
    del o["data_dir"]
    o["dataset"] = "synthetic"
  o.update(kw)
  return o


class Pair:
  """Two workers on one workdir; their output goes to files, so a stuck
  child can never block the test on a full pipe."""

  def __init__(self, workdir, overrides, pause=None, pause_seconds=4.0):
    self.workdir = workdir
    port = _free_port()
    e = env(devices=2)
    if pause:
      e["VIT_JAX_TEST_PAUSE"] = pause
      e["PAUSE_SECONDS"] = str(pause_seconds)
    self.run = len([n for n in os.listdir(workdir) if n.startswith("out_")])
    self.procs, self.logs = [], []
    for i in range(2):
      out = open(workdir / f"out_{self.run}_{i}.txt", "w")
      err = open(workdir / f"err_{self.run}_{i}.txt", "w")
      self.logs.append((out, err))
      self.procs.append(subprocess.Popen(
          [PYTHON, "-c", _WORKER, str(i), str(port), str(workdir),
           json.dumps(overrides)], cwd=REPO, env=e, stdout=out, stderr=err))

  def text(self, i, what="err"):
    return open(self.workdir / f"{what}_{self.run}_{i}.txt").read()

  def report(self) -> str:
    return "\n".join(
        f"--- process {i} (returncode {p.poll()}) stderr:\n"
        f"{self.text(i)[-4000:]}\n--- stdout:\n{self.text(i, 'out')[-1500:]}"
        for i, p in enumerate(self.procs))

  def kill(self):
    for p in self.procs:
      if p.poll() is None:
        p.kill()
    for p in self.procs:
      p.wait()
    for out, err in self.logs:
      out.close()
      err.close()

  def wait_for(self, cond, what, limit=START_LIMIT):
    """Polls ``cond`` while both run; fails (killing both) after ``limit``
    seconds or if a process ends first."""
    t0 = time.time()
    while not cond():
      if any(p.poll() is not None for p in self.procs):
        self.kill()
        pytest.fail(f"a process ended before {what}:\n{self.report()}")
      if time.time() - t0 > limit:
        self.kill()
        pytest.fail(f"no {what} within {limit} s:\n{self.report()}")
      time.sleep(0.02)

  def finish(self, limit=EXIT_LIMIT):
    """Waits (at most ``limit`` s) for both to exit; kills both on timeout.
    Returns the return codes."""
    deadline = time.time() + limit
    for p in self.procs:
      try:
        p.wait(timeout=max(0.1, deadline - time.time()))
      except subprocess.TimeoutExpired:
        self.kill()
        pytest.fail(f"the processes did not exit within {limit} s of when "
                    f"they should (a hang):\n{self.report()}")
    self.kill()  # closes the logs
    return [p.returncode for p in self.procs]

  def results(self, limit=EXIT_LIMIT):
    rcs = self.finish(limit)
    assert rcs == [0, 0], self.report()
    out = []
    for i in range(2):
      lines = [x for x in self.text(i, "out").splitlines()
               if x.startswith("RESULT ")]
      assert lines, self.report()
      out.append(json.loads(lines[-1][len("RESULT "):]))
    return out


def _logged_step(workdir):
  try:
    rows = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
  except (FileNotFoundError, json.JSONDecodeError):
    return 0
  return max([r["step"] for r in rows if "train_loss" in r] or [0])


def _complete_steps(workdir):
  from vit_jax.train import checkpoint
  return checkpoint.CheckpointManager(
      str(workdir / "checkpoints"), read_only=True).all_steps()


def _run(workdir, overrides, **kw):
  pair = Pair(workdir, overrides, **kw)
  try:
    return pair.results(limit=START_LIMIT)
  finally:
    pair.kill()


def _stopped_together(outs, after):
  assert outs[0]["preempted"] and outs[1]["preempted"], outs
  stop = outs[0]["step"]
  assert outs[1]["step"] == stop and after < stop < 120, outs
  return stop


def test_two_processes_train_together(tmp_path):
  """SIGTERM to process 1 mid-run; the restarted pair ends like one run."""
  total = 120
  overrides = _overrides(data="digits")
  pair = Pair(tmp_path, overrides)
  pair.wait_for(lambda: _logged_step(tmp_path) >= 30, "step 30")
  pair.procs[1].send_signal(signal.SIGTERM)  # preempt the non-primary process
  first = pair.results()
  stop = _stopped_together(first, 30)
  assert max(_complete_steps(tmp_path)) == stop

  outs = _run(tmp_path, overrides)  # resume, run to the end
  assert outs[0] == outs[1] and outs[0]["step"] == total
  a = np.load(tmp_path / "params_0.npz")
  b = np.load(tmp_path / "params_1.npz")
  assert sorted(a.files) == sorted(b.files) and len(a.files) > 10
  for k in a.files:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)

  starts = start_rows(tmp_path)  # process 0 alone writes metrics.jsonl
  assert [r["resumed_from_step"] for r in starts] == [None, stop]
  facts = starts[0]
  assert facts["num_processes"] == 2 and facts["num_devices"] == 4
  assert facts["local_batch_size"] == 8 and facts["global_batch_size"] == 16
  rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
  evals = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in evals] == [60, 120]
  assert all(r["eval_examples"] == 359 for r in evals)
  assert evals[-1]["eval_accuracy"] == outs[0]["eval_accuracy"]
  # The shared checkpoint holds the same parameters.
  from vit_jax.weights import orbax
  _, variables, info = orbax.load_for_inference(str(tmp_path))
  assert info["step"] == total
  np.testing.assert_array_equal(variables["params"]["head"]["kernel"],
                                a["['head']['kernel']"])


def _sigterm_while_paused(workdir, process, kind, step):
  """Holds ``process`` still after its ``kind`` ('save' or 'eval') at
  ``step`` and sends it SIGTERM there; returns the step both stopped after
  (checkpointed)."""
  pair = Pair(workdir, _overrides(), pause=f"{process}:{kind}:{step}")
  pair.wait_for(lambda: (workdir / f"paused_{kind}_{process}").exists(),
                f"process {process} pausing after its step-{step} {kind}")
  pair.procs[process].send_signal(signal.SIGTERM)
  stop = _stopped_together(pair.results(), step)
  assert max(_complete_steps(workdir)) == stop
  return stop


def test_sigterm_while_a_checkpoint_is_saved(tmp_path):
  """The interleaving that hung: process 1 is still at step 40 (its save)
  while process 0 runs ahead and its Orbax thread finalises checkpoint 40,
  when the notice arrives. Both must stop after the same step."""
  _sigterm_while_paused(tmp_path, 1, "save", 40)


def test_sigterm_to_process_0_during_eval(tmp_path):
  _sigterm_while_paused(tmp_path, 0, "eval", 60)
  rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows if "eval_loss" in r] == [60]


def test_sigterm_before_the_first_step(tmp_path):
  pair = Pair(tmp_path, _overrides())
  pair.wait_for(lambda: (tmp_path / "started_0").exists(),
                "process 0 starting")
  pair.procs[0].send_signal(signal.SIGTERM)
  outs = pair.results(limit=START_LIMIT)
  assert outs[0]["preempted"] and outs[1]["preempted"], outs
  assert outs[0]["step"] == outs[1]["step"] == 2  # the vote is read a step on
  assert max(_complete_steps(tmp_path)) == 2


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_peer_stops_the_survivor_and_the_pair_resumes(tmp_path,
                                                                victim):
  overrides = _overrides(total_steps=400)
  pair = Pair(tmp_path, overrides)
  pair.wait_for(lambda: _logged_step(tmp_path) >= 30, "step 30")
  pair.procs[victim].kill()
  t0 = time.time()
  rcs = pair.finish()
  survivor = 1 - victim
  err = pair.text(survivor)
  assert rcs[victim] == -signal.SIGKILL, pair.report()
  assert rcs[survivor] != 0, pair.report()
  steps = _complete_steps(tmp_path)
  assert steps, pair.report()
  last = max(steps)
  if victim == 1:
    # Process 0 waits in a collective that cannot complete: the watchdog.
    m = re.search(rf"train.py: error: process 0 of 2 waited {PEER_TIMEOUT} s "
                  rf"at step (\d+) for (.+?), and stops: another process died",
                  err)
    assert m, pair.report()
    assert rcs[survivor] == 1 and time.time() - t0 < EXIT_LIMIT
  else:
    # The coordinator died: gloo fails at once, and JAX's own client ends
    # the process too (whichever comes first speaks).
    assert ("train.py: error: process 1 of 2 lost another process" in err or
            "another task died" in err), pair.report()
  if "train.py: error:" in err:
    assert (f"The last complete checkpoint is step {last} in "
            f"{tmp_path / 'checkpoints'}" in err), pair.report()

  from vit_jax.weights import orbax
  _, _, info = orbax.load_for_inference(str(tmp_path))
  assert info["step"] == last
  outs = _run(tmp_path, _overrides(total_steps=last + 20))
  assert outs[0]["step"] == outs[1]["step"] == last + 20
  assert [r["resumed_from_step"] for r in start_rows(tmp_path)] == [None, last]
