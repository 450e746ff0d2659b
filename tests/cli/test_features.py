"""vit_jax.features and vit_jax.probe: every example of a split embedded
exactly once (against the model applied to the same pipeline's images), on
one and on four devices; the k-NN and linear probes against independent
computations."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from compare import init, perturb
from train_helpers import digits_data_dir, run_python
from vit_jax import features, formats, inference, models, probe
from vit_jax.data import transforms

NUM_TEST = 359  # digits[test]
SIZE = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  """A random 2-block /4 ViT with 2 registers, as a safetensors file."""
  model = models.get_model("vit_ti_4", num_layers=2, hidden_size=32,
                           num_heads=2, mlp_dim=64, num_classes=10,
                           num_registers=2)
  variables = perturb(init(model, SIZE), std=0.3)
  path = str(tmp_path_factory.mktemp("feat") / "random.safetensors")
  formats.save_safetensors(variables, path, model=model)
  return path


@pytest.fixture(scope="module")
def data_dir():
  return digits_data_dir()


def reference(path, data_dir, split="test", grid_layer=None):
  """The split's examples through the eval pipeline's own per-example
  transform, then the model applied directly (no batching, no padding)."""
  loaded = inference.load(path)
  pre = loaded.preprocessing
  ds = tfds.builder("digits", data_dir=data_dir).as_dataset(
      split=split, shuffle_files=False)
  xs, ys = [], []
  for ex in tfds.as_numpy(ds):
    xs.append(np.asarray(transforms.preprocess_eval(
        ex["image"], image_size=pre.crop_size, resize_size=pre.resize_size,
        mean=pre.mean, std=pre.std)))
    ys.append(int(ex["label"]))
  x = jnp.asarray(np.stack(xs))
  model, v = loaded.model, loaded.variables
  tokens = model.apply(v, x, method=model.forward_features)
  emb = model.apply(v, tokens, method=model.forward_head, pre_logits=True)
  grids = None
  if grid_layer is not None:
    grids = model.apply(v, x, method=model.forward_intermediates,
                        indices=[grid_layer], norm=True,
                        intermediates_only=True)[0]
  return np.asarray(emb), np.asarray(ys), grids


def test_every_example_once_equal_to_the_model_applied_directly(ckpt, data_dir):
  emb, labels, _ = reference(ckpt, data_dir)
  for batch_size in (64, 1000):  # 359 = 5 * 64 + 39; one padded batch
    lines = []
    r = features.extract(ckpt, dataset="digits", split="test",
                         data_dir=data_dir, batch_size=batch_size,
                         log=lines.append, log_every=2)
    assert r["embeddings"].shape == (NUM_TEST, 32)
    np.testing.assert_array_equal(r["labels"], labels)
    np.testing.assert_allclose(r["embeddings"], emb, rtol=1e-5, atol=1e-5)
    assert "img/s" in lines[-1] and "ETA" in lines[-1]
    assert f"{NUM_TEST}/{NUM_TEST} images" in lines[-1]
  assert "patch_grids" not in r and list(r["label_names"][:2]) == ["0", "1"]


def test_patch_grids_of_a_layer(ckpt, data_dir):
  emb, _, grids = reference(ckpt, data_dir, split="test[:40]", grid_layer=0)
  r = features.extract(ckpt, dataset="digits", split="test[:40]",
                       data_dir=data_dir, batch_size=16, patch_grids=True,
                       layer=0, log=None)
  assert r["patch_grids"].shape == (40, 4, 4, 32) and int(r["layer"]) == 0
  np.testing.assert_allclose(r["patch_grids"], grids, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(r["embeddings"], emb, rtol=1e-5, atol=1e-5)


_FOUR_DEVICES = """
import json, sys
import numpy as np
import jax
from vit_jax import features
assert jax.device_count() == 4
r = features.extract({ckpt!r}, dataset="digits", split="test",
                     data_dir={data_dir!r}, batch_size=30, log=None)
np.savez({out!r}, **r)
print(json.dumps({{"devices": jax.device_count()}}))
"""


def test_four_devices_give_the_same_rows(ckpt, data_dir, tmp_path):
  """Global batch 30 -> 32 (a multiple of 4 devices), each device 8 rows."""
  out = str(tmp_path / "four.npz")
  got = run_python(_FOUR_DEVICES.format(ckpt=ckpt, data_dir=data_dir,
                                        out=out), devices=4)
  assert got == {"devices": 4}
  one = features.extract(ckpt, dataset="digits", split="test",
                         data_dir=data_dir, batch_size=64, log=None)
  with np.load(out, allow_pickle=False) as four:
    np.testing.assert_array_equal(four["labels"], one["labels"])
    np.testing.assert_allclose(four["embeddings"], one["embeddings"],
                               rtol=1e-5, atol=1e-5)


def test_cli_then_probe_cli(ckpt, data_dir, tmp_path, capsys):
  paths = {}
  for split in ("train[:300]", "test"):
    paths[split] = str(tmp_path / f"{split[:5]}.npz")
    assert features.main([
        "--checkpoint", ckpt, "--dataset", "digits", "--split", split,
        "--data_dir", data_dir, "--out", paths[split], "--batch_size",
        "128", "--patch_grids"]) == 0
    captured = capsys.readouterr()
    assert "img/s" in captured.err and paths[split] in captured.out
  with np.load(paths["test"], allow_pickle=False) as f:
    assert f["embeddings"].shape == (NUM_TEST, 32)
    assert f["patch_grids"].shape == (NUM_TEST, 4, 4, 32)
    assert str(f["split"]) == "test" and str(f["checkpoint"]) == ckpt
  assert probe.main(["--train", paths["train[:300]"], "--test",
                     paths["test"], "--knn_k", "1,5", "--json"]) == 0
  r = json.loads(capsys.readouterr().out)
  assert (r["num_train"], r["num_test"], r["width"]) == (300, NUM_TEST, 32)
  assert [k["k"] for k in r["knn"]] == [1, 5]
  assert 0 <= r["linear"]["top1"] <= 1
  assert probe.main(["--train", paths["train[:300]"], "--test",
                     paths["test"], "--no_linear"]) == 0
  assert "k-NN (k=20" in capsys.readouterr().out


def test_features_errors(ckpt, data_dir, tmp_path, capsys):
  with pytest.raises(ValueError, match="Which dataset"):
    features.extract(ckpt)
  assert features.main(["--checkpoint", str(tmp_path / "none"),
                        "--dataset", "digits", "--out", "x.npz"]) == 1
  assert "no such file" in capsys.readouterr().err
  assert features.main(["--checkpoint", ckpt, "--dataset", "digits",
                        "--data_dir", data_dir, "--split", "validation",
                        "--out", str(tmp_path / "x.npz")]) == 1
  assert "has splits" in capsys.readouterr().err


def _save_images(root, names, seed=0):
  from PIL import Image  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  for i, name in enumerate(names):
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (14 + 3 * i, 20, 3),
                                 dtype=np.uint8)).save(path)


def test_a_flat_folder_of_images(ckpt, tmp_path, capsys):
  """features --dataset folder:DIR on a plain folder (and a subfolder):
  every image once, with its path, its embedding equal to the model
  applied to the eval transform of that file; no labels (-1)."""
  root = tmp_path / "photos"
  names = ["b.png", "a.jpg", "more/c.png", "d.gif", "e.webp"]
  _save_images(root, names)
  out = str(tmp_path / "photos.npz")
  assert features.main(["--checkpoint", ckpt, "--dataset", f"folder:{root}",
                        "--out", out, "--batch_size", "2"]) == 0
  assert "5 embeddings of width 32" in capsys.readouterr().out
  with np.load(out, allow_pickle=False) as f:
    paths, emb, labels = list(f["paths"]), f["embeddings"], f["labels"]
    assert "label_names" not in f.files and str(f["split"]) == "all"
  assert paths == sorted(str(root / n) for n in names)
  assert labels.tolist() == [-1] * 5
  loaded = inference.load(ckpt)
  pre, model = loaded.preprocessing, loaded.model
  x = np.stack([np.asarray(transforms.preprocess_eval(
      tf.io.read_file(p), image_size=pre.crop_size,
      resize_size=pre.resize_size, mean=pre.mean, std=pre.std))
                for p in paths])
  tokens = model.apply(loaded.variables, x, method=model.forward_features)
  want = model.apply(loaded.variables, tokens, method=model.forward_head,
                     pre_logits=True)
  np.testing.assert_allclose(emb, want, rtol=1e-5, atol=1e-5)
  assert features.main(["--checkpoint", ckpt, "--dataset", f"folder:{root}",
                        "--split", "test", "--out", out]) == 1
  assert "without a <split>/<label>/ tree" in capsys.readouterr().err
  assert probe.main(["--train", out, "--test", out]) == 1
  assert "have no label (-1" in capsys.readouterr().err


def test_labelled_folders_k_nn_and_probe(ckpt, tmp_path, capsys):
  """DIR/<label>/ folders: labels from the subdirectories; a test folder
  lacking one of the training classes is scored by class name."""
  train, test = tmp_path / "train", tmp_path / "test"
  _save_images(train, [f"{c}/{i}.png" for c in "abc" for i in range(4)])
  _save_images(test, [f"{c}/{i}.png" for c in "bc" for i in range(2)], 1)
  files = {}
  for name, root in (("train", train), ("test", test)):
    files[name] = str(tmp_path / f"{name}.npz")
    assert features.main(["--checkpoint", ckpt, "--dataset",
                          f"folder:{root}", "--out", files[name]]) == 0
  with np.load(files["test"], allow_pickle=False) as f:
    assert list(f["label_names"]) == ["b", "c"]
    assert f["labels"].tolist() == [0, 0, 1, 1]
  assert probe.align_labels(["a", "b", "c"], ["b", "c"],
                            np.array([0, 0, 1, 1])).tolist() == [1, 1, 2, 2]
  with pytest.raises(ValueError, match=r"lacks: \['z'\]"):
    probe.align_labels(["a", "b"], ["a", "z"], np.array([0, 1]))
  capsys.readouterr()
  assert probe.main(["--train", files["train"], "--test", files["test"],
                     "--knn_k", "3", "--json"]) == 0
  r = json.loads(capsys.readouterr().out)
  assert (r["num_train"], r["num_test"]) == (12, 4)


# -------------------------------------------------------------- probes ---


def clusters(n, c=4, d=8, seed=0, spread=0.6):
  rng = np.random.default_rng(seed)
  centres = rng.standard_normal((c, d)) * 2
  y = rng.integers(0, c, n)
  return (centres[y] + spread * rng.standard_normal((n, d))).astype(
      np.float32), y


def brute_force_knn(train_x, train_y, test_x, k, t, c):
  """One test example at a time, sorted similarities: DINO's vote."""
  unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731
  out = []
  for q in unit(test_x.astype(np.float64)):
    sim = unit(train_x.astype(np.float64)) @ q
    near = np.argsort(-sim)[:k]
    votes = np.zeros(c)
    for i in near:
      votes[train_y[i]] += np.exp(sim[i] / t)
    out.append(int(np.argmax(votes)))
  return np.asarray(out)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_knn_equals_a_brute_force_vote(k):
  x, y = clusters(401, spread=1.5)
  train_x, train_y, test_x, test_y = x[:300], y[:300], x[300:], y[300:]
  r = probe.knn_accuracy(train_x, train_y, test_x, test_y, k=k, chunk=17)
  want = brute_force_knn(train_x, train_y, test_x, k, 0.07, 4)
  assert r["top1"] == pytest.approx(np.mean(want == test_y), abs=1e-12)
  assert 0.3 < r["top1"] < 1.0  # overlapping clusters: neither trivial
  assert r["k"] == k
  assert r["top5"] == 1.0 if k >= 5 else r["top5"] is None  # 4 classes


def test_linear_probe_separates_what_knn_cannot():
  """Labels by the sign of one coordinate (with a margin) under large noise
  elsewhere: a linear probe finds it, cosine k-NN mostly does not."""
  rng = np.random.default_rng(0)
  x = 10 * rng.standard_normal((600, 16)).astype(np.float32)
  y = rng.integers(0, 2, 600)
  x[:, 0] = (2 * y - 1) * (0.5 + np.abs(rng.standard_normal(600)))
  r = probe.linear_probe_accuracy(x[:400], y[:400], x[400:], y[400:])
  knn = probe.knn_accuracy(x[:400], y[:400], x[400:], y[400:], k=20)
  assert r["top1"] > 0.95 and knn["top1"] < 0.75
  assert r["C"] in probe.C_GRID and set(r["val"]) == set(probe.C_GRID)


def test_probe_errors(tmp_path):
  x, y = clusters(20)
  with pytest.raises(ValueError, match="k=21"):
    probe.knn_accuracy(x, y, x, y, k=21)
  with pytest.raises(ValueError, match="width 8, test 4"):
    probe.knn_accuracy(x, y, x[:, :4], y)
  bad = str(tmp_path / "bad.npz")
  np.savez(bad, feats=x)
  with pytest.raises(ValueError, match=r"no \['embeddings', 'labels'\]"):
    probe.read(bad)
  assert probe.main(["--train", bad, "--test", bad]) == 1
  with pytest.raises(ValueError, match="not a readable .npz"):
    probe.read(str(tmp_path / "missing.npz"))


def test_dinov3_features_probe_and_pca_picture(data_dir, tmp_path, capsys,
                                               monkeypatch):
  """DINOv3 (RoPE, registers, no position embedding) from timm's weights
  through the features CLI (pooled features and a block's patch grid),
  the k-NN / linear probe CLI and the feature-PCA picture at a high,
  non-square resolution (RoPE at any size; no position-embedding picture:
  there is none)."""
  timm = pytest.importorskip("timm")
  import torch  # pylint: disable=import-outside-toplevel
  from PIL import Image  # pylint: disable=import-outside-toplevel
  from compare import init, perturb_torch  # pylint: disable=import-outside-toplevel
  from vit_jax import visualize  # pylint: disable=import-outside-toplevel
  from vit_jax.data import preprocessing as pp  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  m = perturb_torch(timm.create_model(
      "vit_small_patch16_dinov3", pretrained=False, depth=2, embed_dim=32,
      num_heads=2, num_classes=0), 0, std=0.3, weights_only=True)
  model, variables = formats.from_timm(m.state_dict(),
                                       "vit_small_patch16_dinov3", num_heads=2)
  ckpt = str(tmp_path / "dinov3.safetensors")
  formats.save_safetensors(variables, ckpt, model=model, metadata=dict(
      preprocessing=pp.Preprocessing(32, 32, "bicubic", pp.IMAGENET_MEAN,
                                     pp.IMAGENET_STD).as_dict()))
  paths = {}
  for split in ("train[:300]", "test"):
    paths[split] = str(tmp_path / f"{split[:5]}.npz")
    assert features.main([
        "--checkpoint", ckpt, "--dataset", "digits", "--split", split,
        "--data_dir", data_dir, "--out", paths[split], "--batch_size",
        "128", "--patch_grids", "--layer", "0"]) == 0
  emb, _, grids = reference(ckpt, data_dir, grid_layer=0)
  with np.load(paths["test"], allow_pickle=False) as f:
    assert f["embeddings"].shape == (NUM_TEST, 32)
    assert f["patch_grids"].shape == (NUM_TEST, 2, 2, 32)
    np.testing.assert_allclose(f["embeddings"], emb, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f["patch_grids"], grids, rtol=1e-5, atol=1e-5)
  capsys.readouterr()
  assert probe.main(["--train", paths["train[:300]"], "--test",
                     paths["test"], "--knn_k", "5", "--json"]) == 0
  r = json.loads(capsys.readouterr().out)
  assert r["width"] == 32 and 0 <= r["linear"]["top1"] <= 1
  Image.fromarray(np.random.default_rng(0).integers(
      0, 256, (40, 60, 3), np.uint8)).save(tmp_path / "a.png")
  out = str(tmp_path / "pictures")
  titles = []
  save = visualize._save  # pylint: disable=protected-access
  monkeypatch.setattr(visualize, "_save", lambda fig, path, title=None: (
      titles.append(title), save(fig, path, title))[1])
  assert visualize.main(["--checkpoint", ckpt, "--out", out, "--pca",
                         "--pca_size", "64", str(tmp_path / "a.png")]) == 0
  names = set(os.listdir(out))
  assert "a_feature_pca.png" in names and "posemb_similarity.png" not in names
  # A backbone (no head): no class in the pictures' titles.
  assert len(titles) == 3 and not any(
      "predicted" in (t or "") or "'class " in (t or "")
      for t in titles), titles
