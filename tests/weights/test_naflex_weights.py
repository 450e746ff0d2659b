"""SigLIP 2 NaFlex (issue 22) against timm's ``NaFlexVit`` and transformers'
``Siglip2VisionModel``: random weights, every parameter perturbed (the
position grid and every bias off their initial values), loaded through
``formats.from_timm`` / ``formats.from_transformers``; a batch of two images
of different aspect ratios padded to one length, and plain NHWC images at a
non-square size, at float32 highest precision within 1e-4 relative; the
layouts back strictly and bit for bit; ``hf-hub:`` names of both from a
local Hub cache.

timm and transformers compute different things on padded positions (timm
adds no position there and masks padded queries too; transformers adds
the first position row and masks keys only): both ignore them, so valid
tokens and pooled outputs are compared.

Reduced models (2 blocks, width 192 or 96), small patch grids.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from compare import assert_close_rel, images, perturb_torch, torch_in
from vit_jax import formats
from vit_jax.data import naflex as data_naflex
from vit_jax.weights.pretrained import meta_device

timm = pytest.importorskip("timm")

from timm.data.naflex_transforms import patchify_image  # noqa: E402

DEPTH = 2
# (timm name, overrides (reduced width; the head width kept where it is
# the family's)). RADIO v3-B resizes its grid with align_corners=True,
# v4-SO400M with False; timm's own NaFlex ViTs use antialiased bicubic.
CASES = [
    ("naflexvit_base_patch16_siglip", dict(embed_dim=192, num_heads=3)),
    ("naflexvit_so400m_patch16_siglip", dict(embed_dim=192, num_heads=3)),
    ("naflexvit_base_patch16_radio_v3", dict(embed_dim=192, num_heads=3)),
    ("naflexvit_so400m_patch16_radio_v4", dict(embed_dim=192, num_heads=3)),
    ("naflexvit_base_patch16_par_gap", dict(embed_dim=192, num_heads=3)),
]
IDS = [c[0] for c in CASES]
# Two images of different aspect ratios (in patches): 3x5 and 6x2, padded
# to 20 tokens.
SHAPES = [(3, 5), (6, 2)]
SEQ = 20


def timm_model(name, overrides, seed=0, num_classes=7):
  torch.manual_seed(seed)
  m = timm.create_model(name, pretrained=False, depth=DEPTH,
                        num_classes=num_classes, **overrides)
  return perturb_torch(m, seed, std=0.1, weights_only=True)


def two_images(seed=0, p=16, shapes=SHAPES, seq=SEQ):
  """timm's patchifier on two random images of ``shapes`` (in patches),
  padded to ``seq`` as its collator pads: torch dict and numpy dict."""
  rng = np.random.default_rng(seed)
  out = {"patches": [], "patch_coord": [], "patch_valid": []}
  for h, w in shapes:
    img = torch.from_numpy(rng.standard_normal((3, h * p, w * p)).astype(
        np.float32))
    patches, coord, valid = patchify_image(img, (p, p))
    pad = seq - patches.shape[0]
    out["patches"].append(torch.cat([patches, torch.zeros(pad, patches.shape[1])]))
    out["patch_coord"].append(torch.cat([coord, torch.zeros(pad, 2, dtype=coord.dtype)]))
    out["patch_valid"].append(torch.cat([valid, torch.zeros(pad, dtype=torch.bool)]))
  t = {k: torch.stack(v) for k, v in out.items()}
  return t, {k: v.numpy() for k, v in t.items()}


def _run(model, variables, x, **kw):
  """``model.apply(variables, x, train=False, **kw)``, compiled (eagerly,
  each op is compiled on its own: 8 of this file's 27 s on an AMD Zen 1)."""
  fn = jax.jit(lambda v, x: model.apply(v, x, train=False, **kw))
  with jax.default_matmul_precision("highest"):
    return fn(variables, jax.tree_util.tree_map(jnp.asarray, x))


def _valid_rows(tokens, valid, prefix):
  """Every prefix token and the valid patch tokens, image by image."""
  tokens = np.asarray(tokens)
  return np.concatenate([np.concatenate([t[:prefix], t[prefix:][v]])
                         for t, v in zip(tokens, np.asarray(valid))])


@pytest.mark.parametrize("name, overrides", CASES, ids=IDS)
def test_naflexvit_matches_timm_both_ways(name, overrides, record_property):
  m = timm_model(name, overrides)
  model, variables = formats.from_timm(m.state_dict(), name,
                                       num_heads=overrides["num_heads"])
  assert model.naflex is not None
  batch_t, batch = two_images()
  with torch.no_grad():
    ref = m(batch_t).numpy()
    ref_feats = m.forward_features(**batch_t)["patches"].numpy()
  feats = _run(model, variables, batch, method=model.forward_features)
  got = _run(model, variables, feats, method=model.forward_head)
  rel = assert_close_rel(got, ref, what="logits (NaFlex batch)")
  p = model.num_prefix_tokens
  frel = assert_close_rel(_valid_rows(feats["patches"], batch["patch_valid"], p),
                          _valid_rows(ref_feats, batch["patch_valid"], p),
                          what="valid tokens (NaFlex batch)")
  np.testing.assert_array_equal(feats["patch_valid"], batch["patch_valid"])
  # Plain NHWC images at a non-square size: the grid resized to 3x5.
  x = images(2, 80, seed=1, height=48)
  with torch.no_grad():
    ref_img = m(torch_in(x)).numpy()
    ref_img_feats = m.forward_features(torch_in(x)).numpy()
  irel = assert_close_rel(_run(model, variables, x), ref_img,
                          what="logits (48x80 images)")
  assert_close_rel(_run(model, variables, x, method=model.forward_features),
                   ref_img_feats, what="forward_features (48x80 images)")
  record_property("rel_err", max(rel.rel, frel.rel, irel.rel))
  print(f"\nPARITY {name} NaFlex 3x5 + 6x2 patches in {SEQ}: logits rel "
        f"{rel.rel:.2g}, valid tokens rel {frel.rel:.2g}; 48x80 images: "
        f"logits rel {irel.rel:.2g}")
  # Back: timm's NaFlexVit loads ours strictly, bit for bit.
  back = formats.to_timm(variables)
  timm_model(name, overrides, seed=1).load_state_dict(back, strict=True)
  for k, v in m.state_dict().items():
    assert torch.equal(back[k], v), k


def test_naflex_without_a_name_is_refused():
  """The weights do not say how the grid is resized per image: a timm
  NaFlexVit state dict needs its name, and a name of another family is
  refused saying why; a grid's weights under the name of a factorized
  embedding (parfac: tests/weights/test_timm_blocks.py) too."""
  m = timm_model(*CASES[0])
  with pytest.raises(ValueError, match="NaFlexVit.*naflexvit_base_patch16_"
                     "siglip"):
    formats.from_timm(m.state_dict(), num_heads=3)
  with pytest.raises(ValueError, match="not a timm NaFlexVit name"):
    formats.from_timm(m.state_dict(), "vit_base_patch16_siglip_256",
                      num_heads=3)
  with pytest.raises(ValueError, match=re.escape(
      "no factorized position embedding (the name: a factorized position "
      "embedding)")):
    formats.from_timm(m.state_dict(),
                      "naflexvit_base_patch16_parfac_gap", num_heads=3)


# ---------------------------------------------------------------------------
# transformers' Siglip2VisionModel.
# ---------------------------------------------------------------------------

def _siglip2(seed=0, num_patches=64):
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(seed)
  cfg = transformers.Siglip2VisionConfig(
      hidden_size=96, intermediate_size=192, num_hidden_layers=DEPTH,
      num_attention_heads=3, patch_size=16, num_patches=num_patches)
  return perturb_torch(transformers.Siglip2VisionModel(cfg), seed, std=0.1)


def _siglip2_inputs(seed=0, shapes=SHAPES, seq=SEQ):
  """transformers' Siglip2 inputs (its processor's layout: each image's
  h*w patches first, row-major, zero padding) and ours from them."""
  _, batch = two_images(seed, shapes=shapes, seq=seq)
  mask = batch["patch_valid"].astype(np.int64)
  hf = dict(pixel_values=torch.from_numpy(batch["patches"]),
            pixel_attention_mask=torch.from_numpy(mask),
            spatial_shapes=torch.tensor(shapes))
  return hf, data_naflex.from_siglip2(batch["patches"], mask, shapes)


def test_siglip2_matches_transformers_both_ways(tmp_path):
  transformers = pytest.importorskip("transformers")
  m = _siglip2()
  model, variables = formats.from_transformers(m)
  assert (model.naflex, model.naflex_grid, model.act, model.classifier) == (
      "bilinear_aa", (8, 8), "gelu_tanh", "map")
  hf_in, batch = _siglip2_inputs()
  with torch.no_grad():
    out = m(**hf_in)
  feats = _run(model, variables, batch, method=model.forward_features)
  pooled = _run(model, variables, feats, method=model.forward_head)
  rel = assert_close_rel(pooled, out.pooler_output.numpy(),
                         what="pooler_output")
  valid = batch["patch_valid"]
  frel = assert_close_rel(_valid_rows(feats["patches"], valid, 0),
                          _valid_rows(out.last_hidden_state.numpy(), valid, 0),
                          what="last_hidden_state (valid tokens)")
  print(f"\nPARITY transformers Siglip2VisionModel 3x5 + 6x2 in {SEQ}: "
        f"pooler_output rel {rel.rel:.2g}, valid tokens rel {frel.rel:.2g}")
  # Our dict back in transformers' form gives its inputs.
  pv, mask, shapes = data_naflex.to_siglip2(batch)
  np.testing.assert_array_equal(shapes, np.asarray(SHAPES))
  np.testing.assert_array_equal(mask, hf_in["pixel_attention_mask"].numpy())
  # Back: bit for bit, strictly.
  back = formats.to_transformers(variables)
  _siglip2(seed=1).load_state_dict(back, strict=True)
  for k, v in m.state_dict().items():
    assert torch.equal(back[k], v), k
  # A Siglip2Model's image tower (Hub names: vision_model.*) with its
  # config.json, from a save_pretrained directory.
  full = transformers.Siglip2Model(transformers.Siglip2Config(
      vision_config=m.config.to_dict(),
      text_config=dict(hidden_size=32, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=2,
                       vocab_size=99)))
  full.vision_model.load_state_dict(m.state_dict())
  full.save_pretrained(tmp_path)
  model2, variables2 = formats.from_transformers(str(tmp_path))
  assert_close_rel(_run(model2, variables2, batch), pooled,
                   what="Siglip2Model directory")


def test_timm_and_transformers_trees_cross_over():
  """timm's NaFlexVit SigLIP 2 tree exports to transformers'
  Siglip2VisionModel, which computes the same valid tokens and pooled
  features on the same patches."""
  transformers = pytest.importorskip("transformers")
  name = "naflexvit_base_patch16_siglip"
  m = timm_model(name, dict(embed_dim=96, num_heads=3), num_classes=0)
  _, variables = formats.from_timm(m.state_dict(), name, num_heads=3)
  hf = transformers.Siglip2VisionModel(transformers.Siglip2VisionConfig(
      hidden_size=96, intermediate_size=384, num_hidden_layers=DEPTH,
      num_attention_heads=3, patch_size=16, num_patches=256))
  hf.load_state_dict(formats.to_transformers(variables), strict=True)
  batch_t, batch = two_images(seed=3)
  hf_in = dict(pixel_values=batch_t["patches"],
               pixel_attention_mask=batch_t["patch_valid"].long(),
               spatial_shapes=torch.tensor(SHAPES))
  with torch.no_grad():
    ref = m(batch_t).numpy()
    feats = m.forward_features(**batch_t)["patches"].numpy()
    out = hf(**hf_in)
  assert_close_rel(out.pooler_output.numpy(), ref, what="pooled")
  valid = batch["patch_valid"]
  assert_close_rel(_valid_rows(out.last_hidden_state.numpy(), valid, 0),
                   _valid_rows(feats, valid, 0), what="valid tokens")


def test_hf_hub_names_of_timm_and_transformers(tmp_path, monkeypatch):
  """``hf-hub:timm/naflexvit_base_patch16_siglip.v2_webli`` (timm's repo:
  config.json's architecture names the resize) and a transformers SigLIP 2
  NaFlex repo (Siglip2Model + its processor's token budget) from a local
  Hub cache laid out as the Hub lays it out, offline."""
  transformers = pytest.importorskip("transformers")
  import hf_cache  # pylint: disable=import-outside-toplevel
  from timm.models._hub import save_for_hf  # pylint: disable=import-outside-toplevel
  from vit_jax import weights  # pylint: disable=import-outside-toplevel
  name = "naflexvit_base_patch16_siglip"
  # Width 192: its heads (3) are the width's usual number, which timm's
  # config.json does not state.
  m = timm_model(name, dict(embed_dim=192, num_heads=3), num_classes=0)
  save_for_hf(m, str(tmp_path / "timm"), safe_serialization=True)
  hf = _siglip2()
  hf.save_pretrained(tmp_path / "google")
  transformers.Siglip2ImageProcessor(max_num_patches=64).save_pretrained(
      tmp_path / "google")
  cache = str(tmp_path / "hub")
  hf_cache.put(cache, f"timm/{name}.v2_webli", str(tmp_path / "timm"))
  hf_cache.put(cache, "google/siglip2-tiny-patch16-naflex",
               str(tmp_path / "google"))
  hf_cache.offline(monkeypatch, cache)

  loaded = weights.load(f"hf-hub:timm/{name}.v2_webli")
  assert loaded.kind == "timm" and loaded.model.naflex == "bilinear_aa"
  pre = loaded.preprocessing  # timm's NaFlex eval: 576 tokens, bicubic
  assert (pre.max_seq_len, pre.interpolation, pre.mean) == (
      576, "bicubic", (0.5, 0.5, 0.5))
  batch_t, batch = two_images(seed=4)
  with torch.no_grad():
    ref = m(batch_t).numpy()
  assert_close_rel(_run(loaded.model, loaded.variables, batch), ref)

  loaded = weights.load("hf-hub:google/siglip2-tiny-patch16-naflex")
  assert loaded.kind == "transformers" and loaded.model.naflex == "bilinear_aa"
  assert (loaded.preprocessing.max_seq_len,
          loaded.preprocessing.interpolation) == (64, "bilinear")
  hf_in, batch = _siglip2_inputs(seed=4)
  with torch.no_grad():
    ref = hf(**hf_in).pooler_output.numpy()
  assert_close_rel(_run(loaded.model, loaded.variables, batch), ref)


# ---------------------------------------------------------------------------
# Every timm NaFlexVit name: our decoding against timm's modules.
# ---------------------------------------------------------------------------

def _naflex_facts(m):
  """What our fields say, read off timm's NaFlexVit modules."""
  e, b = m.embeds, m.blocks[0]
  interp = e.pos_embed_interp_mode + ("_aa" if e.pos_embed_antialias else "")
  return dict(
      hidden_size=m.embed_dim, num_heads=b.attn.num_heads,
      mlp_dim=b.mlp.fc2.in_features, layer_norm_eps=b.norm1.eps,
      act="gelu_tanh" if type(b.mlp.act).__name__ == "GELUTanh" else "gelu",
      num_registers=m.num_reg_tokens, has_class_token=m.has_class_token,
      qkv_bias=b.attn.qkv.bias is not None,
      layer_scale=not isinstance(b.ls1, torch.nn.Identity),
      classifier={"token": "token", "avg": "gap", "map": "map"}[m.global_pool],
      fc_norm=not isinstance(m.fc_norm, torch.nn.Identity),
      final_norm=(not isinstance(m.norm, torch.nn.Identity)) or not
      isinstance(m.fc_norm, torch.nn.Identity),
      naflex=interp, naflex_square=e.pos_embed_ar_preserving,
      naflex_align_corners=e.pos_embed_align_corners,
      naflex_grid=tuple(e.pos_embed.shape[1:3]))


def test_every_naflexvit_name_decodes_like_timm():
  names = sorted({n.split(".")[0] for n in timm.list_models("naflexvit_*")
                  if "_parfac_" not in n})
  assert len(names) >= 12, names
  bad = []
  for name in names:
    with meta_device():
      m = timm.create_model(name, pretrained=False, depth=1)
    sd = {k: np.broadcast_to(np.float32(0), tuple(v.shape))
          for k, v in m.state_dict().items()}
    model, _ = formats.from_timm(sd, name)
    want = _naflex_facts(m)
    got = {k: getattr(model, k) for k in want if k != "layer_scale"}
    got["layer_scale"] = model.layer_scale_init is not None
    got["naflex_grid"] = tuple(got["naflex_grid"])
    diff = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    if diff:
      bad.append((name, diff))
  assert not bad, bad
  assert not any(re.search("parfac", n) for n in names)
