"""Two local processes (jax.distributed on 127.0.0.1, gloo collectives, two
CPU devices each) train together through train.py's multi-process flags: a
SIGTERM to one of them stops both at the same step with a checkpoint, the
restarted pair resumes from it, and both end with identical parameters;
evaluation counts every example once."""

import json
import signal
import socket
import subprocess
import time

import numpy as np

from train_helpers import PYTHON, REPO, env, start_rows, tiny_overrides

_WORKER = r"""
import json, os, sys
import numpy as np
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
pid, port, workdir, overrides = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
overrides = json.loads(overrides)
argv = ["train.py", "--config=configs/digits.py", f"--workdir={workdir}",
        f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
        f"--process_id={pid}", "--distributed_timeout=120"]
argv += [f"--config.{k}={v}" for k, v in overrides.items()]
sys.argv = argv  # config_flags finds --config.* overrides in sys.argv
import train  # train.py: its flags and jax.distributed set-up
import jax
from vit_jax import train_lib
train.flags.FLAGS(argv)
train._init_distributed()
assert jax.process_count() == 2 and len(jax.devices()) == 4
out = train_lib.train_and_evaluate(train._CONFIG.value, workdir)
flat = {jax.tree_util.keystr(k): np.asarray(v.addressable_data(0))
        for k, v in jax.tree_util.tree_leaves_with_path(out["state"].params)}
np.savez(os.path.join(workdir, f"params_{pid}.npz"), **flat)
print(json.dumps({"step": out["step"], "preempted": out["preempted"],
                  "eval_accuracy": out.get("eval_accuracy"),
                  "train_loss": out.get("train_loss")}))
"""


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(tmp_path, overrides):
  port = _free_port()
  return [subprocess.Popen(
      [PYTHON, "-c", _WORKER, str(i), str(port), str(tmp_path),
       json.dumps(overrides)], cwd=REPO, env=env(devices=2),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]


def _finish(procs):
  outs = []
  for p in procs:
    try:
      out, err = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    assert p.returncode == 0, err[-4000:]
    outs.append(json.loads(out.strip().splitlines()[-1]))
  return outs


def _logged_step(workdir):
  try:
    rows = [json.loads(x) for x in open(workdir / "metrics.jsonl")]
  except (FileNotFoundError, json.JSONDecodeError):
    return 0
  return max([r["step"] for r in rows if "train_loss" in r] or [0])


def test_two_processes_train_together(tmp_path):
  total = 120
  overrides = tiny_overrides(total_steps=total, log_every=10, eval_every=60,
                             checkpoint_every=20)
  procs = _launch(tmp_path, overrides)
  t0 = time.time()
  while _logged_step(tmp_path) < 30:
    assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
    assert time.time() - t0 < 300, "timed out"
    time.sleep(0.05)
  procs[1].send_signal(signal.SIGTERM)  # preempt the non-primary process
  first = _finish(procs)
  assert first[0]["preempted"] and first[1]["preempted"]
  stop = first[0]["step"]
  assert stop == first[1]["step"] and 30 <= stop < total, first
  from vit_jax import checkpoint
  assert checkpoint.CheckpointManager(
      str(tmp_path / "checkpoints"), read_only=True).latest_step() == stop

  outs = _finish(_launch(tmp_path, overrides))  # resume, run to the end
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
  _, variables, info = checkpoint.load_for_inference(str(tmp_path))
  assert info["step"] == total
  np.testing.assert_array_equal(variables["params"]["head"]["kernel"],
                                a["['head']['kernel']"])
