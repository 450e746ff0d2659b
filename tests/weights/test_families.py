"""The ViTs people download: AugReg, DeiT-III, DINOv2 (with and without
registers), CLIP (OpenAI QuickGELU, OpenCLIP GELU), SigLIP and SigLIP 2, in
timm's layout. timm's own models with random, perturbed weights (LayerScale,
norms and biases all moved off their initial values) against ours through
``formats.from_timm(state_dict, timm_name)``; ``formats.to_timm`` back is
loaded strictly and bit-exact.

The numeric tests run reduced-depth models at small resolutions; the name
decoding (what the keys cannot say: activation, LayerNorm epsilon, heads) is
checked for every timm name of these families against timm's own modules,
built on the meta device (no memory, no weights).
"""

import re

import numpy as np
import pytest
import torch

from compare import (apply, apply_with_features, assert_close_rel, images,
                     perturb_torch, torch_in)
from vit_jax import formats
from vit_jax.weights.pretrained import meta_device

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

DEPTH = 2

# (timm name, image size for the test, families' sizes S/B/L where timm has them)
CASES = [
    "vit_small_patch16_224.augreg_in21k_ft_in1k",  # AugReg
    "vit_base_patch16_224.augreg2_in21k_ft_in1k",
    "vit_large_patch16_224.augreg_in21k_ft_in1k",
    "deit3_small_patch16_224.fb_in22k_ft_in1k",  # DeiT-III
    "deit3_base_patch16_224.fb_in1k",
    "deit3_large_patch16_224.fb_in1k",
    "vit_small_patch14_dinov2.lvd142m",  # DINOv2
    "vit_base_patch14_dinov2.lvd142m",
    "vit_large_patch14_dinov2.lvd142m",
    "vit_small_patch14_reg4_dinov2.lvd142m",  # DINOv2 with registers
    "vit_base_patch14_reg4_dinov2.lvd142m",
    "vit_large_patch14_reg4_dinov2.lvd142m",
    "vit_base_patch32_clip_quickgelu_224.openai",  # OpenAI CLIP
    "vit_base_patch16_clip_quickgelu_224.openai",
    "vit_large_patch14_clip_quickgelu_224.openai",
    "vit_base_patch16_clip_224.laion2b",  # OpenCLIP
    "vit_large_patch14_clip_224.laion2b",
    "vit_base_patch16_siglip_224.webli",  # SigLIP
    "vit_large_patch16_siglip_256.webli",
    "vit_so400m_patch14_siglip_224.webli",
    "vit_base_patch16_siglip_224.v2_webli",  # SigLIP 2
    "vit_base_patch32_siglip_256.v2_webli",
    "vit_so400m_patch16_siglip_256.v2_webli",
]


def _patch(name):
  return int(re.search(r"patch(\d+)", name).group(1))


def timm_model(name, seed=0, num_classes=7, size=None, **kw):
  """timm's ``name`` with DEPTH blocks at a small size, every weight
  perturbed."""
  size = size or 4 * _patch(name)
  torch.manual_seed(seed)
  m = timm.create_model(name.split(".")[0], pretrained=False, depth=DEPTH,
                        img_size=size, num_classes=num_classes, **kw)
  return perturb_torch(m, seed, std=0.1)


@pytest.mark.parametrize("name", CASES)
def test_family_matches_timm_both_ways(name, record_property):
  m = timm_model(name)
  size = 4 * _patch(name)
  x = images(2, size)
  model, variables = formats.from_timm(m.state_dict(), name)
  with torch.no_grad():
    ref_logits = m(torch_in(x)).numpy()
    ref_feats = m.forward_features(torch_in(x)).numpy()
  logits, feats = apply_with_features(model, variables, x)
  rel = assert_close_rel(logits, ref_logits)
  frel = assert_close_rel(feats, ref_feats, what="forward_features")
  record_property("rel_err", rel.rel)
  print(f"\nPARITY {name}: logits rel {rel.rel:.2g} (max|diff| {rel.err:.2g}, "
        f"max|logit| {rel.scale:.3g}); forward_features rel {frel.rel:.2g}")
  # Back: timm loads ours strictly, bit for bit.
  fresh = timm_model(name, seed=1)
  back = formats.to_timm(variables)
  fresh.load_state_dict(back, strict=True)
  for k, v in m.state_dict().items():
    assert torch.equal(back[k], v), k


@pytest.mark.parametrize("name", [
    "vit_small_patch14_reg4_dinov2", "vit_base_patch16_siglip_224",
    "vit_base_patch16_clip_224"])
def test_no_head_returns_timms_pooled_features(name):
  m = timm_model(name, num_classes=0, seed=3)
  x = images(2, 4 * _patch(name), seed=1)
  model, variables = formats.from_timm(m.state_dict(), name)
  assert not model.num_classes and "head" not in variables["params"]
  with torch.no_grad():
    ref = m(torch_in(x)).numpy()
  assert ref.shape == (2, m.embed_dim)
  assert_close_rel(apply(model, variables, x), ref, what="pooled features")


def test_the_name_decides_the_activation():
  """QuickGELU and GELU CLIP towers have identical keys: only the name
  tells them apart, and it changes the numbers."""
  m = timm_model("vit_base_patch16_clip_quickgelu_224")
  x = images(2, 64)
  quick, v = formats.from_timm(m.state_dict(), "vit_base_patch16_clip_quickgelu_224")
  plain, v2 = formats.from_timm(m.state_dict(), "vit_base_patch16_clip_224")
  assert (quick.act, plain.act) == ("quick_gelu", "gelu")
  with torch.no_grad():
    ref = m(torch_in(x)).numpy()
  assert_close_rel(apply(quick, v, x), ref)
  with pytest.raises(AssertionError):
    assert_close_rel(apply(plain, v2, x), ref)


def test_a_timm_name_decides_only_what_the_keys_cannot():
  """Depth, width and resolution come from the weights (people build timm
  models at other depths and sizes under the same name); their structure
  (here: registers) must be the name's, else the name is refused naming
  the difference and the names of their structure."""
  m = timm_model("vit_small_patch14_reg4_dinov2", embed_dim=192,
                 num_heads=3)
  x = images(2, 56)
  model, variables = formats.from_timm(m.state_dict(),
                                       "vit_small_patch14_reg4_dinov2")
  assert (model.num_registers, model.num_layers, model.hidden_size,
          model.num_heads) == (4, DEPTH, 192, 3)
  with torch.no_grad():
    assert_close_rel(apply(model, variables, x), m(torch_in(x)).numpy())
  with pytest.raises(ValueError, match=r"not a vit_small_patch14_dinov2: they "
                     r"have 4 registers \(the name: 0 registers\).*Names of "
                     r"their structure: .*vit_small_patch14_reg4_dinov2"):
    formats.from_timm(m.state_dict(), "vit_small_patch14_dinov2")


# ---------------------------------------------------------------------------
# Every timm name of these families: our decoding against timm's modules.
# ---------------------------------------------------------------------------

FAMILY = re.compile(r"^(deit3_|vit_.*_(dinov2|clip|clip_quickgelu|siglip|"
                    r"siglip_gap)_\d*|vit_(tiny|small|base|large|huge)_"
                    r"patch\d+_\d+$)")


def _family_names():
  out = []
  for n in timm.list_models():
    base = n.split(".")[0]
    if FAMILY.match(base) and "giant" not in base and "gigantic" not in base:
      out.append(base)
  return sorted(set(out))


def _meta_state_dict(m):
  # Zero-stride arrays: the real shapes, no memory.
  return {k: np.broadcast_to(np.float32(0), tuple(v.shape))
          for k, v in m.state_dict().items()}


def test_every_family_name_decodes_like_timm():
  names = _family_names()
  assert len(names) > 60, names
  bad = []
  for name in names:
    with meta_device():
      m = timm.create_model(name, pretrained=False)
    assert type(m) is VisionTransformer, name
    model, _ = formats.from_timm(_meta_state_dict(m), name)
    b = m.blocks[0]
    act = type(b.mlp.act).__name__
    want = dict(
        hidden_size=m.embed_dim, num_layers=len(m.blocks),
        num_heads=b.attn.num_heads, mlp_dim=b.mlp.fc1.out_features,
        act={"GELU": "gelu", "QuickGELU": "quick_gelu",
             "GELUTanh": "gelu_tanh"}[act],
        layer_norm_eps=b.norm1.eps, num_registers=m.num_reg_tokens,
        no_embed_class=m.no_embed_class and m.num_prefix_tokens > 0,
        pre_norm=not isinstance(m.norm_pre, torch.nn.Identity),
        fc_norm=not isinstance(m.fc_norm, torch.nn.Identity),
        classifier={"token": "token", "avg": "gap", "map": "map"}[m.global_pool],
        patch_bias=m.patch_embed.proj.bias is not None,
        layer_scale=not isinstance(b.ls1, torch.nn.Identity),
        num_classes=m.num_classes)
    if act == "GELU":
      assert b.mlp.act.approximate == "none", name
    got = dict((k, getattr(model, k)) for k in want if k != "layer_scale")
    got["layer_scale"] = model.layer_scale_init is not None
    diff = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    if diff:
      bad.append((name, diff))
  assert not bad, bad


@pytest.mark.parametrize("name", ["vit_base_patch16_224.augreg_in21k",
                                  "deit3_small_patch16_224",
                                  "vit_small_patch14_reg4_dinov2"])
def test_image_size_resamples_as_timm_does(name):
  """Loaded at another resolution, the position embedding is what timm's
  own loader (checkpoint_filter_fn: antialiased bicubic) makes of it."""
  from timm.models.vision_transformer import checkpoint_filter_fn  # pylint: disable=import-outside-toplevel
  p = _patch(name)
  m = timm_model(name)  # a 4x4 grid
  big = timm.create_model(name.split(".")[0], pretrained=False, depth=DEPTH,
                          img_size=6 * p, num_classes=7).eval()
  big.load_state_dict(checkpoint_filter_fn(m.state_dict(), big))
  model, variables = formats.from_timm(m.state_dict(), name, image_size=6 * p)
  x = images(2, 6 * p, seed=5)
  with torch.no_grad():
    assert_close_rel(apply(model, variables, x), big(torch_in(x)).numpy())
