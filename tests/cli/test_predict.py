"""vit_jax.predict / vit_jax.inference: every checkpoint kind, torchvision's
preprocessing, batching, and per-file errors. Generated images, random or
seconds-trained weights."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from train_helpers import REPO
from vit_jax import formats, inference
from vit_jax.data import batches, labels, sources
from vit_jax import predict as predict_lib

SIZE = 32  # torchvision weights at 32px: a 2x2 grid of 16px patches


def random_torchvision(num_classes=1000, seed=0, layers=2):
  torch.manual_seed(seed)
  m = torchvision.models.VisionTransformer(
      image_size=SIZE, patch_size=16, num_layers=layers, num_heads=3,
      hidden_dim=192, mlp_dim=768, num_classes=num_classes)
  with torch.no_grad():
    m.heads.head.weight.normal_(std=0.5)
    m.heads.head.bias.normal_(std=0.5)
  return m.eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("predict")
  rng = np.random.default_rng(0)
  out = {}
  for name, shape in (("wide.png", (40, 60, 3)), ("tall.jpg", (70, 45, 3)),
                      ("gray.png", (50, 50)), ("small.png", (20, 30, 3))):
    path = str(d / name)
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(path)
    out[name] = path
  (d / "truncated.jpg").write_bytes(open(out["tall.jpg"], "rb").read()[:200])
  (d / "text.png").write_text("not an image")
  out["truncated.jpg"] = str(d / "truncated.jpg")
  out["text.png"] = str(d / "text.png")
  out["missing.png"] = str(d / "missing.png")
  m = random_torchvision(layers=12)  # the full vit_ti_16 depth
  out["tv.pth"] = str(d / "tv.pth")
  torch.save(m.state_dict(), out["tv.pth"])
  out["tv_model"] = m
  out["resnet.pth"] = str(d / "resnet.pth")
  torch.save(torchvision.models.resnet18(num_classes=10).state_dict(),
             out["resnet.pth"])
  out["dir"] = str(d)
  return out


GOOD = ("wide.png", "tall.jpg", "gray.png", "small.png")
BAD = ("truncated.jpg", "text.png", "missing.png")


def torchvision_reference(m, path, pre):
  """torchvision's own transform (on PIL) and model -> probabilities."""
  from torchvision import transforms as T  # pylint: disable=import-outside-toplevel

  tf = T.Compose([T.Resize(pre.resize_size,
                           interpolation=T.InterpolationMode.BILINEAR),
                  T.CenterCrop(pre.crop_size), T.ToTensor(),
                  T.Normalize(pre.mean, pre.std)])
  with Image.open(path) as im:
    x = tf(im.convert("RGB"))[None]
  with torch.no_grad():
    return torch.softmax(m(x), -1)[0].numpy()


def test_torchvision_pth_matches_torchvision_end_to_end(files):
  results = predict_lib.predict(files["tv.pth"], [files[n] for n in GOOD],
                                top_k=5, batch_size=3)
  cats = labels.imagenet_categories()
  loaded = inference.load(files["tv.pth"])
  assert loaded.preprocessing.crop_size == SIZE
  assert loaded.preprocessing.resize_size == round(SIZE * 256 / 224)
  for name, r in zip(GOOD, results):
    assert r.error is None and len(r.top) == 5
    ref = torchvision_reference(files["tv_model"], files[name],
                                loaded.preprocessing)
    best = np.argsort(-ref)[:5]
    assert [i for i, _, _ in r.top] == best.tolist(), name
    for (i, label, p), want in zip(r.top, ref[best]):
      assert label == cats[i]
      assert p == pytest.approx(float(want), abs=1e-4)


def test_batching_does_not_change_results(files):
  paths = [files[n] for n in GOOD] * 2
  loaded = inference.load(files["tv.pth"])
  runs = [predict_lib.predict(loaded, paths, top_k=3, batch_size=b)
          for b in (1, 3, 64)]
  for other in runs[1:]:
    for a, b in zip(runs[0], other):
      assert [i for i, _, _ in a.top] == [i for i, _, _ in b.top]
      # Equal up to float32 rounding (XLA picks kernels by batch shape).
      np.testing.assert_allclose([p for *_, p in a.top], [p for *_, p in b.top],
                                 atol=1e-5)


def test_bad_images_are_reported_and_the_others_processed(files):
  names = ["wide.png", "truncated.jpg", "text.png", "gray.png", "missing.png"]
  results = predict_lib.predict(files["tv.pth"], [files[n] for n in names])
  by = dict(zip(names, results))
  assert by["wide.png"].error is None and by["gray.png"].error is None
  assert len(by["gray.png"].top) == 5
  assert "truncated or corrupt" in by["truncated.jpg"].error
  assert "not an image PIL can decode" in by["text.png"].error
  assert "no such file" in by["missing.png"].error
  assert all(by[n].top == [] for n in BAD)


@pytest.mark.parametrize("ckpt, match", [
    ("resnet.pth", "another architecture"),
    ("nothing_here.pth", "no such file"),
    ("tv.pth@vit_b_16", r"not a vit_b_16.*looks like vit_ti_16"),
    ("weights.onnx", "unknown checkpoint type"),
])
def test_checkpoint_errors_are_clear(files, ckpt, match):
  path, _, name = ckpt.partition("@")
  full = files.get(path, os.path.join(files["dir"], path))
  if path == "weights.onnx":
    open(full, "wb").close()
  with pytest.raises(inference.CheckpointError, match=match):
    inference.load(full, model_name=name or None)


def test_cli_reports_each_failure_and_goes_on(files, capsys):
  argv = ["--checkpoint", files["resnet.pth"], "--checkpoint", files["tv.pth"],
          "--top_k", "3", files["wide.png"], files["text.png"],
          files["gray.png"]]
  assert predict_lib.main(argv) == 1
  out, err = capsys.readouterr()
  assert "resnet.pth" in err and "another architecture" in err
  assert "text.png: not an image" in err
  assert f"== {files['tv.pth']}: torchvision state dict: vit_ti_16" in out
  blocks = out.split(files["gray.png"])
  assert len(blocks) == 2 and blocks[1].count("%") == 3
  assert "  1. " in out


def test_cli_json_in_a_subprocess(files):
  env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
  p = subprocess.run(
      [sys.executable, "-m", "vit_jax.predict", "--checkpoint", files["tv.pth"],
       "--json", "--top_k", "2", files["tall.jpg"], files["missing.png"]],
      capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
  assert p.returncode == 1, p.stderr
  rows = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
  assert rows[0]["image"] == files["tall.jpg"] and len(rows[0]["top"]) == 2
  assert rows[1]["error"].endswith("no such file")
  assert "missing.png: no such file" in p.stderr


def test_npz_and_safetensors_checkpoints(files, tmp_path):
  loaded = inference.load(files["tv.pth"])
  npz = str(tmp_path / "g.npz")
  formats.save_npz(loaded.variables, npz)
  st = str(tmp_path / "ours.safetensors")
  names = [f"thing {i}" for i in range(1000)]
  formats.save_safetensors(loaded.variables, st, model=loaded.model,
                              metadata={"label_names": names,
                                        "preprocessing": {"crop_size": SIZE,
                                                          "resize_size": 40,
                                                          "mean": [0.5] * 3,
                                                          "std": [0.25] * 3}})
  g = inference.load(npz)
  assert g.kind == "npz" and g.preprocessing.mean == (0.5, 0.5, 0.5)
  assert g.label_names == labels.imagenet_categories()
  s = inference.load(st)
  assert s.label_names == names and s.preprocessing.std == (0.25, 0.25, 0.25)
  assert s.preprocessing.resize_size == 40
  (r,) = predict_lib.predict(s, [files["wide.png"]], top_k=1)
  assert r.top[0][1].startswith("thing ")
  # A label file overrides; its length is checked.
  lf = tmp_path / "labels.txt"
  lf.write_text("\n".join(f"L{i}" for i in range(1000)))
  assert inference.load(npz, label_file=str(lf)).label_names[7] == "L7"
  lf.write_text("a\nb\n")
  with pytest.raises(inference.CheckpointError, match="2 class names.*1000"):
    inference.load(npz, label_file=str(lf))


def test_orbax_training_checkpoint_uses_the_eval_pipeline(digits_run, tmp_path):
  workdir, cfg = digits_run
  src = sources.get_source(cfg)
  loaded = inference.load(workdir)
  assert loaded.kind == "orbax" and loaded.label_names == [str(i) for i in range(10)]
  ds, _ = batches.eval_dataset(
      cfg, src, local_batch=8, process_index=0, process_count=1,
      mean=loaded.preprocessing.mean, std=loaded.preprocessing.std)
  batch = next(batches.as_numpy(ds))
  # The same test examples as PNG files (8x8 grey, as stored in the dataset).
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  raw = tfds.builder("digits", data_dir=cfg.data_dir).as_dataset(
      split="test", shuffle_files=False)
  paths = []
  for i, ex in enumerate(tfds.as_numpy(raw.take(8))):
    p = str(tmp_path / f"digit{i}_{ex['label']}.png")
    Image.fromarray(ex["image"][..., 0]).save(p)
    paths.append(p)
    assert ex["label"] == batch["label"][i]
  results = predict_lib.predict(workdir, paths, top_k=10, batch_size=4)
  want = jax.nn.softmax(loaded.model.apply(loaded.variables, batch["image"],
                                           train=False))
  for r, w in zip(results, np.asarray(want)):
    got = np.zeros(10)
    for i, label, p in r.top:
      assert label == str(i)
      got[i] = p
    np.testing.assert_allclose(got, w, atol=1e-5)
  # A step directory works too, and another variant's name is refused.
  step_dir = os.path.join(workdir, "checkpoints", "6")
  assert inference.load(step_dir).info["step"] == 6
  with pytest.raises(inference.CheckpointError, match="not a vit_b_16"):
    inference.load(workdir, model_name="vit_b_16")


def test_missing_images_are_reported_before_any_model_loads(files, tmp_path,
                                                            capsys):
  """No image exists: each is reported and no checkpoint is even opened
  (its own error would say 'no such file or directory')."""
  nothing = str(tmp_path / "no_such_checkpoint.pth")
  assert predict_lib.main(["--checkpoint", nothing, files["missing.png"],
                           str(tmp_path / "typo.jpg")]) == 1
  err = capsys.readouterr().err
  assert f"{files['missing.png']}: no such file" in err
  assert "typo.jpg: no such file" in err
  assert "no_such_checkpoint" not in err


def test_a_backbone_or_an_embedding_has_no_class_to_predict(files):
  from vit_jax import weights  # pylint: disable=import-outside-toplevel
  loaded = weights.with_head(weights.load(files["tv.pth"]), 0)
  assert loaded.head == "none"
  with pytest.raises(weights.CheckpointError,
                     match="no classification head.*vit_jax.features"):
    predict_lib.predict(loaded, [np.zeros((32, 32, 3), np.uint8)])
