"""The backbones of 2024-2026 against timm's own models (issue 21): DINOv3,
EVA-02, Perception Encoder, AIMv2, DINOv2 giant (SwiGLU), distilled DeiT,
C-RADIO and SigLIP so400m/14 at 384 (a size that is not a multiple of its
patch); post-norm blocks (timm's ``*_rpn_*``, EVA-02-E). timm's models with random weights, every parameter perturbed
(LayerScales near 1, biases and tokens off zero; the computed RoPE buffers
left as timm defines them), against ours through ``formats.from_timm(
state_dict, timm_name)`` at float32 highest precision: logits and
``forward_features`` within 1e-4 relative, at a non-square size for the
RoPE families; ``formats.to_timm`` back loads strictly and bit for bit.

Reduced models (2 blocks, widths cut where the head width stays the
family's), small grids; the name decoding of every timm name of these
families is checked against timm's modules on the meta device.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from compare import (apply, apply_with_features, assert_close_rel, images,
                     perturb_torch, torch_in)
from vit_jax import formats, models
from vit_jax.weights.pretrained import meta_device

timm = pytest.importorskip("timm")

DEPTH = 2
# (timm name, timm overrides, test grid (rows, cols) in patches). Widths are
# cut (keeping the head width) where the family's would only slow the test.
CASES = [
    ("vit_small_patch16_dinov3", {}, (3, 5)),  # DINOv3: RoPE, no biases
    ("vit_small_plus_patch16_dinov3", {}, (5, 3)),  # split SwiGLU
    # (DINOv3 with q/v biases: test_forward_intermediates_match_timm.)
    ("vit_7b_patch16_dinov3", dict(embed_dim=256, num_heads=2), (3, 4)),
    ("eva02_tiny_patch14_224", {}, (3, 5)),  # packed SwiGLU, q/v biases
    ("eva02_base_patch14_224", dict(embed_dim=256, num_heads=4), (3, 5)),
    ("eva02_base_patch16_clip_224", dict(embed_dim=256, num_heads=4), (4, 3)),
    ("vit_pe_core_tiny_patch16_384", {}, (3, 5)),  # PE: MAP over all tokens
    ("vit_pe_lang_large_patch14_448", dict(embed_dim=256, num_heads=4), (3, 5)),
    ("vit_pe_core_gigantic_patch14_448", dict(embed_dim=192, num_heads=2),
     (3, 5)),
    ("aimv2_large_patch14_224", dict(embed_dim=256, num_heads=2), (4, 4)),
    ("vit_giant_patch14_reg4_dinov2", dict(embed_dim=192, num_heads=3), (4, 4)),
    ("deit_tiny_distilled_patch16_224", {}, (4, 4)),
    ("vit_base_patch16_radio_v3", {}, (4, 4)),
    ("vit_so400m_patch16_radio_v4", dict(embed_dim=192, num_heads=3), (4, 4)),
    # q/k normalisation (timm's qk_norm): the keys show it, no name needed
    # (under the name, whose structure has none, it is refused).
    ("vit_small_patch16_224", dict(qk_norm=True), (4, 4)),
    # Post-norm blocks, which only the name shows: timm's ResPostBlock
    # (no class token, average pooling) and EVA-02-E's EvaBlockPostNorm.
    ("vit_base_patch16_rpn_224", dict(embed_dim=192, num_heads=3), (4, 4)),
    ("eva02_enormous_patch14_clip_224", dict(embed_dim=256, num_heads=4),
     (3, 4)),
]
IDS = [c[0] for c in CASES]


def _patch(name):
  return int(re.search(r"patch(\d+)", name).group(1))


def timm_model(name, overrides=None, grid=(4, 4), seed=0, num_classes=7,
               depth=DEPTH, **kw):
  """timm's ``name`` with ``depth`` blocks for a ``grid`` of patches,
  every weight perturbed."""
  p = _patch(name)
  torch.manual_seed(seed)
  m = timm.create_model(name, pretrained=False, depth=depth,
                        img_size=(grid[0] * p, grid[1] * p),
                        num_classes=num_classes, **(overrides or {}), **kw)
  return perturb_torch(m, seed, std=0.1, weights_only=True)


def ours(m, name, overrides=None, **kw):
  heads = (overrides or {}).get("num_heads")
  if (overrides or {}).get("qk_norm"):
    # Another structure than the name's (no timm name has q/k norms here):
    # its keys say all, so it loads without the name.
    name = None
  return formats.from_timm(m.state_dict(), name,
                           **({"num_heads": heads} if heads else {}), **kw)


def _x(name, grid, seed=0, n=2):
  p = _patch(name)
  return images(n, grid[1] * p, seed=seed, height=grid[0] * p)


@pytest.mark.parametrize("name, overrides, grid", CASES, ids=IDS)
def test_family_matches_timm_both_ways(name, overrides, grid, record_property):
  from vit_jax.weights import twins  # pylint: disable=import-outside-toplevel
  m = timm_model(name, overrides, grid)
  model, variables = ours(m, name, overrides)
  x = _x(name, grid)
  with torch.no_grad():
    ref = m(torch_in(x)).numpy()
    ref_feats = m.forward_features(torch_in(x)).numpy()
  with jax.default_matmul_precision("highest"):
    feats = apply(model, variables, x, method=model.forward_features)
    got = apply(model, variables, feats, method=model.forward_head)
  rel = assert_close_rel(got, ref)
  frel = assert_close_rel(feats, ref_feats, what="forward_features")
  record_property("rel_err", rel.rel)
  print(f"\nPARITY {name} {grid[0]}x{grid[1]} patches: logits rel "
        f"{rel.rel:.2g}; forward_features rel {frel.rel:.2g}")
  # Back: timm loads ours strictly, bit for bit.
  back = formats.to_timm(variables)
  timm_model(name, overrides, grid, seed=1).load_state_dict(back, strict=True)
  for k, v in m.state_dict().items():
    assert torch.equal(back[k], v), k
  # timm's model rebuilt from our fields alone (ONNX export's twin) is
  # timm's own: the same class, the same outputs.
  p = _patch(name)
  twin = twins.timm_model(model, variables, (grid[0] * p, grid[1] * p))
  assert type(twin) is type(m)
  with torch.no_grad():
    np.testing.assert_allclose(twin(torch_in(x)).numpy(), ref, rtol=0,
                               atol=1e-6 * np.abs(ref).max())


def test_the_name_decides_the_rope_and_the_pooling():
  """DINOv3 S and a DINOv2-like ViT without position embedding have the
  same keys but for LayerScale's names: only the name says RoPE; and
  without a name an Eva checkpoint is refused, not run without it."""
  m = timm_model("vit_small_patch16_dinov3", grid=(3, 4))
  model, _ = ours(m, "vit_small_patch16_dinov3")
  assert (model.rope, model.rope_temperature, model.layer_norm_eps) == (
      "dinov3", 100.0, 1e-5)
  assert (model.classifier, model.has_class_token, model.num_registers,
          model.abs_pos_embed) == ("gap", True, 4, False)
  token, _ = ours(m, "vit_small_patch16_dinov3", classifier="token")
  assert token.classifier == "token"  # upstream DINOv3's pooling
  with pytest.raises(ValueError, match="rotary position embedding is not "
                     "stored.*vit_small_patch16_dinov3"):
    formats.from_timm(m.state_dict())
  pe = timm_model("vit_pe_core_tiny_patch16_384", grid=(3, 3))
  model, _ = ours(pe, "vit_pe_core_tiny_patch16_384")
  assert (model.rope, model.rope_grid_offset, model.rope_grid_indexing,
          model.rope_ref_grid, model.map_heads, model.pool_include_prefix) == (
              "cat", 1.0, "xy", (24, 24), 8, True)
  with pytest.raises(ValueError, match="CLIP image tower"):
    formats.from_timm(pe.state_dict())  # a norm before the blocks, no name
  # timm models of the same classes that vit_jax does not compute are
  # refused by name, saying what they are.
  with pytest.raises(ValueError, match="Sapiens2 .* not supported"):
    formats.from_timm(m.state_dict(), "vit_base_patch16_sapiens2")
  with pytest.raises(ValueError, match="'vit_small_patch14_dinov2' is not a "
                     "timm name of the Eva families"):
    formats.from_timm(m.state_dict(), "vit_small_patch14_dinov2")


def test_a_structure_the_name_lacks_is_refused():
  m = timm_model("vit_small_patch16_224", dict(qk_norm=True), (2, 2))
  with pytest.raises(ValueError, match=r"not a vit_small_patch16_224: they "
                     r"have q/k norms \(the name: no q/k norms\)"):
    formats.from_timm(m.state_dict(), "vit_small_patch16_224")


@pytest.mark.parametrize("name, grid", [
    ("vit_small_patch16_dinov3_qkvb", (3, 5)),
    ("eva02_tiny_patch14_224", (4, 3))])
def test_forward_intermediates_match_timm(name, grid):
  """Dense features: every block's patch grid (NCHW, as timm) and the
  prefix tokens (class token, registers) apart, through the final norm."""
  m = timm_model(name, grid=grid)
  model, variables = ours(m, name)
  x = _x(name, grid, seed=2)
  with torch.no_grad():
    final, inter = m.forward_intermediates(torch_in(x), indices=[0, -1],
                                           norm=True, output_fmt="NCHW",
                                           return_prefix_tokens=True)
  got_final, got = model.apply(variables, jnp.asarray(x), indices=[0, -1],
                               norm=True, output_fmt="NCHW",
                               return_prefix_tokens=True,
                               method=model.forward_intermediates)
  assert_close_rel(got_final, final.numpy(), what="final")
  for (sp, pre), (rsp, rpre) in zip(got, inter):
    assert sp.shape == tuple(rsp.shape) and pre.shape == tuple(rpre.shape)
    assert_close_rel(sp, rsp.numpy(), what="patch grid")
    assert_close_rel(pre, rpre.numpy(), what="prefix tokens")


def test_dynamic_img_size_matches_timm():
  """RoPE at any size: EVA-02 built with ``dynamic_img_size`` (the learned
  embedding resampled and the RoPE rescaled per input, as timm) at two
  sizes; DINOv3 (no learned embedding) at any size without it."""
  name = "eva02_tiny_patch14_224"
  m = timm_model(name, grid=(4, 4), dynamic_img_size=True)
  model, variables = ours(m, name, dynamic_img_size=True)
  for grid in ((3, 5), (6, 2)):
    x = _x(name, grid, seed=3)
    with torch.no_grad():
      ref = m(torch_in(x)).numpy()
    assert_close_rel(apply(model, variables, x), ref, what=f"{grid}")
  dino = timm_model("vit_small_patch16_dinov3", grid=(2, 2))
  model, variables = ours(dino, "vit_small_patch16_dinov3")
  x = _x("vit_small_patch16_dinov3", (5, 2), seed=4)
  with torch.no_grad():
    ref = dino(torch_in(x)).numpy()
  assert_close_rel(apply(model, variables, x), ref)


def test_scan_remat_and_bfloat16():
  """DINOv3 S+ scanned and rematerialised computes what the per-layer
  model does (and has gradients); bfloat16 compute stays close."""
  name = "vit_small_plus_patch16_dinov3"
  m = timm_model(name, grid=(2, 3), num_classes=5)
  model, variables = ours(m, name)
  scanned, sv = ours(m, name, scan_layers=True, remat_policy="full")
  assert "encoderblock" in sv["params"]["Transformer"]
  x = jnp.asarray(_x(name, (2, 3), seed=5))
  ref = np.asarray(model.apply(variables, x))
  np.testing.assert_allclose(np.asarray(scanned.apply(sv, x)), ref,
                             rtol=1e-5, atol=1e-5)
  grads = jax.grad(lambda v: jnp.sum(scanned.apply(v, x) ** 2))(sv)
  assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))
  low, lv = ours(m, name, dtype="bfloat16")
  assert_close_rel(np.asarray(low.apply(lv, x), np.float32), ref, rel=5e-2,
                   what="bfloat16 logits")


def test_dinov3_train_time_rope_augmentation():
  """The coordinate augmentations run in training only, one draw per
  forward pass from the 'dropout' rng: the same key gives the same output,
  another key another, and evaluation is untouched."""
  name = "vit_small_patch16_dinov3"
  m = timm_model(name, grid=(2, 3))
  model, variables = ours(m, name, rope_shift=0.1, rope_jitter=1.2,
                          rope_rescale=2.0)
  x = jnp.asarray(_x(name, (2, 3), seed=6))
  plain = model.clone(rope_shift=None, rope_jitter=None, rope_rescale=None)
  ev = model.apply(variables, x)
  np.testing.assert_array_equal(ev, plain.apply(variables, x))
  a, b, c = (model.apply(variables, x, train=True,
                         rngs={"dropout": jax.random.key(k)})
             for k in (0, 0, 1))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c) and not np.allclose(a, ev)


def test_distilled_heads_as_timm():
  """DeiT's two heads: averaged in evaluation (and plain training), both
  returned in distilled training; pre-logits are the two tokens' mean."""
  name = "deit_tiny_distilled_patch16_224"
  m = timm_model(name)
  model, variables = ours(m, name)
  x = _x(name, (4, 4), seed=7)
  assert model.distilled and model.num_prefix_tokens == 2
  m.set_distilled_training(True)
  m.train()
  with torch.no_grad():
    cls_logits, dist_logits = m(torch_in(x))
    m.eval()
    pre = m.forward_head(m.forward_features(torch_in(x)), pre_logits=True)
  both = model.clone(distilled_training=True).apply(
      variables, jnp.asarray(x), train=True)
  assert_close_rel(both[0], cls_logits.numpy(), what="class head")
  assert_close_rel(both[1], dist_logits.numpy(), what="distillation head")
  feats = model.apply(variables, jnp.asarray(x), method=model.forward_features)
  assert_close_rel(model.apply(variables, feats, pre_logits=True,
                               method=model.forward_head),
                   pre.numpy(), what="pre_logits")


def test_radio_position_grid_resized_and_cropped_as_timm():
  """C-RADIO's 128x128 position grid (upstream weights) at a non-square
  grid: timm's _convert_radio resizes it bilinearly (align_corners as the
  checkpoint's code) to the larger side's square and crops the top left;
  ours from the same grid in timm's names."""
  from timm.models import vision_transformer as tv  # pylint: disable=import-outside-toplevel
  for name in ("vit_base_patch16_radio_v3", "vit_large_patch16_radio_v3"):
    kw = dict(embed_dim=64, num_heads=1)
    m = timm_model(name, kw, grid=(3, 5), num_classes=0)
    sd = {k: v for k, v in m.state_dict().items() if k != "pos_embed"}
    grid128 = torch.randn(1, 128 * 128, 64, generator=torch.Generator()
                          .manual_seed(0))
    upstream = {"radio_model.model.patch_generator.pos_embed": grid128,
                "radio_model.model.patch_generator.embedder.weight":
                    sd["patch_embed.proj.weight"].reshape(64, -1),
                "radio_model.model.patch_generator.cls_token.token":
                    torch.cat([sd["cls_token"][0], sd["reg_token"][0]])}
    for k, v in sd.items():
      if k.startswith("blocks."):
        upstream["radio_model.model." + k] = v
    # timm's own loader of upstream RADIO weights, with its choice of
    # align_corners per checkpoint.
    ac = any(n in name for n in tv._RADIO_ALIGN_CORNERS)  # pylint: disable=protected-access
    conv = tv.checkpoint_filter_fn(upstream, m, interpolation="bilinear",
                                   antialias=False, align_corners=ac)
    conv["patch_embed.proj.bias"] = sd["patch_embed.proj.bias"]
    m.load_state_dict(conv, strict=True)
    model, variables = formats.from_timm(dict(sd, pos_embed=grid128), name,
                                         num_heads=1, image_size=(48, 80))
    x = _x(name, (3, 5), seed=8)
    with torch.no_grad():
      ref = m.forward_features(torch_in(x)).numpy()
    assert_close_rel(apply(model, variables, x, method=model.forward_features),
                     ref, what=name)


def test_a_size_that_is_not_a_multiple_of_the_patch():
  """so400m/14 at 384: timm's convolution leaves the last 6 pixels out;
  ours runs at exactly that size. Elsewhere such a size is a mistake, named
  as one."""
  name = "vit_so400m_patch14_siglip_384"
  torch.manual_seed(0)
  m = perturb_torch(timm.create_model(name, pretrained=False, depth=DEPTH,
                                      embed_dim=192, num_heads=3),
                    0, std=0.1, weights_only=True)
  model, variables = formats.from_timm(m.state_dict(), name, num_heads=3)
  assert model.image_size == 384
  x = images(1, 384, seed=9)
  with torch.no_grad():
    ref = m(torch_in(x)).numpy()
  rel = assert_close_rel(apply(model, variables, x), ref)
  print(f"\nPARITY {name} 384x384 (27x27 patches, 6 px left out): "
        f"logits rel {rel.rel:.2g}")
  with pytest.raises(ValueError, match=r"built for 384x384 images, got 383x383"):
    apply(model, variables, images(1, 383))
  with pytest.raises(ValueError, match="not divisible by the patch size 14"):
    apply(model.clone(image_size=None), variables, x)
  with pytest.raises(ValueError, match=r"image_size 390x390 is not a multiple "
                     r"of the patch size 14.*e\.g\. 378x378"):
    formats.from_timm(m.state_dict(), name, num_heads=3, image_size=390)


# ---------------------------------------------------------------------------
# Every timm name of these families: our decoding against timm's modules.
# ---------------------------------------------------------------------------

NEW = re.compile(r"^(vit_.*_dinov3(_qkvb)?|eva02_(tiny|small|base|large)_patch\d+"
                 r"_(224|336|448|clip_224|clip_336)|vit_pe_.*|aimv2_.*|"
                 r"deit_.*_distilled_.*|vit_.*_radio_v\d|vit_giant_patch14_"
                 r"(reg4_)?dinov2)$")


def _new_names():
  names = sorted({n.split(".")[0] for n in timm.list_models()
                  if NEW.match(n.split(".")[0])})
  # Built on the meta device; too large to map the meta weights of in a
  # test (their shapes are checked by test_dinov3_7b_under_an_fsdp_mesh).
  return [n for n in names if not re.search(r"_7b_|gigantic|aimv2_3b", n)]


def _meta_state_dict(m):
  return {k: np.broadcast_to(np.float32(0), tuple(v.shape))
          for k, v in m.state_dict().items()}


def _timm_facts(m):
  """What our fields say, read off timm's modules."""
  b = m.blocks[0]
  attn, mlp = b.attn, b.mlp
  gated = (None if type(mlp).__name__ == "Mlp" else
           "split" if hasattr(mlp, "fc1_g") else "packed")
  rope = getattr(m, "rope", None)
  eva = hasattr(b, "gamma_1")
  ls = (getattr(b, "gamma_1", None) is not None or
        not isinstance(getattr(b, "ls1", torch.nn.Identity()),
                       torch.nn.Identity))
  q_bias = (attn.qkv.bias is not None if getattr(attn, "qkv", None) is not None
            and getattr(attn, "q_bias", None) is None else
            getattr(attn, "q_bias", None) is not None or (
                getattr(attn, "q_proj", None) is not None and
                attn.q_proj.bias is not None))
  facts = dict(
      hidden_size=m.embed_dim, num_layers=len(m.blocks),
      num_heads=attn.num_heads,
      mlp_dim=mlp.fc2.in_features, gated_mlp=gated,
      layer_norm_eps=b.norm1.eps,
      norm_type="rms" if "Rms" in type(b.norm1).__name__ else "layer",
      num_registers=getattr(m, "num_reg_tokens", 0) or (
          m.reg_token.shape[1] if getattr(m, "reg_token", None) is not None
          else 0),
      has_class_token=m.cls_token is not None,
      distilled=getattr(m, "dist_token", None) is not None,
      qkv_bias=bool(q_bias), layer_scale=ls,
      abs_pos_embed=m.pos_embed is not None,
      pre_norm=not isinstance(m.norm_pre, torch.nn.Identity),
      patch_norm=not isinstance(m.patch_embed.norm, torch.nn.Identity),
      fc_norm=not isinstance(m.fc_norm, torch.nn.Identity),
      mlp_norm=not isinstance(mlp.norm, torch.nn.Identity),
      attn_norm=not isinstance(getattr(attn, "norm", torch.nn.Identity()),
                               torch.nn.Identity),
      classifier={"token": "token", "avg": "gap", "map": "map"}[m.global_pool],
      num_classes=m.num_classes, rope=None)
  facts["final_norm"] = (not isinstance(m.norm, torch.nn.Identity)) or facts[
      "fc_norm"]
  if m.pos_embed is not None:
    facts["no_embed_class"] = bool(m.no_embed_class and m.num_prefix_tokens)
  if rope is not None:
    kind = "dinov3" if "DinoV3" in type(rope).__name__ else "cat"
    facts.update(rope=kind, rope_temperature=float(rope.temperature),
                 rope_grid_offset=float(rope.grid_offset),
                 rope_grid_indexing=rope.grid_indexing)
    if kind == "cat":
      facts["rope_ref_grid"] = (tuple(rope.ref_feat_shape)
                                if rope.ref_feat_shape is not None else None)
  if m.global_pool == "map":
    pool = m.attn_pool
    facts["map_heads_"] = pool.num_heads
    facts["map_mlp_dim_"] = pool.mlp.fc1.out_features
    facts["pool_include_prefix"] = eva
  return facts


def test_every_new_family_name_decodes_like_timm():
  names = _new_names()
  assert len(names) > 50, names
  bad = []
  for name in names:
    with meta_device():
      m = timm.create_model(name, pretrained=False)
    model, _ = formats.from_timm(_meta_state_dict(m), name)
    want = _timm_facts(m)
    got = {k: getattr(model, k) for k in want
           if not k.endswith("_") and k != "layer_scale"}
    got["layer_scale"] = model.layer_scale_init is not None
    if "map_heads_" in want:
      got["map_heads_"] = model.map_heads or model.num_heads
      got["map_mlp_dim_"] = model.map_mlp_dim or model.mlp_dim
    if want["gated_mlp"] is not None:
      assert model.act == "silu", name
    diff = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    if diff:
      bad.append((name, diff))
  assert not bad, bad


_FSDP_CHILD = r"""
import json, sys
import jax, optax
from vit_jax import models
from vit_jax.train import sharding, step
arch = json.loads(sys.argv[1])
model = models.get_model(arch, scan_layers=True, dtype="bfloat16")
mesh = sharding.make_mesh(jax.devices(), fsdp=-1)
tx = optax.adamw(1e-4)
abstract = step.abstract_train_state(model, tx, 224)
shardings = sharding.state_shardings(abstract, mesh)
from_rng, _ = step.make_init_fn(model, tx, 224)
with mesh:  # shapes and shardings only: nothing is allocated
  state = jax.jit(from_rng, out_shardings=shardings).eval_shape(
      jax.random.key(0))
leaves = jax.tree_util.tree_leaves(state.params)
sharded = [x for x in leaves if "fsdp" in str(x.sharding.spec)]
print(json.dumps(dict(
    mesh=dict(mesh.shape), params=models.count_params(state.params),
    leaves=len(leaves), sharded=len(sharded),
    sharded_params=sum(x.size for x in sharded),
    opt=sum(x.size for x in jax.tree_util.tree_leaves(state.opt_state)))))
"""


def test_dinov3_7b_under_an_fsdp_mesh():
  """The 7B DINOv3 built with jax.eval_shape under an FSDP mesh of 8
  (host) devices, parameters and optimizer state laid out by the training
  code's shardings, no memory spent: as many parameters as timm's model
  (counted on the meta device), nearly all of them sharded."""
  import json  # pylint: disable=import-outside-toplevel
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  with meta_device():
    ref = timm.create_model("vit_7b_patch16_dinov3", pretrained=False)
  want = sum(p.numel() for p in ref.parameters())
  # The architecture from_timm reads from a narrow one-block 7B, at 7B size.
  small = timm.create_model("vit_7b_patch16_dinov3", pretrained=False,
                            depth=1, embed_dim=64, num_heads=1)
  model, _ = formats.from_timm(small.state_dict(), "vit_7b_patch16_dinov3",
                               num_heads=1)
  assert (model.rope, model.gated_mlp, model.qkv_bias) == (
      "dinov3", "split", False)
  arch = models.arch_record(model)
  arch.update(hidden_size=ref.embed_dim, num_heads=ref.blocks[0].attn.num_heads,
              num_layers=len(ref.blocks),
              mlp_dim=ref.blocks[0].mlp.fc2.in_features, num_classes=0)
  from train_helpers import REPO  # pylint: disable=import-outside-toplevel
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  out = subprocess.run([sys.executable, "-c", _FSDP_CHILD, json.dumps(arch)],
                       capture_output=True, text=True, env=env, check=True,
                       timeout=300)
  res = json.loads(out.stdout.strip().splitlines()[-1])
  print(f"\nDINOv3 7B under FSDP: {res}")
  assert res["mesh"] == {"data": 1, "fsdp": 8}
  assert res["params"] == want == 6_716_030_976
  assert res["opt"] == 2 * want + 1  # AdamW's two moments and its count
  assert res["sharded_params"] > 0.999 * want


# ---------------------------------------------------------------------------
# transformers' own layouts: DINOv3ViTModel, Dinov2WithRegistersModel (and
# DINOv2 giant's SwiGLU in Dinov2Model), Aimv2VisionModel.
# ---------------------------------------------------------------------------

def _hf_tower(kind, seed=0):
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(seed)
  if kind.startswith("dinov3"):
    gated = kind == "dinov3_gated"
    m = transformers.DINOv3ViTModel(transformers.DINOv3ViTConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=256, patch_size=16, num_register_tokens=4,
        use_gated_mlp=gated, hidden_act="silu" if gated else "gelu"))
    grid = (3, 5)
  elif kind.startswith("dinov2"):
    cls, conf = ((transformers.Dinov2WithRegistersModel,
                  transformers.Dinov2WithRegistersConfig)
                 if kind == "dinov2_reg" else
                 (transformers.Dinov2Model, transformers.Dinov2Config))
    m = cls(conf(hidden_size=96, num_hidden_layers=2, num_attention_heads=3,
                 mlp_ratio=4, use_swiglu_ffn=True, image_size=56,
                 patch_size=14))
    grid = (4, 4)
  else:
    m = transformers.Aimv2VisionModel(transformers.Aimv2VisionConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=256, image_size=56, patch_size=14, use_head=False))
    grid = (4, 4)
  return perturb_torch(m, seed, std=0.1, weights_only=True), grid


@pytest.mark.parametrize("kind", ["dinov3", "dinov3_gated", "dinov2_reg",
                                  "dinov2", "aimv2"])
def test_transformers_towers_both_ways(kind, tmp_path):
  m, grid = _hf_tower(kind)
  p = m.config.patch_size
  x = images(2, grid[1] * p, seed=4, height=grid[0] * p)
  model, variables = formats.from_transformers(m)
  with torch.no_grad():
    out = m(pixel_values=torch_in(x))
  with jax.default_matmul_precision("highest"):
    pooled, feats = apply_with_features(model, variables, x)
  rel = assert_close_rel(feats, out.last_hidden_state.numpy(),
                         what="last_hidden_state")
  if out.pooler_output is not None:
    assert_close_rel(pooled, out.pooler_output.numpy(), what="pooler_output")
  print(f"\nPARITY transformers {type(m).__name__} ({kind}): "
        f"last_hidden_state rel {rel.rel:.2g}")
  back = formats.to_transformers(variables)
  fresh, _ = _hf_tower(kind, seed=1)
  fresh.load_state_dict(back, strict=True)
  for k, v in m.state_dict().items():
    if k != "embeddings.mask_token":  # masked-image training only: zeros
      assert torch.equal(back[k], v), k
  # save_pretrained's directory (the Hub's names and config.json).
  m.save_pretrained(tmp_path)
  loaded = weights_load(str(tmp_path))
  assert_close_rel(apply(loaded.model, loaded.variables, x,
                         method=loaded.model.forward_features),
                   out.last_hidden_state.numpy(), what="from the directory")


def weights_load(src, **kw):
  import warnings  # pylint: disable=import-outside-toplevel
  from vit_jax import weights  # pylint: disable=import-outside-toplevel
  with warnings.catch_warnings():  # no preprocessor_config.json: a guess
    warnings.simplefilter("ignore", weights.GuessWarning)
    return weights.load(src, **kw)


def test_timm_and_transformers_dinov2_giant_trees_cross_over():
  """timm's DINOv2 giant with registers (the class token's position folded
  into the token) exports to transformers' Dinov2WithRegistersModel (a zero
  position row for it), and back into timm's: the same function."""
  transformers = pytest.importorskip("transformers")
  name = "vit_giant_patch14_reg4_dinov2"
  m = timm_model(name, dict(embed_dim=96, num_heads=3), grid=(4, 4),
                 num_classes=0)
  _, variables = ours(m, name, dict(num_heads=3))
  hf = transformers.Dinov2WithRegistersModel(
      transformers.Dinov2WithRegistersConfig(
          hidden_size=96, num_hidden_layers=DEPTH, num_attention_heads=3,
          mlp_ratio=4, use_swiglu_ffn=True, image_size=56, patch_size=14,
          layerscale_value=1.0))
  hf.load_state_dict(formats.to_transformers(variables), strict=True)
  x = _x(name, (4, 4), seed=5)
  with torch.no_grad():
    ref = m.forward_features(torch_in(x)).numpy()
    got = hf(pixel_values=torch_in(x)).last_hidden_state.numpy()
  assert_close_rel(got, ref, what="transformers from timm's tree")
  model, v2 = formats.from_transformers(hf)
  assert model.no_embed_registers and model.gated_mlp == "packed"
  back = formats.to_timm(v2)
  timm_model(name, dict(embed_dim=96, num_heads=3), grid=(4, 4),
             num_classes=0, seed=1).load_state_dict(back, strict=True)
  for k, v in m.state_dict().items():
    np.testing.assert_allclose(back[k].numpy(), v.numpy(), rtol=0,
                               atol=1e-6, err_msg=k)


def test_hf_hub_names_of_timm_and_the_original_repos(tmp_path, monkeypatch):
  """``hf-hub:timm/vit_small_patch16_dinov3.lvd1689m`` (timm's repo: the
  name in config.json decides RoPE) and the original
  ``hf-hub:facebook/dinov3-vits16-pretrain-lvd1689m`` (transformers'
  DINOv3ViTModel with its processor), from a local Hub cache laid out as
  the Hub lays it out, offline; the same weights give the same features."""
  transformers = pytest.importorskip("transformers")
  import hf_cache  # pylint: disable=import-outside-toplevel
  from timm.models._hub import save_for_hf  # pylint: disable=import-outside-toplevel
  from vit_jax import weights  # pylint: disable=import-outside-toplevel
  name = "vit_small_patch16_dinov3"
  m = timm_model(name, grid=(4, 4), num_classes=0)
  save_for_hf(m, str(tmp_path / "timm"), safe_serialization=True)
  hf, _ = _hf_tower("dinov3")
  hf.save_pretrained(tmp_path / "meta")
  transformers.DINOv3ViTImageProcessor().save_pretrained(tmp_path / "meta")
  cache = str(tmp_path / "hub")
  hf_cache.put(cache, f"timm/{name}.lvd1689m", str(tmp_path / "timm"))
  hf_cache.put(cache, "facebook/dinov3-vits16-pretrain-lvd1689m",
               str(tmp_path / "meta"))
  hf_cache.offline(monkeypatch, cache)

  loaded = weights.load(f"hf-hub:timm/{name}.lvd1689m")
  assert loaded.kind == "timm" and loaded.model.rope == "dinov3"
  pre = loaded.preprocessing  # DINOv3's pretrained_cfg: ImageNet, bicubic
  assert (pre.interpolation, pre.mean) == ("bicubic", (0.485, 0.456, 0.406))
  x = _x(name, (3, 5), seed=9)
  with torch.no_grad():
    ref = m.forward_features(torch_in(x)).numpy()
  assert_close_rel(apply(loaded.model, loaded.variables, x,
                         method=loaded.model.forward_features), ref)

  loaded = weights.load("hf-hub:facebook/dinov3-vits16-pretrain-lvd1689m")
  assert loaded.kind == "transformers" and loaded.model.rope == "dinov3"
  assert loaded.preprocessing.mean == (0.485, 0.456, 0.406)
  with torch.no_grad():
    ref = hf(pixel_values=torch_in(x)).last_hidden_state.numpy()
  assert_close_rel(apply(loaded.model, loaded.variables, x,
                         method=loaded.model.forward_features), ref)
