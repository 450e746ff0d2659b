"""End-to-end training in this process (one device): outputs, inference
loading, fine-tuning from torchvision weights, and every bad input's error.

Multi-device, multi-process and kill/resume runs: test_train_sharding.py,
test_train_multihost.py, test_train_resume.py.
"""

import json
import os
import re

import jax
import numpy as np
import pytest

from train_helpers import (REPO, digits_data_dir, metric_rows, run,
                           start_rows, tiny_config, tiny_overrides, train_cmd)
from vit_jax.weights import orbax
from vit_jax.train import checkpoint, loop as train_loop
from vit_jax import convert, train as train_lib
from vit_jax.data import batches, preprocessing, sources

ONE = jax.devices()[:1]


def _train(config, workdir, devices=ONE):
  return train_lib.train_and_evaluate(config, str(workdir), devices=devices)


def _eval_accuracy(model, variables, info, config):
  src = sources.get_source(config)
  ds, _ = batches.eval_dataset(
      config, src, local_batch=64, process_index=0, process_count=1,
      mean=info["mean"], std=info["std"])
  correct = count = 0
  for b in batches.as_numpy(ds):
    logits = model.apply(variables, b["image"], train=False)
    correct += float(np.sum((np.argmax(logits, -1) == b["label"]) * b["mask"]))
    count += float(b["mask"].sum())
  return correct / count


def test_tiny_run_writes_everything_and_loads_for_inference(tmp_path):
  cfg = tiny_config(write_plots=True, tensorboard=True, keep_checkpoints=1)
  out = _train(cfg, tmp_path)
  assert out["step"] == 6 and not out["preempted"]

  files = os.listdir(tmp_path)
  assert {"config.json", "metrics.jsonl", "curves.png", "checkpoints"} <= set(files)
  assert any(f.startswith("events.out.tfevents") for f in files)
  assert json.load(open(tmp_path / "config.json"))["model"]["hidden_size"] == 32
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["6"]  # keep last 1

  (facts,) = start_rows(tmp_path)
  assert facts["step"] == 0 and facts["num_devices"] == 1
  assert facts["num_processes"] == 1 and facts["global_batch_size"] == 16
  assert facts["num_train_examples"] == 1438 and facts["num_classes"] == 10
  rows = metric_rows(tmp_path)
  assert sorted(rows) == [2, 3, 4, 6]
  for s in (2, 4, 6):
    assert {"train_loss", "learning_rate"} <= set(rows[s])
  for s in (3, 6):
    assert rows[s]["eval_examples"] == 359
    assert 0 <= rows[s]["eval_accuracy"] <= rows[s]["eval_top5_accuracy"] <= 1
  raw = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
  assert all(r["img_per_sec"] > 0 for r in raw if "train_loss" in r)
  # The 2 warmup steps are clamped away in a 6-step run (warmup <= 10%):
  # the learning rate of step 2 (index 1) is already cosine.
  assert facts["warmup_steps"] == 0
  assert rows[2]["learning_rate"] == pytest.approx(
      3e-3 * 0.5 * (1 + np.cos(np.pi / 6)), rel=1e-5)
  assert rows[6]["learning_rate"] < rows[4]["learning_rate"] < 3e-3

  model, variables, info = orbax.load_for_inference(str(tmp_path))
  assert info["step"] == 6 and info["image_size"] == 8
  assert info["label_names"] == [str(i) for i in range(10)]
  assert info["mean"] == (0.5, 0.5, 0.5) and info["std"] == (0.5, 0.5, 0.5)
  assert info["dataset"] == "digits" and set(variables) == {"params"}
  assert model.hidden_size == 32 and model.num_classes == 10
  acc = _eval_accuracy(model, variables, info, cfg)
  assert acc == pytest.approx(rows[6]["eval_accuracy"], abs=1e-6)

  # Running a finished run again trains nothing and adds a start row.
  again = _train(cfg, tmp_path)
  assert again["step"] == 6 and len(start_rows(tmp_path)) == 2
  assert metric_rows(tmp_path) == rows


def test_scanned_bf16_grad_accum_augmented_run_loads_unscanned(tmp_path):
  cfg = tiny_config(total_steps=2, eval_every=2, checkpoint_every=2,
                    grad_accum_steps=2, label_smoothing=0.1,
                    **{"model.scan_layers": True, "model.num_layers": 2,
                       "model.dtype": "bfloat16", "model.remat_policy": "full",
                       "model.dropout_rate": 0.1, "model.drop_path_rate": 0.1,
                       "pp.mixup_alpha": 0.2, "pp.randaugment_layers": 2,
                       "pp.crop": "inception", "pp.flip": True})
  out = _train(cfg, tmp_path)
  assert np.isfinite(out["train_loss"]) and out["eval_accuracy"] >= 0
  state = out["state"]
  assert state.params["Transformer"]["encoderblock"]["LayerNorm_0"]["scale"].shape == (2, 32)
  assert state.params["head"]["kernel"].dtype == np.float32  # f32 params
  model, variables, info = orbax.load_for_inference(str(tmp_path))
  assert not model.scan_layers and "encoderblock_1" in variables["params"]["Transformer"]
  np.testing.assert_array_equal(
      variables["params"]["Transformer"]["encoderblock_1"]["LayerNorm_0"]["scale"],
      np.asarray(state.params["Transformer"]["encoderblock"]["LayerNorm_0"]["scale"][1]))


def _tiny_torchvision_pth(path, image_size=16, patch=8, classes=5, seed=0):
  import torch
  import torchvision
  torch.manual_seed(seed)
  tv = torchvision.models.VisionTransformer(
      image_size=image_size, patch_size=patch, num_layers=2, num_heads=2,
      hidden_dim=32, mlp_dim=64, num_classes=classes)
  sd = tv.state_dict()
  torch.save(sd, path)
  return {k: v.numpy() for k, v in sd.items()}


def _finetune_overrides(pth, **kw):
  o = dict(model_name="vit_ti_8", image_size=24, init_weights=str(pth),
           optimizer="sgd", learning_rate=0.0, total_steps=1, eval_every=1,
           checkpoint_every=1, **{"model.num_layers": 2, "model.patch_size": 8})
  o.update(kw)
  return o


def test_finetune_starts_from_converted_torchvision_weights(tmp_path):
  pth = tmp_path / "tiny_vit.pth"
  sd = _tiny_torchvision_pth(pth)
  cfg = tiny_config(**_finetune_overrides(pth))
  _train(cfg, tmp_path / "run")
  model, variables, info = orbax.load_for_inference(str(tmp_path / "run"))
  # Normalisation follows the weights: torchvision's ImageNet statistics.
  assert info["mean"] == preprocessing.IMAGENET_MEAN
  assert info["std"] == preprocessing.IMAGENET_STD
  assert start_rows(tmp_path / "run")[0]["init_weights"] == str(pth)
  # With lr 0 one SGD step leaves the converted weights as they were; the
  # 2x2 position grid was resampled to 3x3 for 24-pixel images and the head
  # replaced by a zero 10-class head.
  _, ref = convert.from_torchvision(sd, "vit_ti_8", image_size=24,
                                    hidden_size=32, num_layers=2, num_heads=2,
                                    mlp_dim=64)
  got = variables["params"]
  assert got["Transformer"]["posembed_input"]["pos_embedding"].shape == (1, 10, 32)
  np.testing.assert_array_equal(got["head"]["kernel"], np.zeros((32, 10)))
  ref_p = dict(ref["params"])
  del ref_p["head"]
  got_p = {k: v for k, v in got.items() if k != "head"}
  jax.tree_util.tree_map(np.testing.assert_array_equal, got_p, ref_p)


def test_released_weights_offline_fail_fast(tmp_path, monkeypatch):
  import torch
  from vit_jax import weights
  from vit_jax.data import net
  monkeypatch.setattr(net, "online", lambda *a, **k: False)
  monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
  with pytest.raises(weights.CheckpointError, match=r"not cached at .*vit_b_16-"
                     r".*download.pytorch.org cannot be reached"):
    weights.load("torchvision:IMAGENET1K_V1", model_name="vit_b_16")


def test_finetune_bad_weights(tmp_path):
  with pytest.raises(ValueError, match="missing.pth.*no such file"):
    _train(tiny_config(**_finetune_overrides(tmp_path / "missing.pth")),
           tmp_path / "a")
  pth = tmp_path / "wide.pth"
  _tiny_torchvision_pth(pth)
  cfg = tiny_config(**_finetune_overrides(pth, **{"model.hidden_size": 64,
                                                  "model.mlp_dim": 64}))
  # Stated (on train.py's command line): refused, naming both values.
  with pytest.raises(ValueError, match=r"hidden_size 32 \(expected 64\)"):
    train_lib.train_and_evaluate(cfg, str(tmp_path / "b"), devices=ONE,
                                 stated=("model_name", "model.hidden_size",
                                         "model.num_heads"))
  # The recipe's alone: it does not describe these weights, so their width
  # (32, no usual number of heads) needs the heads said.
  with pytest.raises(ValueError, match=r"--config.model.num_heads=N"):
    _train(cfg, tmp_path / "b")
  cfg = tiny_config(**_finetune_overrides("NO_SUCH_WEIGHTS"))
  with pytest.raises(ValueError, match="torchvision has no weights "
                     "'NO_SUCH_WEIGHTS'"):
    _train(cfg, tmp_path / "c")


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
  _train(tiny_config(total_steps=3), tmp_path)
  changed = tiny_config(total_steps=12, grad_clip_norm=0.0)
  with pytest.raises(ValueError, match="does not match the train state"):
    _train(changed, tmp_path)
  bad = tiny_config(total_steps=12, learning_rate=1e30)
  with pytest.raises(FloatingPointError, match=r"non-finite loss.*step 3\)"):
    _train(bad, tmp_path)
  m = checkpoint.CheckpointManager(str(tmp_path / "checkpoints"), read_only=True)
  assert m.all_steps() == [3]
  _, variables, info = orbax.load_for_inference(str(tmp_path))
  assert info["step"] == 3
  assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(variables))
  # Diverging before the first checkpoint: there is none to point to.
  with pytest.raises(FloatingPointError, match=r"ending at step 2\. Stopped "
                     r"without saving; there is no checkpoint yet \(the first "
                     r"would have been at step 3\)"):
    _train(bad, tmp_path / "fresh")


def test_config_errors():
  cfg = tiny_config(batch_size=12)
  with pytest.raises(ValueError, match=r"batch_size=12 is not divisible by the "
                     r"number of devices \(8"):
    train_loop.validate_config(cfg, num_devices=8, num_processes=2)
  with pytest.raises(ValueError, match="grad_accum_steps=4"):
    train_loop.validate_config(tiny_config(batch_size=16, grad_accum_steps=4),
                               num_devices=8, num_processes=1)
  with pytest.raises(ValueError, match="eval_batch_size=20"):
    train_loop.validate_config(tiny_config(eval_batch_size=20), 8, 1)
  with pytest.raises(ValueError, match="total_steps=0 must be positive"):
    train_loop.validate_config(tiny_config(total_steps=0), 1, 1)
  with pytest.raises(ValueError, match="config.fsdp=3 must divide"):
    train_lib.make_mesh(list(range(8)), fsdp=3)


@pytest.mark.parametrize("field,value,match", [
    ("optimizer", "adam", "config.optimizer='adam'"),
    ("schedule", "step", "config.schedule='step'"),
    ("model.dtype", "float99", "config.model.dtype='float99'"),
    ("dataset", "no_such_dataset_xyz", "Unknown dataset 'no_such_dataset_xyz'"),
])
def test_bad_config_values(tmp_path, field, value, match):
  with pytest.raises(ValueError, match=match):
    _train(tiny_config(**{field: value}), tmp_path)


def test_cli_errors(tmp_path):
  """train.py: misspelt overrides, bad values, a missing config file, and a
  dataset that is not prepared: one line each, no traceback."""
  o = tiny_overrides(total_steps=1)
  p = run(train_cmd(str(tmp_path / "a"), dict(o, learning_rat=0.1)),
          check=False, timeout=120)
  assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
  assert p.stderr.startswith(
      "train.py: error: unknown config field 'learning_rat' (did you mean "
      "'learning_rate'"), p.stderr
  assert "; the fields of configs/digits.py are: async_checkpointing, b1, " in (
      p.stderr)
  assert ", model.hidden_size, " in p.stderr and ", pp.flip, " in p.stderr
  p = run(train_cmd(str(tmp_path / "a"), {"nope": 1, "model.hiden_size": 8}),
          check=False, timeout=120)
  assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
  assert p.stderr.startswith("train.py: error: unknown config field 'nope'; "
                             "the fields of configs/digits.py are: ")
  p = run(train_cmd(str(tmp_path / "a"), {"model.hiden_size": 8}),
          check=False, timeout=120)
  assert ("unknown config field 'model.hiden_size' (did you mean "
          "'model.hidden_size'") in p.stderr
  p = run(train_cmd(str(tmp_path / "a"), {"total_steps": "many"}),
          check=False, timeout=120)
  assert p.returncode == 2 and p.stderr.startswith(
      "train.py: error: flag --config.total_steps=many: invalid literal for "
      "int()"), p.stderr
  p = run(train_cmd(str(tmp_path / "a"), {}, config="configs/nope.py"),
          check=False, timeout=120)
  assert p.returncode == 2 and p.stderr.startswith(
      "train.py: error: cannot load the --config file: ") and (
          "configs/nope.py" in p.stderr), p.stderr
  assert "Traceback" not in p.stderr
  p = run(train_cmd(str(tmp_path / "b"), dict(o, dataset="cifar10",
                                              data_dir=str(tmp_path / "tfds"),
                                              download=False)),
          check=False, timeout=120)
  assert p.returncode == 1, p.stderr[-2000:]
  assert "Dataset 'cifar10' is not prepared" in p.stderr
  assert "tfds build cifar10" in p.stderr and str(tmp_path / "tfds") in p.stderr
  assert "Traceback" not in p.stderr
  assert os.path.isdir(REPO) and digits_data_dir()


def test_curves_of_a_run_stopped_before_its_first_eval(tmp_path):
  """One logged step and no evaluation (SIGTERM early): the picture draws
  the point and says there is no evaluation, without matplotlib's "No
  artists with labels found to put in legend" warning."""
  import warnings  # pylint: disable=import-outside-toplevel

  from vit_jax.train import metrics  # pylint: disable=import-outside-toplevel
  with open(tmp_path / metrics.METRICS_FILE, "w") as f:
    f.write(json.dumps({"step": 0, "kind": "start"}) + "\n")
    f.write(json.dumps({"step": 2, "train_loss": 2.3}) + "\n")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    path = metrics.write_plots(str(tmp_path))
  assert path and os.path.getsize(path) > 1000


# A config that presses Ctrl-C (SIGINT to itself, from the main thread as a
# terminal would) right after step 4's metrics row: once, or twice.
_CTRL_C_CONFIG = '''
import os, signal
from configs import digits
from vit_jax.train import metrics

def get_config(presses="1"):
  write = metrics.MetricsWriter.write

  def pressing(self, step, **row):
    write(self, step, **row)
    if step == 4 and "train_loss" in row:
      for _ in range(int(presses)):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(100):  # the handler runs between these calls
          pass
  metrics.MetricsWriter.write = pressing
  return digits.get_config()
'''


def test_ctrl_c_stops_with_one_line_and_how_to_resume(tmp_path):
  """A first Ctrl-C is a stop request, as SIGTERM: a checkpoint after the
  step, one line naming it and how to resume, exit status 130; a second
  one stops at once, with one line naming the last complete checkpoint
  (resuming from it: test_train_resume.py's SIGKILL). No traceback either
  way."""
  config = tmp_path / "ctrl_c.py"
  config.write_text(_CTRL_C_CONFIG)
  o = tiny_overrides(total_steps=40, log_every=2, eval_every=100,
                     checkpoint_every=2, async_checkpointing=False)
  work = tmp_path / "once"
  p = run(train_cmd(str(work), o, config=f"{config}:1"), check=False,
          timeout=300)
  assert p.returncode == 130, p.stderr[-3000:]
  assert "Traceback" not in p.stderr, p.stderr[-3000:]
  assert "Ctrl-C: stopping after this step, with a checkpoint" in p.stderr
  m = re.search(r"^Ctrl-C: saved a checkpoint at step (\d+) in (\S+); "
                r"exiting\. Run the same command to resume\.$", p.stdout,
                re.M)
  assert m and 4 < int(m.group(1)) < 40, p.stdout[-2000:]
  assert m.group(2) == str(work / "checkpoints")
  work = tmp_path / "twice"
  p = run(train_cmd(str(work), o, config=f"{config}:2"), check=False,
          timeout=300)
  assert p.returncode == 130, p.stderr[-3000:]
  assert "Traceback" not in p.stderr, p.stderr[-3000:]
  last = p.stderr.strip().splitlines()[-1]
  assert re.fullmatch(
      r"train\.py: stopped by Ctrl-C\. The last complete checkpoint is step "
      r"2 in \S+: start every process again with the same command to "
      r"resume from it\.", last), p.stderr[-2000:]
