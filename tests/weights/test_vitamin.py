"""timm's ViTamin (``vitamin_*``: a VisionTransformer whose patch embedding
is a ``HybridEmbed`` without a projection around ``MbConvStages``, and
whose MLP is ``GeGluMlp``) loaded both ways, against timm.

Reduced timm models stand for its variants: the stem as small as timm's
constructor allows (``embed_cfg``: stem width 16, stages of 16 and 32
channels with 1 and 2 blocks; in ``widen`` the first stage wider than the
stem, so its first block's shortcut has a 1x1 convolution too), 2 blocks
of width 192 in 3 heads (head width 64), a 7-class head, non-square 48x64
images (a 3x4 grid of tokens); ``small`` with a learned position
embedding (vitamin_small ... large2), ``xlarge`` without (vitamin_xlarge_*:
``pos_embed='none'``). Their state dicts are random at the scales of the
registry's check (:class:`vit_jax.weights.verify.RandomWeights`), the
images small (std 0.1) so that the norms' epsilon shows.
``formats.from_timm(state_dict, name)`` (the keys alone too) must give
timm's logits and ``forward_features`` within 1e-5 (float32, highest
matmul precision), ``formats.to_timm`` load back into timm strictly, bit
for bit, in timm's order. The released names at their real widths are
checked by ``tests/weights/test_registry.py`` (``-k vitamin``).
"""

import re

import jax
import numpy as np
import pytest

import vit_jax
from compare import (assert_close_rel, assert_parity, features_and_logits,
                     parameter_counts, record_round_trip, timm_reference)
from vit_jax import formats, models
from vit_jax.weights import build, trees, twins, verify

timm = pytest.importorskip("timm")
torch = pytest.importorskip("torch")
from timm.models import vitamin as timm_vitamin  # noqa: E402

TOL = 1e-5
SIZE = (48, 64)  # a 3x4 grid of tokens (the stem reduces by 16)
NARROW = dict(depth=2, embed_dim=192, num_heads=3, num_classes=7)


def _cfg(stem=16, widths=(16, 32), depths=(1, 2)):
  return timm_vitamin.VitCfg(
      embed_dim=(*widths, NARROW["embed_dim"]), depths=(*depths, 1),
      stem_width=stem, conv_cfg=timm_vitamin.VitConvCfg(
          norm_layer="layernorm2d", norm_eps=1e-6), head_type="1d")


# id: (timm name, its embed_cfg, the name given to from_timm (None: the
# keys alone), the stem we must read: (stem width, widths, depths), a
# learned position embedding).
CASES = {
    "small": ("vitamin_small_224", _cfg(), True, (16, (16, 32), (1, 2)),
              True),
    "xlarge": ("vitamin_xlarge_256", _cfg(), True, (16, (16, 32), (1, 2)),
               False),
    "widen": ("vitamin_base_224", _cfg(8, (16, 24), (2, 1)), False,
              (8, (16, 24), (2, 1)), True),
}

# What must move the logits (scaled by 1.5): the stem's norms (its first
# LayerNorm with GELU, a block's pre-norm, the StridedConv's norm), a
# shortcut's 1x1 convolution, the MLP's own norm of its input, the gate.
_STEM = "mbconv_stem/"
_MLP = "Transformer/encoderblock_1/MlpBlock_0/"
PARTS = {
    "small": (_STEM + "stem_norm1/scale", _STEM + "stage1_block1/pre_norm/scale",
              _STEM + "pool_norm/scale", _STEM + "stage1_block0/shortcut/kernel",
              _MLP + "InputNorm/scale", _MLP + "InputNorm/bias",
              _MLP + "Gate_0/kernel"),
    "widen": (_STEM + "stage0_block0/shortcut/kernel",
              _STEM + "stage0_block1/conv2/kernel"),
}


@pytest.fixture(autouse=True)
def _highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


def _timm_model(case, sd=None):
  name, cfg, _, _, _ = CASES[case]
  m = timm.create_model(name, pretrained=False, img_size=SIZE,
                        embed_cfg=cfg, **NARROW)
  if sd is not None:
    m.load_state_dict(sd, strict=True)
  return m.eval()


_BUILT, _LOADED = {}, {}  # once per process, whatever tests it is sent


def _built(case):
  """(timm model, its random state dict, NHWC images, NCHW images, timm's
  forward_features, timm's logits)."""
  if case not in _BUILT:
    _BUILT[case] = timm_reference(_timm_model(case), CASES[case][0],
                                  SIZE)
  return _BUILT[case]


def _loaded(case):
  if case not in _LOADED:
    name, _, named, _, _ = CASES[case]
    _LOADED[case] = formats.from_timm(_built(case)[1],
                                      name if named else None)
  return _LOADED[case]


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_timm_equals_timm_both_ways(case, record_property):
  m, sd, x, xt, feats, logits = _built(case)
  model, variables = _loaded(case)
  stem, widths, depths = CASES[case][3]
  assert model.mbconv == models.MbConvConfig(stem_width=stem, widths=widths,
                                             depths=depths)
  assert (model.gated_mlp, model.act, model.mlp_input_norm, model.mlp_norm,
          model.classifier, model.has_class_token, model.fc_norm,
          model.abs_pos_embed, model.patch_size, model.num_heads) == (
              "split", "gelu", True, False, "gap", False, True,
              CASES[case][4], 16, 3)
  run = features_and_logits(model)
  assert_parity(run(variables, x), (feats, logits), TOL, record_property,
                f"vitamin {case} ({CASES[case][0]}; stem {CASES[case][3]}, "
                f"2 blocks, width 192, 3x4 grid)")
  flat = trees.flatten(variables)
  for part in PARTS.get(case, ()):
    key = "params/" + part
    moved = trees.unflatten(dict(flat, **{key: flat[key] * 1.5}))
    err = np.abs(np.asarray(run(moved, x)[1]) - logits).max()
    assert err > 100 * TOL * np.abs(logits).max(), (part, err)
  back = formats.to_timm(variables)
  assert list(back) == list(sd)  # timm's own order
  for k, v in sd.items():
    assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
  _timm_model(case, back)  # strict
  net = twins.timm_model(model, variables, image_size=SIZE)
  assert type(net.patch_embed.backbone).__name__ == "MbConvStages"
  with torch.no_grad():
    assert_close_rel(net(xt).numpy(), logits, 1e-6, "twin")


@pytest.mark.parametrize("norm", [False, True])
def test_intermediates_are_timms(norm):
  """forward_intermediates as timm's: NCHW token maps of each block (an
  fc_norm model has no final norm: timm's is an identity there)."""
  m, _, x, xt, _, _ = _built("small")
  model, variables = _loaded("small")
  with torch.no_grad():
    want_final, want = m.forward_intermediates(xt, norm=norm)
  final, got = jax.jit(lambda v, x: model.apply(
      v, x, method=model.forward_intermediates, norm=norm,
      output_fmt="NCHW"))(variables, x)
  assert_close_rel(final, want_final.numpy(), TOL, "final features")
  assert len(got) == len(want) == 2
  for g, w in zip(got, want):
    assert g.shape == (2, 192, 3, 4)
    assert_close_rel(g, w.numpy(), TOL, "intermediate")


def test_the_keys_decide_and_a_name_of_another_structure_is_refused():
  """The keys show the stem (its widths and depths), the MLP's input norm,
  the GELU gate (every GeGluMlp's) and the pooling: the keys alone load
  the same model as the name; a name of another structure is refused,
  naming the difference."""
  for case in ("small", "xlarge"):
    model, _ = formats.from_timm(_built(case)[1])
    assert models.arch_record(model) == models.arch_record(_loaded(case)[0])
  with pytest.raises(build.NameMismatch, match=re.escape(
      "no learned position embedding (the name: a learned position "
      "embedding)")):
    formats.from_timm(_built("xlarge")[1], "vitamin_small_224")
  vit = timm.create_model("vit_base_patch16_224", depth=1, img_size=SIZE)
  with pytest.raises(build.NameMismatch, match=re.escape(
      "no ViTamin stem (the name: a ViTamin stem)")):
    formats.from_timm(vit.state_dict(), "vitamin_base_224")
  with pytest.raises(build.NameMismatch, match=re.escape(
      "a ViTamin stem (the name: no ViTamin stem)")):
    formats.from_timm(_built("small")[1], "vit_small_patch16_224")


def test_scanned_blocks():
  """The blocks scan (the stem stays outside, its parameters unstacked):
  the same logits."""
  _, sd, x, _, _, logits = _built("small")
  model, variables = formats.from_timm(sd, CASES["small"][0],
                                       scan_layers=True)
  assert "encoderblock" in variables["params"]["Transformer"]
  assert_close_rel(jax.jit(model.apply)(variables, x), logits, TOL)


def test_arch_record_and_checkpoint_keep_the_architecture(tmp_path):
  record, back = record_round_trip(*_loaded("small"),
                                   str(tmp_path / "vitamin.safetensors"))
  assert record["mbconv"] == dict(stem_width=16, widths=[16, 32],
                                  depths=[1, 2], expand_ratio=4.0)
  assert record["mlp_input_norm"] and record["gated_mlp"] == "split"
  _, _, x, _, _, logits = _built("small")
  assert_close_rel(jax.jit(back.model.apply)(back.variables, x), logits, TOL)


def test_options_that_do_not_combine_are_refused():
  x = np.zeros((1, 32, 32, 3), np.float32)
  stem = dict(stem_width=16, widths=(16, 32), depths=(1, 1))
  for kw, match in (
      (dict(mbconv=stem, patch_size=8), "patch_size must be 16"),
      (dict(mbconv=stem, resnet=(1,)), "cannot be combined with resnet"),
      (dict(mbconv=dict(stem, depths=(1, 0))), "at least one block"),
      (dict(mbconv=dict(stem, widths=(16, 32, 64))), "two stages"),
  ):
    with pytest.raises(ValueError, match=match):
      model = models.get_model("vit_ti_16", num_classes=0, **kw)
      jax.eval_shape(model.init, jax.random.key(0), x)
  with pytest.raises(ValueError, match="transformers has no ViTamin"):
    formats.to_transformers(_loaded("small")[1])


def test_parameter_count_is_timms():
  """A real-size name: vitamin_large_224 (31 blocks of width 1024, a stem
  of 160 and 320 channels, GeGluMlp) has timm's parameter count."""
  model, got, want = parameter_counts("vitamin_large_224")
  assert (model.num_layers, model.num_heads, model.hidden_size,
          model.mlp_dim, model.mbconv.widths, model.mbconv.depths) == (
              31, 16, 1024, 2048, (160, 320), (2, 4))
  assert got == want


def test_listed_names_are_timms():
  """Every architecture of timm's vitamin module, each verified by the
  registry's check; the tags are timm's released ones."""
  archs = sorted(timm.list_models("vitamin_*"))
  assert vit_jax.list_models("vitamin_*") == archs and len(archs) == 13
  released = sorted(timm.list_models("vitamin_*", pretrained=True))
  assert vit_jax.list_models("vitamin_*", pretrained=True) == released
  assert len(released) == 15
