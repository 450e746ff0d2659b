"""Pretrained weights by name, as timm users expect: ``list_models``,
``create_model(name, pretrained=True)`` from a local Hub cache laid out as
the Hub lays it out (one model of each family), the record of each tag
(hub repo, preprocessing, labels, license) equal to timm's, timm's
architecture names in ``get_model``, and names everywhere weights go."""

import json
import os
import subprocess

import jax
import numpy as np
import pytest
import timm
import torch

import hf_cache
import vit_jax
from compare import (apply, assert_close_rel, images, random_timm,
                     timm_logits)
from train_helpers import PYTHON, REPO, env
from vit_jax import models, weights
from vit_jax.data import labels
from vit_jax.weights import pretrained, saving

# One released tag per family: (name, timm kwargs of a small stand-in).
FAMILIES = [
    ("vit_tiny_patch16_224.augreg_in21k_ft_in1k", {}),
    ("deit3_small_patch16_224.fb_in1k", {}),
    ("vit_small_patch14_reg4_dinov2.lvd142m", {}),
    ("vit_base_patch16_clip_224.openai", {}),
    ("vit_base_patch16_siglip_224.webli", {}),
    ("vit_small_patch16_dinov3.lvd1689m", {}),
    ("eva02_tiny_patch14_224.mim_in22k", {}),
    ("vit_pe_core_tiny_patch16_384.fb", {}),
    ("aimv2_large_patch14_224.apple_pt", {}),
    ("deit_tiny_distilled_patch16_224.fb_in1k", {}),
    ("vit_tiny_r_s16_p8_224.augreg_in21k_ft_in1k", {}),  # R+ViT-Ti hybrid
    ("beit_base_patch16_224.in22k_ft_in22k_in1k", {}),  # relative positions
]


def test_list_models_like_timm():
  archs = vit_jax.list_models()
  assert "vit_b_16" in archs and "vit_base_patch16_224" in archs
  assert "vit_small_patch16_dinov3" in archs and len(archs) > 150
  tags = vit_jax.list_models("*dinov3*", pretrained=True)
  assert "vit_small_patch16_dinov3.lvd1689m" in tags
  assert all("dinov3" in t and "." in t for t in tags)
  assert vit_jax.list_models("vit_base_patch16_224*", pretrained=True,
                             exclude=["*in21k*"]) == sorted(
      t for t in vit_jax.list_models("vit_base_patch16_224.*", pretrained=True)
      if "in21k" not in t)
  assert "vit_b_16.tv_in1k" in vit_jax.list_models("vit_b_*", pretrained=True)
  for name, _ in FAMILIES:
    assert name in vit_jax.list_models(pretrained=True), name


def test_records_are_timms():
  """A sample here; the whole table against timm in the slow test below."""
  from timm.models import get_pretrained_cfg  # pylint: disable=import-outside-toplevel
  for name, _ in FAMILIES:
    rec, cfg = pretrained.lookup(name), get_pretrained_cfg(name).to_dict()
    assert rec.hub == cfg["hf_hub_id"]
    assert (rec.mean, rec.std) == (tuple(cfg["mean"]), tuple(cfg["std"]))
    assert rec.crop_pct == cfg["crop_pct"] and rec.num_classes == cfg[
        "num_classes"]
    assert rec.input_size == tuple(cfg["input_size"])
    assert rec.license == cfg.get("license")
  assert pretrained.lookup("vit_base_patch16_clip_224.openai").head == "embedding"
  assert pretrained.lookup("vit_small_patch16_dinov3.lvd1689m").head == "none"
  rec = pretrained.lookup("vit_base_patch16_224.augreg_in21k")
  assert rec.labels == "imagenet-21k-goog" and rec.num_classes == 21843
  assert pretrained.lookup("vit_base_patch16_224").name == (
      timm.models.get_pretrained_cfg("vit_base_patch16_224").to_dict()[
          "architecture"] + "." +
      timm.models.get_pretrained_cfg("vit_base_patch16_224").tag)
  pre = pretrained.lookup("vit_base_patch16_siglip_224.webli").preprocessing()
  assert (pre.crop_size, pre.resize_size) == (224, 248)  # crop_pct 0.9


@pytest.mark.slow
def test_the_tables_are_timms_today():
  """Every name that maps is listed or refused by name (the numbers of the
  listed ones: test_registry.py, the same check the generator runs)."""
  archs, records = pretrained.generate(verify=False)
  from vit_jax.models import _timm_archs  # pylint: disable=import-outside-toplevel
  from vit_jax.weights import _pretrained_cfgs  # pylint: disable=import-outside-toplevel
  assert archs == _timm_archs.ARCHS, "python -m vit_jax.weights.pretrained --write"
  assert records == _pretrained_cfgs.PRETRAINED


@pytest.mark.parametrize("name", [
    "vit_base_patch16_224", "vit_small_patch14_reg4_dinov2",
    "vit_so400m_patch14_siglip_384", "vit_small_plus_patch16_dinov3",
    "eva02_base_patch14_448", "vit_pe_core_gigantic_patch14_448",
    "aimv2_large_patch14_224", "deit_tiny_distilled_patch16_224",
    "vit_base_patch16_clip_quickgelu_224", "beit_base_patch16_384"])
def test_get_model_builds_timms_architectures(name):
  """timm's names in the one constructor: the parameter count of timm's
  own model (meta device; ours by eval_shape: nothing allocated)."""
  with pretrained.meta_device():
    ref = timm.create_model(name, pretrained=False)
  want = sum(p.numel() for p in ref.parameters())
  model = models.get_model(name)
  size = models.pair(model.image_size)
  shapes = jax.eval_shape(lambda: model.init(
      jax.random.key(0), jax.numpy.zeros((1, *size, 3)), train=False))
  got = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(
      shapes["params"]))
  assert got == want, (name, got, want)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
  """A local Hub cache with a timm repo (config.json + model.safetensors)
  for one tag of each family, random small stand-ins of the architecture
  under the record's repo id."""
  cache = tmp_path_factory.mktemp("hub")
  nets = {}
  for i, (name, kw) in enumerate(FAMILIES):
    rec = pretrained.lookup(name)
    arch = rec.architecture
    size = 56 if "patch14" in arch else 64
    m = random_timm(seed=i, name=arch, depth=2, size=size,
                    num_classes=rec.num_classes, **kw)
    if rec.head == "embedding":  # timm stores CLIP's projection so
      with torch.no_grad():
        m.head.bias.zero_()
    folder = tmp_path_factory.mktemp(arch)
    from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
    save_file({k: v.contiguous() for k, v in m.state_dict().items()},
              str(folder / "model.safetensors"))
    cfg = timm.models.get_pretrained_cfg(name).to_dict()
    (folder / "config.json").write_text(json.dumps({
        "architecture": arch, "num_classes": rec.num_classes,
        "pretrained_cfg": {k: cfg[k] for k in ("input_size", "crop_pct",
                                               "interpolation", "mean",
                                               "std") if k in cfg}}))
    hf_cache.put(str(cache), rec.hub, str(folder))
    nets[name] = (m, size)
  return str(cache), nets


@pytest.mark.parametrize("name", [n for n, _ in FAMILIES])
def test_create_model_pretrained_from_a_local_hub_cache(hub, name,
                                                        monkeypatch):
  cache, nets = hub
  hf_cache.offline(monkeypatch, cache)
  m, size = nets[name]
  rec = pretrained.lookup(name)
  loaded = vit_jax.create_model(name, pretrained=True)
  model, variables, pre = loaded
  x = images(2, size, seed=3)
  assert_close_rel(apply(model, variables, x), timm_logits(m, x), what=name)
  assert loaded.info["pretrained"]["hub"] == rec.hub
  want = rec.preprocessing()  # the record's, at the stand-in's size
  assert (pre.mean, pre.std, pre.interpolation) == (want.mean, want.std,
                                                    want.interpolation)
  # The weights' own size where the position embedding (or BEiT's
  # relative position table) tells (a RoPE-only model, DINOv3, runs at any
  # size: the record's).
  assert pre.crop_size == (size if model.abs_pos_embed or model.rel_pos_bias
                           else rec.input_size[-1])
  assert loaded.head == rec.head
  if rec.labels == "imagenet-1k":
    assert loaded.label_names == labels.imagenet_categories()
  else:
    assert loaded.label_names is None
  if rec.head == "embedding":
    assert loaded.num_classes == 0 and loaded.embedding_dim == rec.num_classes


def test_names_wherever_weights_go(hub, monkeypatch, tmp_path):
  cache, nets = hub
  hf_cache.offline(monkeypatch, cache)
  name = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
  loaded = weights.load(name)  # the bare name, as a path would be
  assert loaded.info["pretrained"]["name"] == name
  two = vit_jax.create_model(name, pretrained=True, num_classes=3)
  assert two.model.num_classes == 3 and two.label_names is None
  assert not np.any(np.asarray(two.variables["params"]["head"]["kernel"]))
  with pytest.raises(weights.CheckpointError, match=r"Close: vit_tiny_patch16"):
    weights.load("vit_tinny_patch16_224.augreg_in21k_ft_in1k")
  with pytest.raises(weights.CheckpointError,
                     match=r"no pretrained weights tagged 'nope'.*augreg"):
    weights.load("vit_tiny_patch16_224.nope")
  # The CLIs' --checkpoint takes it too.
  from PIL import Image  # pylint: disable=import-outside-toplevel
  Image.fromarray(np.zeros((70, 50, 3), np.uint8)).save(tmp_path / "x.png")
  e = env()
  e.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=cache)
  p = subprocess.run([PYTHON, "-m", "vit_jax.predict", "--checkpoint", name,
                      "--top-k", "1", str(tmp_path / "x.png")], cwd=REPO,
                     env=e, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.startswith(f"== {name}: {name} (timm/{name})"), p.stdout


def test_create_model_random_init_has_the_records_preprocessing():
  loaded = vit_jax.create_model("vit_small_patch16_dinov3", num_classes=5,
                                image_size=64)
  model, variables, pre = loaded
  assert model.num_classes == 5 and model.rope == "dinov3"
  assert pre.mean == (0.485, 0.456, 0.406) and pre.crop_size == 64
  out = apply(model, variables, np.zeros((1, 64, 64, 3), np.float32))
  assert out.shape == (1, 5)
  m, v, _ = vit_jax.create_model("vit_b_16", num_layers=1)
  assert m.hidden_size == 768 and "head" in v["params"]


def test_random_init_draws_every_layer_its_own_values():
  """create_model's random variables (drawn by the model's scanned form
  where its blocks are alike, then laid out per layer): the model's own
  tree, deterministic in the seed, every block its own draw at its
  initialiser's scale; where the blocks differ (SAM's windowed and global
  ones) the model is initialised as it is."""
  model, v, _ = vit_jax.create_model("vit_ti_16", num_layers=3,
                                     num_classes=4, image_size=32)
  assert not model.scan_layers
  weights.check(model, v, 32)
  blocks = v["params"]["Transformer"]
  k = [np.asarray(blocks[f"encoderblock_{i}"]["MlpBlock_0"]["Dense_0"]
                  ["kernel"]) for i in range(3)]
  assert not np.array_equal(k[0], k[1]) and not np.array_equal(k[1], k[2])
  fan_in, fan_out = k[0].shape  # xavier_uniform: std sqrt(2 / (in + out))
  want = np.sqrt(2.0 / (fan_in + fan_out))
  assert all(abs(x.std() / want - 1) < 0.05 for x in k), [x.std() for x in k]
  _, again, _ = vit_jax.create_model("vit_ti_16", num_layers=3,
                                     num_classes=4, image_size=32)
  _, other, _ = vit_jax.create_model("vit_ti_16", num_layers=3,
                                     num_classes=4, image_size=32, seed=1)
  for x, y, z in zip(*(jax.tree_util.tree_leaves(t) for t in (v, again,
                                                               other))):
    np.testing.assert_array_equal(x, y)
  assert not np.array_equal(k[0], other["params"]["Transformer"][
      "encoderblock_0"]["MlpBlock_0"]["Dense_0"]["kernel"])
  out = apply(model, v, np.zeros((2, 32, 32, 3), np.float32))
  assert out.shape == (2, 4) and np.all(np.isfinite(out))
  sam, sv, _ = vit_jax.create_model("samvit_base_patch16", num_layers=2,
                                    image_size=64)
  weights.check(sam, sv, 64)


def _preprocessed_ok(pre, model, image):
  """``Loaded.preprocess`` of ``image`` with ``pre``: what the model takes
  (no weights needed to prepare an image)."""
  x = weights.Loaded(model, {}, pre).preprocess(image)
  if model.naflex is not None:
    n = len(x["patches"])
    assert 0 < n <= pre.max_seq_len, (n, pre.max_seq_len)
    assert x["patches"].shape[1] == model.patch_size ** 2 * 3
  else:
    assert x.shape == (pre.crop_size, pre.crop_size, 3), x.shape
  return x


def test_every_names_preprocessing_prepares_an_image():
  """create_model(name).preprocess for every name list_models gives
  (architectures and tags): the recipe create_model attaches
  (weights.initial_preprocessing, here without initialising ~600 models)
  prepares a non-square image; a NaFlex recipe carries its token budget
  (the patches of its record's input size)."""
  image = np.random.default_rng(0).integers(0, 256, (30, 44, 3), np.uint8)
  names = vit_jax.list_models() + vit_jax.list_models(pretrained=True)
  naflex = 0
  for name in names:
    model = models.get_model(name.split(".", 1)[0])
    _, pre = weights.initial_preprocessing(name, model)
    try:
      _preprocessed_ok(pre, model, image)
    except Exception as e:  # pylint: disable=broad-except
      raise AssertionError(f"{name}: {e}") from e
    naflex += model.naflex is not None
  assert naflex >= 13 + 10  # every naflexvit_* architecture and tag
  budgets = {n: weights.initial_preprocessing(n, models.get_model(n))[1]
             for n in ("naflexvit_base_patch16_siglip",
                       "naflexvit_base_patch16_radio_v3",
                       "naflexvit_base_patch16_map")}  # the last: no record
  assert {n: p.max_seq_len for n, p in budgets.items()} == {
      "naflexvit_base_patch16_siglip": 576,  # 384 px / 16: timm's 576
      "naflexvit_base_patch16_radio_v3": 1024,  # C-RADIO's 512 px
      "naflexvit_base_patch16_map": 576}
  assert pretrained.lookup(
      "naflexvit_so400m_patch16_siglip.v2_webli").max_seq_len == 576
  assert pretrained.lookup("vit_base_patch16_224").max_seq_len is None


@pytest.mark.parametrize("name", ["naflexvit_base_patch16_siglip",
                                  "naflexvit_base_patch16_radio_v3"])
def test_create_model_naflex_preprocess_runs(name):
  """The README's snippet on a NaFlex name: create_model(name).preprocess
  (image), batch, apply (small widths: the recipe is the name's)."""
  loaded = vit_jax.create_model(name, num_layers=1, hidden_size=64,
                                num_heads=2, mlp_dim=128)
  rec = pretrained.lookup(name)
  assert loaded.preprocessing == rec.preprocessing()
  image = np.random.default_rng(1).integers(0, 256, (60, 90, 3), np.uint8)
  x = _preprocessed_ok(loaded.preprocessing, loaded.model, image)
  out = jax.jit(lambda v, b: loaded.model.apply(v, b, train=False))(
      loaded.variables, loaded.batch([x]))
  assert out.shape == (1, 64) and np.all(np.isfinite(np.asarray(out)))


def test_torchvision_releases_are_records():
  rec = pretrained.lookup("vit_b_16.tv_swag_e2e_in1k")
  assert rec.source == "torchvision:IMAGENET1K_SWAG_E2E_V1"
  assert rec.architecture == "vit_b_16"


def test_train_py_init_weights_takes_a_name(hub, monkeypatch):
  """--config.init_weights=<name.tag>: the record's repo and preprocessing
  (the model name of the config is not needed)."""
  from train_helpers import tiny_config  # pylint: disable=import-outside-toplevel
  from vit_jax.train import init as train_init  # pylint: disable=import-outside-toplevel
  cache, _ = hub
  hf_cache.offline(monkeypatch, cache)
  name = "vit_small_patch14_reg4_dinov2.lvd142m"
  cfg = tiny_config(init_weights=name, image_size=28)
  init = train_init.load_initial_weights(cfg)
  assert init.arch["hidden_size"] == 384 and init.arch["num_registers"] == 4
  assert init.description.startswith(name)
  assert init.preprocessing.mean == (0.485, 0.456, 0.406)


# One timm name per structure value (class token, MAP head, registers,
# LayerScale, norms, biases, gated MLPs, RoPE without a position embedding,
# NaFlex, a distillation token, CaiT's class attention and talking heads,
# a shared relative position MLP, ViTamin's stem and MLP input norm,
# differential attention, parallel blocks (fused and split), a factorized
# NaFlex embedding): together every value of every field the name check
# compares.
STRUCTURES = ["vit_base_patch8_224", "aimv2_1b_patch14_224",
              "naflexvit_base_patch16_gap", "eva02_base_patch16_clip_224",
              "vit_pe_core_base_patch16_224", "vit_base_patch16_radio_v3",
              "vit_giant_patch14_reg1_tipsv2", "vit_7b_patch16_dinov3",
              "vit_huge_patch16_radio_v4", "deit_base_distilled_patch16_224",
              "samvit_base_patch16", "beit_base_patch16_224",
              "cait_xxs24_224", "vit_srelpos_small_patch16_224",
              "vit_small_patch16_rope_mixed_224", "vitamin_xlarge_256",
              "vit_dpwee_patch16_reg1_gap_256", "vit_base_patch16_xp_224",
              "naflexvit_base_patch16_parfac_gap"]


def test_the_name_check_reads_every_structure_as_the_records_say():
  """Every structure of the table covered; each name's own weights (its
  tree mapped to timm's keys, at a small size) pass the check under their
  name and fail under another's."""
  from vit_jax.models import _timm_archs  # pylint: disable=import-outside-toplevel
  from vit_jax.weights import build, trees  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  check = sys.modules["vit_jax.weights.check"]
  values = {(k, v) for n in _timm_archs.ARCHS
            for k, v in build._structure(build._full_record(n)).items()}  # pylint: disable=protected-access
  covered = {(k, v) for n in STRUCTURES
             for k, v in build._structure(build._full_record(n)).items()}  # pylint: disable=protected-access
  assert values <= covered, values - covered
  state_dicts = {}
  for name in STRUCTURES:
    rec = _timm_archs.ARCHS[name]
    model = models.get_model(
        name, num_layers=1, hidden_size=192, num_heads=3, mlp_dim=384,
        map_heads=3 if rec.get("map_heads") else None, map_mlp_dim=None)
    shapes = check.expected(model, model.image_size or 224)
    state_dicts[name] = weights.to_state_dict(trees.unflatten(
        {k: np.zeros(s, np.float32) for k, s in shapes.items()}), "timm")
    m, _ = weights.from_state_dict(state_dicts[name], name, layout="timm",
                                   num_heads=3)
    assert m.num_layers == 1
  for name, other in zip(STRUCTURES, STRUCTURES[1:] + STRUCTURES[:1]):
    with pytest.raises(build.NameMismatch, match=f"(not a {other}:|'{other}' is not)"):
      weights.from_state_dict(state_dicts[name], other, layout="timm",
                              num_heads=3)


@pytest.mark.parametrize("with_weights", [False, True])
def test_a_misspelt_name_or_tag_is_refused_with_the_fix(with_weights):
  """As timm's create_model: an invalid tag lists the architecture's tags,
  a misspelt architecture the close names, with or without pretrained
  (nothing is downloaded: the name is refused first)."""
  with pytest.raises(ValueError, match=r"'lvd1689'.*its tags: "
                     r"vit_small_patch16_dinov3\.lvd1689m"):
    vit_jax.create_model("vit_small_patch16_dinov3.lvd1689",
                         pretrained=with_weights)
  with pytest.raises(ValueError, match=r"vit_small_patch16_dinov33.*"
                     r"vit_small_patch16_dinov3, "):
    vit_jax.create_model("vit_small_patch16_dinov33", pretrained=with_weights)


def test_no_name_gives_another_names_preprocessing():
  """A name's preprocessing is its own weights' (the default tag's for a
  bare architecture), or its family's where it has none released."""
  from vit_jax.data import preprocessing as pp  # pylint: disable=import-outside-toplevel
  from vit_jax.weights import layouts  # pylint: disable=import-outside-toplevel
  want = pretrained.lookup("vit_small_patch16_dinov3.lvd1689m").preprocessing()
  for name in ("vit_small_patch16_dinov3", "vit_small_patch16_dinov3.lvd1689m"):
    assert vit_jax.create_model(name, num_layers=1).preprocessing == want
  name = "vit_small_patch16_36x1_224"  # an architecture without weights
  assert vit_jax.create_model(name, num_layers=1).preprocessing == (
      pp.from_timm_cfg(layouts.timm_preprocessing_cfg(name)))
