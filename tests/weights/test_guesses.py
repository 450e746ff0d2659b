"""No silent guesses: what a bare state dict cannot say (a CLIP tower's
activation, how images must be prepared, whether a head gives classes or an
embedding) is stated by a name, a record or the caller; where it must be
assumed, loading says so, and where a wrong guess changes the numbers it
refuses."""

import warnings

import numpy as np
import pytest
import torch

from compare import random_timm
from vit_jax import formats, predict, weights
from vit_jax.data import preprocessing as pp

SIZE = 56


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("guesses")
  out = {}
  m = random_timm(name="vit_small_patch14_reg4_dinov2", depth=2, size=SIZE,
                  num_classes=0)
  out["dinov2"] = str(d / "dinov2_reg4.pth")
  torch.save(m.state_dict(), out["dinov2"])
  # OpenAI's CLIP as timm stores it: `proj` as a head with a zero bias.
  m = random_timm(name="vit_base_patch16_clip_224", depth=2, size=32,
                  num_classes=512)
  with torch.no_grad():
    m.head.bias.zero_()
  out["clip"] = str(d / "clip_openai.pth")
  torch.save(m.state_dict(), out["clip"])
  out["clip_sd"] = m.state_dict()
  return out


def _load(*args, **kw):
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    loaded = weights.load(*args, **kw)
  return loaded, [w for w in seen if issubclass(w.category,
                                                weights.GuessWarning)]


def test_a_bare_dinov2_file_says_which_recipe_it_assumed(files):
  loaded, said = _load(files["dinov2"])
  assert len(said) == 1, [str(w.message) for w in said]
  msg = str(said[0].message)
  assert "DINOv2's" in msg and "model_name=" in msg and "preprocessing=" in msg
  pre = loaded.preprocessing
  # timm's DINOv2 record: ImageNet statistics, bicubic, crop_pct 1.0.
  assert (pre.mean, pre.std) == (pp.IMAGENET_MEAN, pp.IMAGENET_STD)
  assert pre.interpolation == "bicubic"
  assert pre.resize_size == pre.crop_size == SIZE
  # Named: the name's record, nothing assumed.
  named, said = _load(files["dinov2"],
                      model_name="vit_small_patch14_reg4_dinov2.lvd142m")
  assert said == [] and named.preprocessing == pre
  # Stated: used as given.
  mine = pp.Preprocessing(SIZE, 64, "bilinear")
  stated, said = _load(files["dinov2"], preprocessing=mine)
  assert said == [] and stated.preprocessing == mine
  stated, said = _load(files["dinov2"], preprocessing=mine.as_dict())
  assert said == [] and stated.preprocessing == mine


def test_a_bare_clip_file_is_refused_for_its_activation(files):
  with pytest.raises(weights.CheckpointError,
                     match=r"CLIP image tower.*QuickGELU.*exact GELU.*"
                     r"vit_base_patch16_clip_quickgelu_224"):
    weights.load(files["clip"])
  with pytest.raises(ValueError, match="QuickGELU"):
    formats.from_timm(files["clip_sd"])


def test_a_clip_projection_is_an_embedding_not_classes(files, tmp_path):
  loaded, said = _load(files["clip"],
                       model_name="vit_base_patch16_clip_quickgelu_224.openai")
  assert said == []
  assert loaded.model.act == "quick_gelu"
  assert loaded.head == "embedding"
  assert loaded.num_classes == 0 and loaded.embedding_dim == 512
  assert loaded.label_names is None
  assert "512-d embedding head" in loaded.description
  assert "classes" not in loaded.description
  with pytest.raises(weights.CheckpointError,
                     match=r"512-d image embedding.*vit_jax.features"):
    predict.predict(loaded, [np.zeros((32, 32, 3), np.uint8)])


def test_a_classifier_head_stays_classes(files):
  """A CLIP tower fine-tuned on classes has a trained (non-zero) bias."""
  sd = dict(files["clip_sd"])
  sd["head.bias"] = torch.full_like(sd["head.bias"], 0.1)
  model, variables = formats.from_timm(sd, "vit_base_patch16_clip_224")
  assert model.num_classes == 512
  path = str(files["clip"]) + ".ft.pth"
  torch.save(sd, path)
  loaded, _ = _load(path, model_name="vit_base_patch16_clip_224")
  assert loaded.head == "classes" and loaded.num_classes == 512


def test_a_torchvision_file_says_which_recipe_it_assumed(tmp_path):
  import torchvision  # pylint: disable=import-outside-toplevel
  m = torchvision.models.VisionTransformer(
      image_size=32, patch_size=16, num_layers=1, num_heads=3, hidden_dim=192,
      mlp_dim=768, num_classes=10)
  path = str(tmp_path / "tv.pth")
  torch.save(m.state_dict(), path)
  loaded, said = _load(path)
  assert len(said) == 1 and "IMAGENET1K_V1" in str(said[0].message)
  assert loaded.preprocessing == pp.torchvision_classic(32)


def test_preprocess_checks_what_it_is_given(files):
  """Floats in [0, 1] (all black after normalisation), CHW and batches are
  refused with what was expected; uint8, [0, 255] floats and grey-scale
  work."""
  loaded, _ = _load(files["dinov2"], model_name="vit_small_patch14_reg4_dinov2")
  rng = np.random.default_rng(0)
  img = rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)
  want = loaded.preprocess(img)
  assert want.shape == (SIZE, SIZE, 3) and want.std() > 0.1
  np.testing.assert_array_equal(loaded.preprocess(img.astype(np.float32)), want)
  grey = img[..., 0]
  np.testing.assert_array_equal(loaded.preprocess(grey),
                                loaded.preprocess(np.stack([grey] * 3, -1)))
  for bad, match in (
      (img / 255.0, r"values in \[0, 1\].*\(image \* 255\)"),
      (img.transpose(2, 0, 1), r"CHW.*transpose\(1, 2, 0\)"),
      (img[None], r"a batch of shape \(1, 40, 50, 3\)"),
      (np.concatenate([img, img[..., :1]], -1), r"RGBA.*\[\.\.\., :3\]"),
      (img.astype(np.float32) * 2, r"outside \[0, 255\]"),
      (np.zeros((4,)), r"shape \(4,\)")):
    with pytest.raises(ValueError, match="Loaded.preprocess takes one decoded "
                       "image: uint8 \\(height, width, 3\\) RGB.*" + match):
      loaded.preprocess(bad)


def test_predict_reports_a_wrong_array_per_image(files):
  loaded, _ = _load(files["dinov2"], model_name="vit_small_patch14_reg4_dinov2")
  sd = dict(torch.load(files["dinov2"], weights_only=True))
  sd["head.weight"] = torch.randn(5, 384)
  sd["head.bias"] = torch.randn(5)
  model, variables = formats.from_timm(sd, "vit_small_patch14_reg4_dinov2")
  loaded.model, loaded.variables = model, variables
  good = np.zeros((40, 40, 3), np.uint8)
  out = predict.predict(loaded, [good, good / 255.0 + 0.5 / 255], top_k=2)
  assert out[0].error is None and len(out[0].top) == 2
  assert "values in [0, 1]" in out[1].error and out[1].path == "<array 1>"
