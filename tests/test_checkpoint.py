"""Checkpoint manager round trips, half-written checkpoints, and the errors
of load_for_inference. (Loading real training runs: test_train.py.)"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import checkpoint


def _items(x):
  return {"variables": {"params": {"w": jnp.full((4, 3), x, jnp.float32)}},
          "train": {"step": jnp.int32(x), "opt_state": {"m": jnp.ones((3,)) * x},
                    "acc": {"loss_sum": jnp.float32(x / 2)}}}


def _abstract(items):
  s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), items)


def test_save_restore_keep_last_n(tmp_path):
  m = checkpoint.CheckpointManager(str(tmp_path / "ck"), keep=2)
  for step in (1, 2, 3):
    m.save(step, _items(step), {"step": step, "label_names": ["a", "b"]})
  m.wait()
  assert m.all_steps() == [2, 3] and m.latest_step() == 3
  items, meta = m.restore(2, _abstract(_items(0)))
  np.testing.assert_array_equal(items["variables"]["params"]["w"],
                                np.full((4, 3), 2.0))
  assert int(items["train"]["step"]) == 2
  assert float(items["train"]["acc"]["loss_sum"]) == 1.0
  assert meta == {"step": 2, "label_names": ["a", "b"]}
  m.close()


def test_half_written_checkpoint_is_never_loaded(tmp_path):
  ck = tmp_path / "ck"
  m = checkpoint.CheckpointManager(str(ck), keep=3)
  m.save(1, _items(1), {"step": 1})
  m.close()
  # What a kill during an (async) save leaves: a temporary step directory.
  tmp = ck / "7.orbax-checkpoint-tmp-1795000000000000"
  (tmp / "variables").mkdir(parents=True)
  (tmp / "variables" / "garbage").write_text("half written")
  assert checkpoint.CheckpointManager(str(ck), read_only=True).latest_step() == 1
  with pytest.raises(ValueError, match="half-written"):
    checkpoint.load_for_inference(str(tmp))
  # A training manager (not read-only) resumes from step 1 and deletes the
  # temporary directory (before its first save).
  m = checkpoint.CheckpointManager(str(ck), keep=3)
  assert m.latest_step() == 1
  m.save(2, _items(2), {"step": 2})
  m.wait()
  assert m.all_steps() == [1, 2] and not tmp.exists()
  m.close()


def test_load_for_inference_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    checkpoint.load_for_inference(str(tmp_path / "nope"))
  with pytest.raises(FileNotFoundError, match="No checkpoint found at"):
    checkpoint.load_for_inference(str(tmp_path))
  # A workdir whose checkpoints/ holds only a temporary directory.
  (tmp_path / "run" / "checkpoints" / "3.orbax-checkpoint-tmp-1").mkdir(
      parents=True)
  with pytest.raises(FileNotFoundError, match="No complete checkpoint"):
    checkpoint.load_for_inference(str(tmp_path / "run"))
  with pytest.raises(FileNotFoundError, match="No checkpoint found at"):
    (tmp_path / "file.txt").write_text("x")
    checkpoint.load_for_inference(str(tmp_path / "file.txt"))


def test_resolve_checkpoint_paths(tmp_path):
  ck = tmp_path / "run" / "checkpoints"
  (ck / "12" / "variables").mkdir(parents=True)
  assert checkpoint.resolve_checkpoint(str(tmp_path / "run")) == (str(ck), None)
  assert checkpoint.resolve_checkpoint(str(ck)) == (str(ck), None)
  assert checkpoint.resolve_checkpoint(str(ck / "12")) == (str(ck), 12)
  assert os.path.isdir(ck)
