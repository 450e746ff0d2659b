"""Kill-and-resume through ``train.py``: a run SIGKILLed after a checkpoint,
resumed, SIGTERMed (which saves and exits cleanly), and resumed again ends
with exactly the metrics.jsonl numbers of an uninterrupted run. A
half-written checkpoint left in the directory is never loaded. Every run
compiles afresh (no shared compilation cache), as a real restart would."""

import os
import re
import signal
import subprocess
import time

from train_helpers import (REPO, env, metric_rows, run, start_rows,
                           tiny_overrides, train_cmd)

TOTAL = 400


def _overrides():
  return tiny_overrides(total_steps=TOTAL, log_every=10, eval_every=100,
                        checkpoint_every=20, keep_checkpoints=3)


def _complete_steps(workdir):
  d = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(d):
    return []
  return sorted(int(n) for n in os.listdir(d) if n.isdigit() and
                os.path.exists(os.path.join(d, n, "commit_success.txt")))


def _start(workdir):
  return subprocess.Popen(train_cmd(str(workdir), _overrides()), cwd=REPO,
                          env=env(1, compile_cache=False),
                          stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _wait_for(cond, proc, timeout=300):
  t0 = time.time()
  while not cond():
    if proc.poll() is not None:
      out, err = proc.communicate()
      raise AssertionError(f"run ended early ({proc.returncode}):\n{out[-2000:]}"
                           f"\n{err[-3000:]}")
    if time.time() - t0 > timeout:
      proc.kill()
      raise AssertionError("timed out waiting for the run")
    time.sleep(0.02)


def _max_step(workdir):
  rows = metric_rows(workdir)
  return max(rows) if rows else 0


def test_killed_and_preempted_runs_resume_exactly(tmp_path):
  ref, work = tmp_path / "ref", tmp_path / "work"
  run(train_cmd(str(ref), _overrides()), timeout=600, compile_cache=False)
  expected = metric_rows(ref)
  assert sorted(expected)[-1] == TOTAL and len(expected) == TOTAL // 10

  # 1. SIGKILL as soon as a checkpoint is complete.
  p = _start(work)
  _wait_for(lambda: _complete_steps(work), p)
  p.kill()
  p.communicate()
  assert p.returncode == -signal.SIGKILL
  killed_at = _complete_steps(work)[-1]
  assert _max_step(work) < TOTAL, "the run finished before it was killed"
  # What a kill during an async save leaves behind: a temporary directory.
  junk = os.path.join(work, "checkpoints",
                      f"{killed_at + 20}.orbax-checkpoint-tmp-1")
  os.makedirs(os.path.join(junk, "variables"))
  open(os.path.join(junk, "variables", "garbage"), "w").write("half written")

  # 2. Resume; SIGTERM once it has trained a little further.
  p = _start(work)
  _wait_for(lambda: _max_step(work) >= killed_at + 30, p)
  p.send_signal(signal.SIGTERM)
  out, err = p.communicate(timeout=300)
  assert p.returncode == 0, err[-3000:]
  m = re.search(r"SIGTERM: saved a checkpoint at step (\d+)", out)
  assert m, out[-2000:]
  term_at = int(m.group(1))
  assert killed_at < term_at < TOTAL, (killed_at, term_at)
  assert _complete_steps(work)[-1] == term_at
  assert not os.path.exists(junk)  # cleaned up, never loaded

  # 3. Resume to the end.
  run(train_cmd(str(work), _overrides()), timeout=600, compile_cache=False)
  starts = [r["resumed_from_step"] for r in start_rows(work)]
  assert starts == [None, killed_at, term_at]
  got = metric_rows(work)
  assert sorted(got) == sorted(expected)
  for step in sorted(expected):
    assert got[step] == expected[step], (step, got[step], expected[step])
