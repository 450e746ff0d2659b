"""``--config.dataset=synthetic``: the training loop on random uint8 batches
made on the devices, with TensorFlow and tfds unimportable (as on a GPU
machine without them): steps, metrics, evaluation, Orbax checkpoints."""

import json
import os

import jax
import numpy as np

from train_helpers import PYTHON, cli_flags, run, tiny_overrides
from vit_jax.data import synthetic

# train.py with TensorFlow and tfds blocked: an import of either fails.
_BLOCKED = (
    "import os, runpy, sys\n"
    "sys.path.insert(0, os.getcwd())\n"
    "sys.modules['tensorflow'] = None\n"
    "sys.modules['tensorflow_datasets'] = None\n"
    "sys.argv = ['train.py'] + sys.argv[1:]\n"
    "try:\n"
    "  runpy.run_path('train.py', run_name='__main__')\n"
    "finally:\n"
    "  print('TF_MODULES', [m for m in sys.modules if m.startswith("
    "'tensorflow') and sys.modules[m] is not None])\n")


def test_synthetic_run_needs_no_tensorflow(tmp_path):
  o = tiny_overrides(dataset="synthetic", eval_batch_size=32,
                     tensorboard=True)
  o.pop("data_dir")
  p = run([PYTHON, "-c", _BLOCKED, "--config=configs/digits.py",
           f"--workdir={tmp_path}"] + cli_flags(o), timeout=600)
  assert "TF_MODULES []" in p.stdout, p.stdout[-2000:]
  assert "on synthetic (96 train / 32 eval, 1000 classes)" in p.stdout
  assert "no TensorBoard events" in p.stdout
  rows = [json.loads(line) for line in
          open(os.path.join(tmp_path, "metrics.jsonl"))]
  train = [r for r in rows if "train_loss" in r]
  evals = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in train] == [2, 4, 6]
  assert [r["step"] for r in evals] == [3, 6]
  assert all(r["eval_examples"] == 32 for r in evals)
  # Random labels over 1000 classes: the loss is about log(1000).
  assert all(abs(r["train_loss"] - np.log(1000)) < 0.5 for r in train)
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "6"]


def test_synthetic_batches_are_a_function_of_seed_and_step():
  """What makes a resumed synthetic run see the uninterrupted run's
  batches: batch k of a stream started at step s is batch s + k of one
  started at 0; another seed gives other batches; evaluation is fixed."""
  from ml_collections import config_dict  # pylint: disable=import-outside-toplevel
  cfg = config_dict.ConfigDict(dict(
      dataset="synthetic", batch_size=4, eval_batch_size=6, total_steps=5,
      image_size=8, seed=3))
  src = synthetic.get_source(cfg)
  assert (src.num_classes, src.num_train, src.num_eval) == (1000, 20, 6)
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  from_0 = synthetic.train_batches(cfg, src, sh, start_step=0)
  first = [jax.device_get(next(from_0)) for _ in range(4)]
  from_2 = jax.device_get(next(synthetic.train_batches(cfg, src, sh,
                                                       start_step=2)))
  for k in ("image", "label"):
    np.testing.assert_array_equal(from_2[k], first[2][k])
  assert first[0]["image"].dtype == np.uint8
  assert first[0]["image"].shape == (4, 8, 8, 3)
  assert first[0]["label"].dtype == np.int32
  assert not np.array_equal(first[0]["image"], first[1]["image"])
  assert first[0]["image"].min() < 30 and first[0]["image"].max() > 225
  cfg.seed = 4
  other = jax.device_get(next(synthetic.train_batches(cfg, src, sh,
                                                      start_step=0)))
  assert not np.array_equal(other["image"], first[0]["image"])
  e1, e2 = (jax.device_get(next(synthetic.eval_batches(cfg, src, sh)))
            for _ in range(2))
  np.testing.assert_array_equal(e1["image"], e2["image"])
  np.testing.assert_array_equal(e1["mask"], np.ones(6, np.float32))
