"""vit_jax.evaluate: top-1/top-5 on a tfds split, every example exactly once,
checked against an independent per-example loop and the run's own metrics."""

import json

import numpy as np
import pytest
import tensorflow_datasets as tfds
import torch
import torchvision

from train_helpers import metric_rows
from vit_jax import evaluate as evaluate_lib
from vit_jax import inference, weights

NUM_TEST = 359  # examples in digits[test]


def per_example_reference(loaded, data_dir, split="test"):
  """Independent count: each example decoded by tfds, prepared by
  ``loaded.preprocess`` and classified one at a time."""
  ds = tfds.builder("digits", data_dir=data_dir).as_dataset(
      split=split, shuffle_files=False)
  fn = inference.make_probabilities_fn(loaded.model)
  top1 = top5 = n = 0
  images, labels_ = [], []
  for ex in tfds.as_numpy(ds):
    images.append(loaded.preprocess(np.repeat(ex["image"], 3, axis=-1)))
    labels_.append(int(ex["label"]))
  probs = inference.run_batches(fn, loaded.variables, np.stack(images), 100)
  for p, y in zip(probs, labels_):
    order = np.argsort(-p, kind="stable")
    top1 += int(order[0] == y)
    top5 += int(y in order[:5])
    n += 1
  return top1, top5, n


def test_orbax_run_matches_its_metrics_and_a_per_example_count(digits_run):
  workdir, cfg = digits_run
  r = evaluate_lib.evaluate(workdir, batch_size=64)  # 359 = 5 * 64 + 39
  assert (r["dataset"], r["split"], r["count"]) == ("digits", "test", NUM_TEST)
  assert r["batches"] == 6
  final = metric_rows(workdir)[6]
  assert r["top1"] == pytest.approx(final["eval_accuracy"], abs=1e-9)
  assert r["top5"] == pytest.approx(final["eval_top5_accuracy"], abs=1e-9)
  assert r["loss"] == pytest.approx(final["eval_loss"], rel=1e-5)
  top1, top5, n = per_example_reference(inference.load(workdir), cfg.data_dir)
  assert n == NUM_TEST
  assert (r["correct"], r["correct5"]) == (top1, top5)


@pytest.mark.parametrize("batch_size", [1000, 359, 7])
def test_every_example_once_whatever_the_batch_size(digits_run, batch_size):
  workdir, _ = digits_run
  loaded = inference.load(workdir)
  ref = evaluate_lib.evaluate(workdir, batch_size=64)
  r = evaluate_lib.evaluate(loaded, dataset="digits", split="test",
                            data_dir=digits_run[1].data_dir,
                            batch_size=batch_size)
  assert r["count"] == NUM_TEST
  assert (r["correct"], r["correct5"]) == (ref["correct"], ref["correct5"])


def test_other_split_and_slices(digits_run):
  workdir, cfg = digits_run
  r = evaluate_lib.evaluate(workdir, split="train[:100]", batch_size=64)
  assert r["count"] == 100 and r["split"] == "train[:100]"
  assert 0 <= r["top1"] <= r["top5"] <= 1


def test_converted_weights_on_a_tfds_split(digits_run, tmp_path):
  _, cfg = digits_run
  torch.manual_seed(0)
  m = torchvision.models.VisionTransformer(
      image_size=16, patch_size=8, num_layers=2, num_heads=3, hidden_dim=192,
      mlp_dim=768, num_classes=10)
  with torch.no_grad():
    m.heads.head.weight.normal_(std=0.5)
  path = str(tmp_path / "tv_2_layers.pth")
  torch.save(m.state_dict(), path)
  loaded = inference.load(path)  # any depth: read from the shapes
  assert loaded.model.num_layers == 2 and loaded.model.patch_size == 8
  r = evaluate_lib.evaluate(loaded, dataset="digits", split="test",
                            data_dir=cfg.data_dir, batch_size=100)
  assert r["count"] == NUM_TEST
  top1, top5, _ = per_example_reference(loaded, cfg.data_dir)
  # The eval pipeline (TF) and per-example path (PIL here) resize with
  # different code, so allow a few borderline examples to differ.
  assert abs(r["correct"] - top1) <= 5 and abs(r["correct5"] - top5) <= 5


def test_errors(digits_run, tmp_path, capsys):
  workdir, cfg = digits_run
  torch.manual_seed(0)
  tv = torchvision.models.VisionTransformer(
      image_size=32, patch_size=16, num_layers=12, num_heads=3,
      hidden_dim=192, mlp_dim=768, num_classes=1000)
  path = str(tmp_path / "imagenet_classes.pth")
  torch.save(tv.state_dict(), path)
  with pytest.raises(ValueError, match="1000 classes but 'digits' has 10"):
    evaluate_lib.evaluate(path, dataset="digits", data_dir=cfg.data_dir)
  with pytest.raises(ValueError, match="Which dataset"):
    evaluate_lib.evaluate(path)
  backbone = weights.with_head(weights.load(workdir), 0)
  with pytest.raises(ValueError, match="no classification head.*vit_jax.probe"):
    evaluate_lib.evaluate(backbone)
  assert evaluate_lib.main(["--checkpoint", str(tmp_path / "none")]) == 1
  assert "no such file or directory" in capsys.readouterr().err
  assert evaluate_lib.main(["--checkpoint", workdir, "--split", "validation"]) == 1
  assert "has splits" in capsys.readouterr().err


def test_cli(digits_run, capsys):
  workdir, _ = digits_run
  assert evaluate_lib.main(["--checkpoint", workdir, "--batch_size", "100"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("digits[test]: top-1 ") and "(359 examples" not in out
  assert "359 examples in 4 batches of 100" in out
  assert evaluate_lib.main(["--checkpoint", workdir, "--json"]) == 0
  r = json.loads(capsys.readouterr().out)
  assert r["count"] == NUM_TEST and set(r) >= {"top1", "top5", "loss"}
