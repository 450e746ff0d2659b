"""Hugging Face transformers' ViT (``ViTModel``, ``ViTForImageClassification``)
against transformers itself on random, perturbed weights; the
``save_pretrained`` directory, and ``hf-hub:`` names (google/vit-*, timm/*)
from a local Hub cache laid out by huggingface_hub's own functions, offline.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import hf_cache
from compare import apply, assert_close_rel, images, perturb_torch, torch_in
from vit_jax import formats, weights

transformers = pytest.importorskip("transformers")

SIZE = 64


def hf_config(**kw):
  c = dict(hidden_size=192, num_hidden_layers=2, num_attention_heads=3,
           intermediate_size=768, image_size=SIZE, patch_size=16)
  c.update(kw)
  return transformers.ViTConfig(**c)


def hf_classifier(seed=0, num_labels=5, **kw):
  torch.manual_seed(seed)
  config = hf_config(num_labels=num_labels,
                     id2label={i: f"kind {i}" for i in range(num_labels)},
                     label2id={f"kind {i}": i for i in range(num_labels)}, **kw)
  return perturb_torch(transformers.ViTForImageClassification(config), seed)


def test_classifier_logits_match_transformers_both_ways(record_property):
  m = hf_classifier()
  x = images(2, SIZE)
  model, variables = formats.from_transformers(m.state_dict(), m.config)
  assert model.layer_norm_eps == 1e-12 and model.num_classes == 5
  with torch.no_grad():
    ref = m(pixel_values=torch_in(x)).logits.numpy()
  rel = assert_close_rel(apply(model, variables, x), ref)
  record_property("rel_err", rel.rel)
  print(f"\nPARITY transformers ViTForImageClassification: logits rel "
        f"{rel.rel:.2g}")
  back = formats.to_transformers(variables)
  fresh = hf_classifier(seed=1)
  fresh.load_state_dict(back, strict=True)
  for k, v in m.state_dict().items():
    assert torch.equal(back[k], v), k


def test_vit_model_pooler_and_hidden_states():
  torch.manual_seed(0)
  m = perturb_torch(transformers.ViTModel(hf_config(hidden_act="gelu_new")), 2)
  x = images(2, SIZE, seed=3)
  model, variables = formats.from_transformers(m)  # config from the model
  assert model.act == "gelu_tanh" and model.representation_size == 192
  with torch.no_grad():
    out = m(pixel_values=torch_in(x))
  assert_close_rel(apply(model, variables, x), out.pooler_output.numpy(),
                   what="pooler_output")
  assert_close_rel(apply(model, variables, x, method=model.forward_features),
                   out.last_hidden_state.numpy(), what="last_hidden_state")
  back = formats.to_transformers(variables)
  assert "vit.embeddings.cls_token" not in back and "pooler.dense.weight" in back
  transformers.ViTModel(m.config).load_state_dict(back, strict=True)


def _save_vit(folder, seed=0):
  m = hf_classifier(seed=seed, num_labels=3)
  m.save_pretrained(folder)  # config.json + model.safetensors
  transformers.ViTImageProcessor(
      size={"height": SIZE, "width": SIZE}, resample=3,
      image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3]).save_pretrained(folder)
  return m


def test_save_pretrained_directory_loads_with_its_preprocessing(tmp_path):
  m = _save_vit(tmp_path)
  assert os.path.isfile(tmp_path / "model.safetensors")
  loaded = weights.load(str(tmp_path))
  model, variables, pre = loaded
  assert (pre.crop_size, pre.resize_size, pre.crop_mode) == (SIZE, SIZE, "squash")
  assert pre.interpolation == "bicubic" and pre.mean == (0.5, 0.4, 0.3)
  assert loaded.label_names == ["kind 0", "kind 1", "kind 2"]
  x = images(2, SIZE)
  with torch.no_grad():
    ref = m(pixel_values=torch_in(x)).logits.numpy()
  assert_close_rel(apply(model, variables, x), ref)
  # The processor's own output equals our preprocessing on an image.
  img = np.random.default_rng(0).integers(0, 256, (50, 70, 3), np.uint8)
  proc = transformers.ViTImageProcessor.from_pretrained(str(tmp_path))
  want = proc(images=img, return_tensors="np")["pixel_values"][0].transpose(1, 2, 0)
  np.testing.assert_allclose(loaded.preprocess(img), want, atol=2e-2)


def _timm_repo(folder):
  timm = pytest.importorskip("timm")
  from timm.models._hub import save_for_hf  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  m = perturb_torch(timm.create_model(
      "vit_small_patch14_reg4_dinov2", pretrained=False, depth=2, img_size=56,
      num_classes=0), 0)
  save_for_hf(m, str(folder), safe_serialization=True)
  return m


def test_hf_hub_names_load_offline_from_the_local_cache(tmp_path, monkeypatch):
  cache = str(tmp_path / "hub")
  vit = _save_vit(tmp_path / "vit")
  hf_cache.put(cache, "google/vit-base-patch16-224", str(tmp_path / "vit"))
  dino = _timm_repo(tmp_path / "dino")
  hf_cache.put(cache, "timm/vit_small_patch14_reg4_dinov2.lvd142m",
               str(tmp_path / "dino"))
  from huggingface_hub import scan_cache_dir  # pylint: disable=import-outside-toplevel
  assert len(scan_cache_dir(cache).repos) == 2  # a layout the Hub recognises
  hf_cache.offline(monkeypatch, cache)

  loaded = weights.load("hf-hub:google/vit-base-patch16-224")
  x = images(2, SIZE)
  with torch.no_grad():
    ref = vit(pixel_values=torch_in(x)).logits.numpy()
  assert_close_rel(apply(loaded.model, loaded.variables, x), ref)
  assert loaded.kind == "transformers" and loaded.label_names[1] == "kind 1"

  loaded = weights.load("hf-hub:timm/vit_small_patch14_reg4_dinov2.lvd142m")
  assert loaded.model.num_registers == 4 and loaded.kind == "timm"
  x = images(2, 56, seed=1)
  with torch.no_grad():
    ref = dino(torch_in(x)).numpy()
  assert_close_rel(apply(loaded.model, loaded.variables, x), ref)
  pre = loaded.preprocessing  # DINOv2's pretrained_cfg: bicubic, ImageNet
  assert pre.interpolation == "bicubic" and pre.mean == (0.485, 0.456, 0.406)

  with pytest.raises(weights.CheckpointError,
                     match=r"(?s)google/vit-large-patch16-224.*not in the local "
                     r"Hugging Face cache.*HF_HUB_OFFLINE.*hf download"):
    weights.load("hf-hub:google/vit-large-patch16-224")


def test_hf_hub_name_in_the_predict_cli(tmp_path):
  """The real user path: a CLI process with HF_HUB_OFFLINE=1 and a cache."""
  cache = str(tmp_path / "hub")
  _save_vit(tmp_path / "vit")
  hf_cache.put(cache, "google/vit-base-patch16-224", str(tmp_path / "vit"))
  from PIL import Image  # pylint: disable=import-outside-toplevel
  Image.fromarray(np.full((40, 40, 3), 128, np.uint8)).save(tmp_path / "a.png")
  env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=cache,
             JAX_PLATFORMS="cpu")
  p = subprocess.run(
      [sys.executable, "-m", "vit_jax.predict", "--checkpoint",
       "hf-hub:google/vit-base-patch16-224", "--top_k", "2", "--json",
       str(tmp_path / "a.png")], capture_output=True, text=True, env=env,
      timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  rows = [json.loads(line) for line in p.stdout.splitlines()
          if line.startswith("{")]
  assert rows and rows[-1]["top"][0]["label"].startswith("kind ")


def test_not_a_vit_repo_is_named(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "resnet"}))
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  save_file({"w": np.zeros(3, np.float32)}, str(tmp_path / "model.safetensors"))
  with pytest.raises(weights.CheckpointError, match="model_type='resnet'"):
    weights.load(str(tmp_path))
  os.remove(tmp_path / "model.safetensors")
  (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
  with pytest.raises(weights.CheckpointError, match="a pickle, which is not loaded"):
    weights.load(str(tmp_path))


# ---------------------------------------------------------------------------
# The image towers in transformers' own layouts: DINOv2, CLIP, SigLIP.
# ---------------------------------------------------------------------------

def _tower(kind, seed=0):
  torch.manual_seed(seed)
  common = dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=3,
                intermediate_size=192)
  if kind == "dinov2":
    m = transformers.Dinov2Model(transformers.Dinov2Config(
        image_size=56, patch_size=14, mlp_ratio=2, **{
            k: v for k, v in common.items() if k != "intermediate_size"}))
    size = 56
  elif kind == "clip":
    m = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
        image_size=64, patch_size=16, **common))
    size = 64
  else:
    m = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        image_size=64, patch_size=16, **common))
    size = 64
  return perturb_torch(m, seed), size


@pytest.mark.parametrize("kind", ["dinov2", "clip", "siglip"])
def test_image_towers_match_transformers_both_ways(kind, tmp_path):
  m, size = _tower(kind)
  x = images(2, size, seed=4)
  model, variables = formats.from_transformers(m)
  with torch.no_grad():
    out = m(pixel_values=torch_in(x))
  rel = assert_close_rel(apply(model, variables, x),
                         out.pooler_output.numpy(), what="pooler_output")
  print(f"\nPARITY transformers {type(m).__name__}: pooler_output rel "
        f"{rel.rel:.2g}")
  if kind != "clip":  # CLIP's last_hidden_state skips the final LayerNorm
    assert_close_rel(apply(model, variables, x, method=model.forward_features),
                     out.last_hidden_state.numpy(), what="last_hidden_state")
  back = formats.to_transformers(variables)
  fresh, _ = _tower(kind, seed=1)
  fresh.load_state_dict(back, strict=True)
  for k, v in m.state_dict().items():
    if k != "embeddings.mask_token":  # masked-image training only: zeros
      assert torch.equal(back[k], v), k
  # The saved directory (the Hub's names, config.json) loads the same.
  m.save_pretrained(tmp_path)
  loaded = weights.load(str(tmp_path))
  assert_close_rel(apply(loaded.model, loaded.variables, x),
                   out.pooler_output.numpy(), what="from the directory")


def test_clip_model_vision_half():
  torch.manual_seed(0)
  config = transformers.CLIPConfig(
      text_config=dict(hidden_size=32, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=64),
      vision_config=dict(hidden_size=96, num_hidden_layers=2,
                         num_attention_heads=3, intermediate_size=192,
                         image_size=64, patch_size=16))
  m = perturb_torch(transformers.CLIPModel(config), 0)
  x = images(2, 64)
  model, variables = formats.from_transformers(m.state_dict(), config)
  assert model.act == "quick_gelu" and model.layer_norm_eps == 1e-5
  with torch.no_grad():
    ref = m.vision_model(pixel_values=torch_in(x)).pooler_output.numpy()
  assert_close_rel(apply(model, variables, x), ref)


def test_an_unreachable_hub_fails_fast_without_hf_hub_offline(tmp_path,
                                                             monkeypatch):
  """No HF_HUB_OFFLINE, no network: the cache is read at once, and a repo
  that is not there fails in well under huggingface_hub's retries, naming
  HF_HUB_OFFLINE=1 and the command that fetches it."""
  import time  # pylint: disable=import-outside-toplevel

  from huggingface_hub import constants  # pylint: disable=import-outside-toplevel
  from vit_jax.data import net  # pylint: disable=import-outside-toplevel
  cache = str(tmp_path / "hub")
  _save_vit(tmp_path / "vit")
  hf_cache.put(cache, "google/vit-base-patch16-224", str(tmp_path / "vit"))
  monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
  monkeypatch.setenv("HF_HUB_CACHE", cache)
  monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
  # A dead endpoint: any request would fail (after retries).
  monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
  asked = []
  monkeypatch.setattr(net, "online", lambda host, timeout=4.0: asked.append(
      host) or False)
  loaded = weights.load("hf-hub:google/vit-base-patch16-224")
  assert loaded.kind == "transformers" and asked == ["127.0.0.1"]
  t0 = time.perf_counter()
  with pytest.raises(weights.CheckpointError,
                     match=r"(?s)vit-large-patch16-224.*not in the local "
                     r"Hugging Face cache.*127.0.0.1 cannot be reached.*"
                     r"HF_HUB_OFFLINE=1.*hf download"):
    weights.load("hf-hub:google/vit-large-patch16-224")
  assert time.perf_counter() - t0 < 5
