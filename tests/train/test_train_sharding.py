"""Sharding: 1 device vs 8 host devices, FSDP vs data parallel, gradient
accumulation, and resuming on a different device count give the same losses.

Runs in a subprocess with ``--xla_force_host_platform_device_count=8``.
"""

import numpy as np
import pytest

from train_helpers import run_python, tiny_overrides

# Every test reads one module fixture's run: one pytest-xdist worker.
pytestmark = pytest.mark.xdist_group("sharding")

_CODE = r"""
import json, os, shutil, sys, tempfile
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import train_helpers as th
import jax
from vit_jax.train import metrics
from vit_jax import train as train_lib

assert len(jax.devices()) == 8, jax.devices()
base = dict(total_steps=4, log_every=1, eval_every=4, checkpoint_every=2)
root = tempfile.mkdtemp()

def run(name, devices, **kw):
  cfg = th.tiny_config(**dict(base, **kw))
  out = train_lib.train_and_evaluate(cfg, os.path.join(root, name),
                                     devices=devices)
  return out

def losses(name):
  rows = th.metric_rows(os.path.join(root, name))
  return {str(s): r for s, r in rows.items()}

res = {}
run("one", jax.devices()[:1])
run("dp8", jax.devices())
out = run("fsdp", jax.devices(), fsdp=4)
specs = [str(x.sharding.spec) for x in jax.tree_util.tree_leaves(out["state"].params)]
res["fsdp_sharded"] = sum("fsdp" in s for s in specs)
res["fsdp_mesh"] = th.start_rows(os.path.join(root, "fsdp"))[0]["mesh"]
opt = [str(x.sharding.spec) for x in jax.tree_util.tree_leaves(out["state"].opt_state)]
res["fsdp_opt_sharded"] = sum("fsdp" in s for s in opt)
run("accum", jax.devices(), grad_accum_steps=2)
# Resume dp8's step-2 checkpoint on 2 devices.
shutil.copytree(os.path.join(root, "dp8"), os.path.join(root, "resume2"))
shutil.rmtree(os.path.join(root, "resume2", "checkpoints", "4"))
run("resume2", jax.devices()[:2])
res["resume2_start"] = th.start_rows(os.path.join(root, "resume2"))[-1]
for name in ("one", "dp8", "fsdp", "accum", "resume2"):
  res[name] = losses(name)
try:
  run("bad", jax.devices(), batch_size=12)
except ValueError as e:
  res["bad_batch"] = str(e)
print(json.dumps(res))
"""


_RESULT = {}


@pytest.fixture
def result():
  """The run, once per process: kept outside pytest's fixture scopes, which
  pytest-xdist's worker tears down whenever it runs out of queued tests."""
  if not _RESULT:
    tiny_overrides()  # prepares the digits data in this process's data_dir
    _RESULT.update(run_python(_CODE, devices=8, timeout=900))
  return _RESULT


def _series(rows, key):
  return np.array([rows[str(s)][key] for s in (1, 2, 3, 4)])


def _close(a, b, key, rtol):
  np.testing.assert_allclose(_series(a, key), _series(b, key), rtol=rtol,
                             err_msg=key)


def test_one_device_equals_eight_devices(result):
  _close(result["one"], result["dp8"], "train_loss", 1e-5)
  _close(result["one"], result["dp8"], "grad_norm", 1e-4)
  assert result["one"]["4"]["eval_loss"] == pytest.approx(
      result["dp8"]["4"]["eval_loss"], rel=1e-5)
  assert result["one"]["4"]["eval_examples"] == 359 == result["dp8"]["4"]["eval_examples"]


def test_fsdp_equals_data_parallel(result):
  assert result["fsdp_mesh"] == {"data": 2, "fsdp": 4}
  assert result["fsdp_sharded"] > 10 and result["fsdp_opt_sharded"] > 10
  _close(result["fsdp"], result["dp8"], "train_loss", 1e-5)
  assert result["fsdp"]["4"]["eval_loss"] == pytest.approx(
      result["dp8"]["4"]["eval_loss"], rel=1e-5)


def test_gradient_accumulation_equals_one_big_batch(result):
  _close(result["accum"], result["dp8"], "train_loss", 1e-5)


def test_resume_on_a_different_device_count(result):
  start = result["resume2_start"]
  assert start["resumed_from_step"] == 2 and start["num_devices"] == 2
  _close(result["resume2"], result["dp8"], "train_loss", 1e-5)
  assert result["resume2"]["4"]["eval_accuracy"] == result["dp8"]["4"]["eval_accuracy"]


def test_batch_not_divisible_by_devices(result):
  msg = result["bad_batch"]
  assert "batch_size=12 is not divisible by the number of devices (8" in msg
  assert "multiple of 8" in msg
