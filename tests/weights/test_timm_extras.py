"""timm's FlexiViT (``flexivit_*``), EVA-01 (its MIM fine-tunes
``eva_large_*`` as VisionTransformer, its giants ``eva_giant_*`` as Eva
without RoPE) and its tiny test ViTs (``test_vit``, ``test_vit2``,
``test_vit3``) loaded both ways, against timm.

Reduced timm models stand for the names: 2 blocks, widths cut where the
head width stays (FlexiViT-S and EVA-L: 192 in 3 heads of 64; EVA-g: 176
in 2 heads of 88, its MLP at the name's 6144/1408 ratio; the test ViTs at
their own widths), a non-square 3x4 grid of patches, a 7-class head.
Their state dicts are random at the scales of the registry's check
(:class:`vit_jax.weights.verify.RandomWeights`: LayerScale gammas,
biases, tokens N(0, 0.1), far from timm's 1e-5 and zeros), and the images
are small (std 0.1) so that the norms' epsilon shows.
``formats.from_timm(state_dict, name)`` must give timm's logits and
``forward_features`` within 1e-5 (float32, highest matmul precision);
``formats.to_timm`` loads back into timm strictly, bit for bit, in timm's
key order. The names at their real widths are checked by
``tests/weights/test_registry.py`` (``-k "flexivit or eva_large or
test_vit or eva_giant"``).
"""

import re

import jax
import numpy as np
import pytest

import vit_jax
from compare import (assert_close_rel, assert_parity, features_and_logits,
                     parameter_counts, record_round_trip, timm_reference)
from vit_jax import formats, models
from vit_jax.weights import build, layouts, trees, twins, verify

timm = pytest.importorskip("timm")
torch = pytest.importorskip("torch")

TOL = 1e-5
GRID = (3, 4)  # a non-square grid of patches

# id: (timm name, timm's reduced options, from_timm's num_heads (where
# neither the name's width nor the reduced one says), what the loaded
# model must be: (classifier, class token, registers, no_embed_class,
# fc_norm, LayerScale, key bias, pool_include_prefix, epsilon)).
CASES = {
    "flexivit": ("flexivit_small", dict(embed_dim=192, num_heads=3), None,
                 ("token", True, 0, True, False, False, True, False, 1e-6)),
    "eva_large": ("eva_large_patch14_196", dict(embed_dim=192, num_heads=3),
                  None,
                  ("gap", True, 0, False, True, False, True, False, 1e-6)),
    "test_vit": ("test_vit", {}, None,
                 ("token", True, 0, False, False, False, True, False, 1e-6)),
    "test_vit2": ("test_vit2", {}, None,
                  ("gap", False, 1, False, True, True, True, False, 1e-6)),
    "test_vit3": ("test_vit3", {}, None,
                  ("map", False, 1, False, False, True, True, True, 1e-6)),
    "eva_giant": ("eva_giant_patch14_224", dict(embed_dim=176, num_heads=2),
                  2, ("gap", True, 0, False, True, False, False, False, 1e-6)),
    "eva_giant_clip": ("eva_giant_patch14_clip_224",
                       dict(embed_dim=176, num_heads=2), 2,
                       ("token", True, 0, False, False, False, False, False,
                        1e-6)),
}

# What must move the logits (scaled by 1.5: far more than the tolerance),
# so that the parity is not vacuous.
_B = "Transformer/encoderblock_{}/"
_ATTN = _B + "MultiHeadDotProductAttention_0/"
PARTS = {
    "flexivit": ("Transformer/posembed_input/pos_embedding", "cls"),
    "eva_large": ("fc_norm/scale", "Transformer/posembed_input/pos_embedding"),
    "test_vit2": ("registers", _B.format(1) + "LayerScale_1/scale"),
    "test_vit3": ("registers", "MAPHead_0/probe",
                  "MAPHead_0/MultiHeadDotProductAttention_0/key/kernel"),
    "eva_giant": (_ATTN.format(1) + "query/bias", _ATTN.format(0) +
                  "value/bias", "fc_norm/scale"),
    "eva_giant_clip": (_ATTN.format(1) + "query/bias",
                       "Transformer/encoder_norm/scale", "cls"),
}


@pytest.fixture(autouse=True)
def _highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


def _patch(case):
  return 14 if "eva" in case else 16


def _size(case, grid=GRID):
  return tuple(_patch(case) * g for g in grid)


def _timm_model(case, sd=None, grid=GRID):
  name, kw, _, _ = CASES[case]
  m = timm.create_model(name, pretrained=False, depth=2, num_classes=7,
                        img_size=_size(case, grid), **kw)
  if sd is not None:
    m.load_state_dict(sd, strict=True)
  return m.eval()


_BUILT, _LOADED = {}, {}  # once per process, whatever tests it is sent


def _built(case):
  """(timm model, its random state dict, NHWC images, NCHW images, timm's
  forward_features, timm's logits)."""
  if case not in _BUILT:
    _BUILT[case] = timm_reference(_timm_model(case), CASES[case][0],
                                  _size(case))
  return _BUILT[case]


def _loaded(case):
  if case not in _LOADED:
    name, _, heads, _ = CASES[case]
    _LOADED[case] = formats.from_timm(_built(case)[1], name,
                                      num_heads=heads)
  return _LOADED[case]


def _moved(run, variables, x, logits, key):
  """max |logits with ``key`` scaled by 1.5 - timm's|, relative (``run``:
  :func:`features_and_logits`'s program)."""
  flat = trees.flatten(variables)
  moved = trees.unflatten(dict(flat, **{key: flat[key] * 1.5}))
  out = np.asarray(run(moved, x)[1])
  return np.abs(out - logits).max() / np.abs(logits).max()


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_timm_equals_timm_both_ways(case, record_property):
  m, sd, x, _, feats, logits = _built(case)
  model, variables = _loaded(case)
  assert (model.classifier, model.has_class_token, model.num_registers,
          model.no_embed_class, model.fc_norm,
          model.layer_scale_init is not None, model.key_bias,
          model.pool_include_prefix, model.layer_norm_eps) == CASES[case][3]
  assert model.num_heads == m.blocks[0].attn.num_heads
  assert model.mlp_dim == m.blocks[0].mlp.fc1.out_features
  assert model.rope is None and model.abs_pos_embed
  run = features_and_logits(model)
  assert_parity(run(variables, x), (feats, logits), TOL, record_property,
                f"{case} ({CASES[case][0]}; 2 blocks, width "
                f"{model.hidden_size}, 3x4 grid)")
  for part in PARTS.get(case, ()):
    err = _moved(run, variables, x, logits, "params/" + part)
    assert err > 100 * TOL, (part, err)
  back = formats.to_timm(variables)
  assert list(back) == list(sd)  # timm's own order
  for k, v in sd.items():
    assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
  _timm_model(case, back)  # strict
  # The PyTorch twin (ONNX export, to_torch): timm's class of the name,
  # built from our fields alone.
  net = twins.timm_model(model, variables, image_size=_size(case))
  assert type(net).__name__ == type(m).__name__
  with torch.no_grad():
    assert_close_rel(net(_built(case)[3]).numpy(), logits, 1e-6, "twin")


def test_the_name_decides_what_the_keys_cannot():
  """Without the name: FlexiViT's class token on a non-square grid gets a
  position row (12 rows and a class token: not a square of patches), the
  EVA-L fine-tune pools its class token (VisionTransformer's fc_norm
  beside it), test_vit3's MAP head leaves the register out, and the test
  ViTs' heads of width 32 are no width's usual ones; EVA-g's Eva keys
  need the name that says it has no RoPE. Each is timm's with the name
  only (the parity test)."""
  _, sd, _, _, _, _ = _built("flexivit")
  assert not formats.from_timm(sd)[0].no_embed_class
  for case, name, num_heads in (("eva_large", None, None),
                                ("test_vit3", None, 3)):
    _, sd, x, _, _, logits = _built(case)
    model, variables = formats.from_timm(sd, name, num_heads=num_heads)
    named = _loaded(case)[0]
    assert (model.classifier, model.pool_include_prefix) != (
        named.classifier, named.pool_include_prefix)
    err = np.abs(np.asarray(jax.jit(model.apply)(variables, x))
                 - logits).max()
    assert err > 100 * TOL * np.abs(logits).max(), case
  for case in ("test_vit", "test_vit2", "test_vit3"):
    with pytest.raises(layouts.Undecided, match="number of attention heads"):
      formats.from_timm(_built(case)[1])
  _, sd, _, _, _, _ = _built("eva_giant")
  with pytest.raises(layouts.Undecided, match="rotary position embedding"):
    formats.from_timm(sd, num_heads=2)
  # Eva's keys under an EVA-02 name: its structure named, the name refused.
  with pytest.raises(build.NameMismatch, match=re.escape(
      "not a eva02_tiny_patch14_224")):
    formats.from_timm(sd, "eva02_tiny_patch14_224", num_heads=2)
  # A FlexiViT's keys are VisionTransformer's: under an AugReg name the
  # class token's position row is what differs (a square grid, which the
  # keys decide alike).
  m = _timm_model("flexivit", grid=(4, 4))
  model, _ = formats.from_timm(m.state_dict(), "vit_small_patch16_224")
  assert model.no_embed_class  # the keys: 16 rows, a class token


def test_flexivit_at_another_patch_size_as_timms():
  """FlexiViT's point: the same weights at another patch size (timm's
  set_input_size(patch_size=...): the kernel resampled by pseudo-inverse,
  the position grid, which has no class-token row, by antialiased
  bicubic): a 4x4 grid of patches 16 run as an 8x8 grid of patches 8."""
  m = _timm_model("flexivit", grid=(4, 4))
  sd = verify.RandomWeights(size=1 << 20).state_dict(m.state_dict())
  m.load_state_dict(sd, strict=True)
  m.set_input_size(patch_size=8)
  x, xt = verify.inputs("flexivit_small", m, (64, 64), batch=2)
  with torch.no_grad():
    want = m(xt).numpy()
  model, variables = formats.from_timm(sd, "flexivit_small", patch_size=8)
  assert model.patch_size == 8 and model.no_embed_class
  assert_close_rel(jax.jit(model.apply)(variables, x), want, TOL)


def test_arch_record_and_checkpoint_keep_the_architecture(tmp_path):
  record, back = record_round_trip(*_loaded("eva_giant"),
                                   str(tmp_path / "eva.safetensors"))
  assert (record["key_bias"], record["classifier"], record["fc_norm"],
          record["rope"]) == (False, "gap", True, None)
  _, _, x, _, _, logits = _built("eva_giant")
  assert_close_rel(jax.jit(back.model.apply)(back.variables, x), logits, TOL)


def test_parameter_count_is_timms():
  """A real-size name: eva_giant_patch14_560 (40 blocks of width 1408 in
  16 heads, MLP 6144, a 40x40 grid and the class token's row) has timm's
  parameter count."""
  model, got, want = parameter_counts("eva_giant_patch14_560")
  assert (model.num_layers, model.num_heads, model.mlp_dim, model.key_bias,
          model.classifier) == (40, 16, 6144, False, "gap")
  assert got == want


def test_listed_names_are_timms():
  """Every architecture of these names timm has (its other test models
  aside), each verified by the registry's check; the tags are timm's
  released ones."""
  for pattern in ("flexivit_*", "eva_*", "test_vit*"):
    archs = sorted(n for n in timm.list_models(pattern)
                   if n in ("test_vit", "test_vit2", "test_vit3")
                   or not n.startswith("test_"))
    assert vit_jax.list_models(pattern) == archs, pattern
    released = sorted(n for n in timm.list_models(pattern, pretrained=True)
                      if n.split(".", 1)[0] in archs)
    assert vit_jax.list_models(pattern, pretrained=True) == released
  assert len(vit_jax.list_models("eva_giant_*", pretrained=True)) == 6
  assert models.get_model("flexivit_base").image_size in (240, (240, 240))
