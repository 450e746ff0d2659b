"""Two local processes (jax.distributed on 127.0.0.1, gloo collectives, two
CPU devices each) train together through train.py's multi-process flags and
end with identical parameters; evaluation counts every example once."""

import json
import os
import socket
import subprocess

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
print(json.dumps({"eval_accuracy": out["eval_accuracy"],
                  "train_loss": out["train_loss"]}))
"""


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_train_together(tmp_path):
  overrides = tiny_overrides(total_steps=4, eval_every=4, checkpoint_every=4)
  port = _free_port()
  procs = [subprocess.Popen(
      [PYTHON, "-c", _WORKER, str(i), str(port), str(tmp_path),
       json.dumps(overrides)], cwd=REPO, env=env(devices=2),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
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
  assert outs[0] == outs[1]

  a = np.load(tmp_path / "params_0.npz")
  b = np.load(tmp_path / "params_1.npz")
  assert sorted(a.files) == sorted(b.files) and len(a.files) > 10
  for k in a.files:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)

  (facts,) = start_rows(tmp_path)  # process 0 alone writes metrics.jsonl
  assert facts["num_processes"] == 2 and facts["num_devices"] == 4
  assert facts["local_batch_size"] == 8 and facts["global_batch_size"] == 16
  rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
  (ev,) = [r for r in rows if "eval_loss" in r]
  assert ev["eval_examples"] == 359 and ev["eval_accuracy"] == outs[0]["eval_accuracy"]
  # The shared checkpoint holds the same parameters.
  from vit_jax import checkpoint
  _, variables, info = checkpoint.load_for_inference(str(tmp_path))
  assert info["step"] == 4
  k = "['head']['kernel']"
  np.testing.assert_array_equal(variables["params"]["head"]["kernel"], a[k])
  assert os.path.isdir(tmp_path / "checkpoints" / "4")
