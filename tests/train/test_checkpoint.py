"""Checkpoint manager round trips, half-written checkpoints, the errors of
load_for_inference; in training runs, damaged checkpoints (set aside, the run
resumes from the newest intact one or config.resume_from_step) and a full
disk. (Loading real training runs: test_train.py.)"""

import os
import re
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax.weights import orbax
from vit_jax.train import checkpoint


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
    orbax.load_for_inference(str(tmp))
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
    orbax.load_for_inference(str(tmp_path / "nope"))
  with pytest.raises(FileNotFoundError, match="No checkpoint found at"):
    orbax.load_for_inference(str(tmp_path))
  # A workdir whose checkpoints/ holds only a temporary directory.
  (tmp_path / "run" / "checkpoints" / "3.orbax-checkpoint-tmp-1").mkdir(
      parents=True)
  with pytest.raises(FileNotFoundError, match="No complete checkpoint"):
    orbax.load_for_inference(str(tmp_path / "run"))
  with pytest.raises(FileNotFoundError, match="No checkpoint found at"):
    (tmp_path / "file.txt").write_text("x")
    orbax.load_for_inference(str(tmp_path / "file.txt"))


def test_resolve_checkpoint_paths(tmp_path):
  ck = tmp_path / "run" / "checkpoints"
  (ck / "12" / "variables").mkdir(parents=True)
  assert orbax.resolve_checkpoint(str(tmp_path / "run")) == (str(ck), None)
  assert orbax.resolve_checkpoint(str(ck)) == (str(ck), None)
  assert orbax.resolve_checkpoint(str(ck / "12")) == (str(ck), 12)
  assert os.path.isdir(ck)


# --------------------------------------------------------------------------- #
# Training runs: damaged checkpoints, resume_from_step, a full disk.
# --------------------------------------------------------------------------- #


def _train(workdir, **kw):
  from train_helpers import tiny_config  # pylint: disable=import-outside-toplevel
  from vit_jax import train as train_lib  # pylint: disable=import-outside-toplevel
  cfg = tiny_config(**dict(dict(total_steps=9, checkpoint_every=3,
                              keep_checkpoints=3), **kw))
  return train_lib.train_and_evaluate(cfg, str(workdir),
                                      devices=jax.devices()[:1])


def _damage(step_dir):
  """What a crashed disk can leave: every file there, truncated."""
  for root, _, files in os.walk(step_dir):
    for f in files:
      open(os.path.join(root, f), "w").close()


def test_a_damaged_checkpoint_is_set_aside_and_the_run_resumes_before_it(
    tmp_path, capfd):
  from train_helpers import metric_rows, start_rows  # pylint: disable=import-outside-toplevel
  _train(tmp_path)
  expected = metric_rows(tmp_path)
  ck = tmp_path / "checkpoints"
  shutil.rmtree(ck / "9")  # as if killed after step 8; then 6 is damaged
  _damage(ck / "6")
  capfd.readouterr()
  out = _train(tmp_path)
  err = capfd.readouterr().err
  assert out["step"] == 9
  assert re.search(r"warning: checkpoint step 6 in \S+ is damaged: \S+ is "
                   r"empty \(0 bytes\)", err), err
  assert "Resuming from step 3 (the newest intact one)" in err, err
  assert "--config.resume_from_step=N" in err
  aside = tmp_path / "checkpoints.set_aside"
  assert sorted(os.listdir(aside)) == ["6-damaged"]
  assert [r["resumed_from_step"] for r in start_rows(tmp_path)] == [None, 3]
  assert metric_rows(tmp_path) == expected  # an exact resume from step 3

  # --config.resume_from_step: another step (newer ones set aside), a step
  # that is not there, a damaged one, and 0 (start afresh).
  _train(tmp_path, resume_from_step=3)
  assert sorted(os.listdir(aside)) == ["6-damaged", "6-newer-than-3",
                                       "9-newer-than-3"]
  assert start_rows(tmp_path)[-1]["resumed_from_step"] == 3
  assert metric_rows(tmp_path) == expected
  with pytest.raises(ValueError, match=r"resume_from_step=5: there is no "
                     r"complete checkpoint of step 5 .* complete steps: "
                     r"\[3, 6, 9\]"):
    _train(tmp_path, resume_from_step=5)
  _damage(ck / "6")
  with pytest.raises(checkpoint.DamagedCheckpointError,
                     match=r"step 6 .* \(config.resume_from_step\) is "
                     r"damaged: \S+ is empty"):
    _train(tmp_path, resume_from_step=6)
  _train(tmp_path, resume_from_step=0)
  assert start_rows(tmp_path)[-1]["resumed_from_step"] is None
  assert sorted(os.listdir(ck)) == ["3", "6", "9"]  # written afresh
  assert "3-before-a-fresh-start" in os.listdir(aside)


def test_every_checkpoint_damaged_is_an_error_that_says_how_to_go_on(
    tmp_path):
  _train(tmp_path, total_steps=3)
  _damage(tmp_path / "checkpoints" / "3")
  with pytest.raises(checkpoint.DamagedCheckpointError,
                     match=r"Every checkpoint .* is damaged .* "
                     r"--config.resume_from_step=0"):
    _train(tmp_path)


_DISK_SCRIPT = r"""
set -e
mount -t tmpfs -o size={size} tmpfs {disk}
set +e
{cmd} > {out}/stdout.txt 2> {out}/stderr.txt
echo $? > {out}/rc.txt
cp -a {disk}/run {out}/run
"""


def _on_a_small_disk(tmp_path, name, size, overrides):
  """Runs train.py with its workdir on a ``size`` tmpfs (in a user and mount
  namespace: no root needed where user namespaces are allowed); returns
  (return code, stderr, a copy of the workdir)."""
  import shlex  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel

  from train_helpers import REPO, env, tiny_overrides, train_cmd  # pylint: disable=import-outside-toplevel
  if shutil.which("unshare") is None:
    pytest.skip("needs util-linux's unshare to mount a small tmpfs")
  disk, out = tmp_path / f"{name}_disk", tmp_path / name
  disk.mkdir()
  out.mkdir()
  cmd = " ".join(shlex.quote(a) for a in train_cmd(
      str(disk / "run"), tiny_overrides(**overrides)))
  script = _DISK_SCRIPT.format(size=size, disk=disk, out=out, cmd=cmd)
  p = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh",
                      "-c", script], cwd=REPO, env=env(), capture_output=True,
                     text=True, timeout=300)
  if p.returncode != 0 or not (out / "rc.txt").exists():
    pytest.skip(f"cannot mount a tmpfs in a user namespace here: {p.stderr}")
  return (int((out / "rc.txt").read_text()),
          (out / "stderr.txt").read_text(), out / "run")


def test_a_full_disk_names_the_step_the_space_and_the_intact_checkpoint(
    tmp_path):
  o = dict(total_steps=9, checkpoint_every=3, keep_checkpoints=3)
  # Room for two checkpoints (about 0.3 MB each here), not a third.
  rc, err, run = _on_a_small_disk(tmp_path, "two_fit", "760k", o)
  assert rc == 1, err
  m = re.search(r"train.py: error: CheckpointSaveError: Could not save the "
                r"checkpoint of step (\d+) in (\S+)/checkpoints: \S+ has "
                r"([\d.]+ [KM]B) free and a checkpoint of this run takes about "
                r"([\d.]+ [KM]B) \(the size of checkpoint (\d+)\)\. The "
                r"previous checkpoint \(step (\d+)\) is intact", err)
  assert m, err
  failed, prev = int(m.group(1)), int(m.group(6))
  assert failed > prev == int(m.group(5))
  assert "RESOURCE_EXHAUSTED" not in err and "Traceback" not in err
  _, variables, info = orbax.load_for_inference(str(run))
  assert info["step"] == prev and set(variables) == {"params"}

  # The first checkpoint does not fit (Orbax runs out of space writing it):
  # the error says there is none to resume from.
  rc, err, run = _on_a_small_disk(tmp_path, "none_fit", "200k", o)
  assert rc == 1, err
  assert re.search(r"train.py: error: CheckpointSaveError: Could not save the "
                   r"checkpoint of step 3 in \S+: no space left on device "
                   r"\(\d+ KB free; a checkpoint of this run takes about \d+ "
                   r"KB \(the size of its arrays\) plus its metadata\)\. There "
                   r"is no earlier checkpoint", err), err
  assert "RESOURCE_EXHAUSTED" not in err and "Traceback" not in err


def test_load_for_inference_restores_onto_the_default_backend(tmp_path,
                                                              monkeypatch):
  """No jax.devices("cpu"): with JAX_PLATFORMS naming only an accelerator
  that call raises, and the variables must land on the default backend."""
  from vit_jax import models  # pylint: disable=import-outside-toplevel
  kw = dict(hidden_size=32, num_layers=1, num_heads=2, mlp_dim=64,
            num_classes=3, attention_impl="cudnn")  # trained on a GPU
  model = models.get_model("vit_ti_4", **kw)
  variables = model.clone(attention_impl=None).init(
      jax.random.key(0), jnp.zeros((1, 8, 8, 3)), train=False)
  m = checkpoint.CheckpointManager(str(tmp_path / "checkpoints"), keep=1)
  m.save(1, {"variables": variables, "train": {"step": jnp.int32(1)}},
         {"model_name": "vit_ti_4", "model_kwargs": kw, "image_size": 8,
          "mean": [0.5] * 3, "std": [0.5] * 3, "step": 1})
  m.close()

  real = jax.devices
  asked = []

  def devices(backend=None):
    asked.append(backend)
    if backend is not None:
      raise RuntimeError(f"Unknown backend {backend}")  # JAX_PLATFORMS=cuda
    return real()

  monkeypatch.setattr(jax, "devices", devices)
  loaded, got, info = orbax.load_for_inference(str(tmp_path))
  monkeypatch.setattr(jax, "devices", real)
  assert all(b is None for b in asked)
  for leaf in jax.tree_util.tree_leaves(got):
    assert leaf.devices() == {jax.local_devices()[0]}
  assert loaded.attention_impl is None and info["step"] == 1
  x = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
  np.testing.assert_allclose(loaded.apply(got, x, train=False),
                             model.clone(attention_impl=None).apply(
                                 variables, x, train=False), atol=1e-6)


def test_writes_orbax_abandoned_on_a_full_disk_print_nothing(monkeypatch):
  """What printed "RuntimeError: Event loop is closed" tracebacks around
  the full-disk message: a tensorstore write still running when the save's
  event loop closed (another write had failed) posts its result to the
  closed loop when it ends. Those, and only those, are kept quiet."""
  import asyncio  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel

  import tensorstore as ts  # pylint: disable=import-outside-toplevel
  seen = []
  monkeypatch.setattr(sys, "unraisablehook",
                      lambda u: seen.append(type(u.exc_value).__name__))
  checkpoint._install_orphan_filter()  # pylint: disable=protected-access
  checkpoint._install_orphan_filter()  # once, however often it is asked

  promise, future = ts.Promise.new()
  tasks = []

  async def save():
    tasks.append(asyncio.ensure_future(_await(future)))  # a write in flight
    await asyncio.sleep(0.01)
    raise OSError(28, "No space left on device")  # another write failed

  loop = asyncio.new_event_loop()
  with pytest.raises(OSError):
    loop.run_until_complete(save())
  loop.close()
  promise.set_result(1)  # the abandoned write ends
  for _ in range(100):
    time.sleep(0.01)
  assert seen == []
  sys.unraisablehook(types.SimpleNamespace(  # anything else still reaches
      exc_value=RuntimeError("other"), exc_type=RuntimeError,  # the old hook
      exc_traceback=None, err_msg=None, object=None))
  assert seen == ["RuntimeError"]
  tasks[0]._log_destroy_pending = False  # pylint: disable=protected-access


async def _await(future):
  await future
