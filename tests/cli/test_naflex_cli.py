"""The CLIs on a NaFlex model (issue 22): ``predict`` takes image files of
any shape at their own aspect ratios, the same probabilities as timm's own
NaFlex pipeline and model end to end; ``features`` embeds a dataset of
images of different shapes through the NaFlex evaluation pipeline."""

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from compare import perturb_torch
from vit_jax import predict as predict_lib

timm = pytest.importorskip("timm")

NAME = "naflexvit_base_patch16_siglip"
SHAPES = {"wide.png": (40, 90), "tall.jpg": (120, 33), "square.png": (64, 64),
          "tiny.png": (9, 13)}


@pytest.fixture(scope="module")
def naflex_files(tmp_path_factory):
  """A timm hub directory of a small NaFlex SigLIP with a 7-class head, and
  image files of different shapes."""
  from timm.models._hub import save_for_hf  # pylint: disable=import-outside-toplevel
  d = tmp_path_factory.mktemp("naflex_cli")
  torch.manual_seed(0)
  m = timm.create_model(NAME, pretrained=False, depth=2, num_classes=7,
                        embed_dim=192, num_heads=3)
  m = perturb_torch(m, 0, std=0.1)
  save_for_hf(m, str(d / "model"), safe_serialization=True)
  rng = np.random.default_rng(0)
  paths = {}
  for name, (h, w) in SHAPES.items():
    paths[name] = str(d / name)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
        paths[name])
  return dict(model=m, dir=str(d / "model"), images=paths)


def test_predict_images_of_any_shape_matches_timm(naflex_files, capsys):
  from timm.data import create_transform  # pylint: disable=import-outside-toplevel
  from timm.data.naflex_dataset import NaFlexCollator  # pylint: disable=import-outside-toplevel
  m, paths = naflex_files["model"], list(naflex_files["images"].values())
  # timm's own: its NaFlex eval transform (576 tokens, bicubic, 0.5 / 0.5)
  # on the PIL images, its collator, its model.
  t = create_transform(input_size=(3, 384, 384), is_training=False,
                       naflex=True, patch_size=16, max_seq_len=576,
                       interpolation="bicubic", mean=(0.5,) * 3,
                       std=(0.5,) * 3, patchify=True)
  samples = []
  for p in paths:
    with Image.open(p) as im:
      samples.append((t(im.convert("RGB")), 0))
  batch, _ = NaFlexCollator(max_seq_len=576)(samples)
  with torch.no_grad():
    ref = torch.softmax(m(batch), -1).numpy()
  results = predict_lib.predict(naflex_files["dir"], paths, top_k=3,
                                batch_size=3)  # batches of 3 and 1
  for r, want in zip(results, ref):
    assert r.error is None, r.error
    best = np.argsort(-want, kind="stable")[:3]
    assert [c for c, _, _ in r.top] == list(best)
    np.testing.assert_allclose([p for _, _, p in r.top], want[best],
                               rtol=0, atol=2e-5)
  assert predict_lib.main(["--checkpoint", naflex_files["dir"], "--json",
                           "--top-k", "1", *paths]) == 0
  rows = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
  assert [os.path.basename(r["image"]) for r in rows] == list(SHAPES)
  assert [r["top"][0]["index"] for r in rows] == [
      int(np.argmax(p)) for p in ref]


def test_features_of_a_folder_of_images_of_any_shape(naflex_files, tmp_path):
  """A folder dataset of images of different shapes through the NaFlex
  evaluation pipeline (every image at its aspect ratio within 576
  patches, batches of 3 with the last one padded): the embeddings of the
  model applied to each image's own patches."""
  import jax  # pylint: disable=import-outside-toplevel
  from vit_jax import features, weights  # pylint: disable=import-outside-toplevel
  from vit_jax.data import naflex, transforms  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(1)
  shapes = [(40, 90), (120, 33), (64, 64), (9, 13), (200, 150)]
  files = []
  for i, (h, w) in enumerate(shapes):
    d = tmp_path / "images" / "test" / f"class{i % 2}"
    d.mkdir(parents=True, exist_ok=True)
    files.append(str(d / f"{i}.png"))
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
        files[-1])
  out = str(tmp_path / "feats.npz")
  assert features.main(["--checkpoint", naflex_files["dir"], "--dataset",
                        f"folder:{tmp_path / 'images'}", "--split", "test",
                        "--batch-size", "3", "--out", out]) == 0
  loaded = weights.load(naflex_files["dir"])
  pre = loaded.preprocessing
  with np.load(out, allow_pickle=False) as f:
    emb, labels = f["embeddings"], f["labels"]
    assert int(f["max_seq_len"]) == 576
  assert emb.shape == (5, 192)
  # The reference, image by image in the order read (labels tell which).
  model, v = loaded.model, loaded.variables
  embed = jax.jit(lambda v, b: model.apply(
      v, model.apply(v, b, method=model.forward_features),
      method=model.forward_head, pre_logits=True))
  got = {}
  for path in files:
    with Image.open(path) as im:
      x = np.asarray(im.convert("RGB"))
    s = transforms.preprocess_eval_naflex(x, patch_size=16, seq_len=576,
                                          mean=pre.mean, std=pre.std)
    b = naflex.collate([{k: s[k].numpy() for k in naflex.KEYS}])
    got[path] = np.asarray(embed(v, b))[0]
  ref = np.stack(list(got.values()))
  # Rows come in the folder reader's order: each matches one image's.
  err = np.abs(ref[None] - emb[:, None]).max(axis=2)  # (row, image)
  match = err.argmin(axis=1)
  assert sorted(match.tolist()) == list(range(5))
  assert err.min(axis=1).max() < 1e-4 * np.abs(ref).max()
  np.testing.assert_array_equal(labels, match % 2)
