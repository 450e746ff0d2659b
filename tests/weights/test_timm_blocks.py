"""timm's VisionTransformer with other blocks: differential attention
(``attn_layer='diff'``, ``DiffAttention``: ``vit_dwee_*``,
``vit_dlittle_*``), parallel blocks (``ParallelScalingBlock``:
``vit_pwee_*``, ViT-22B's ``vit_*_xp_*``) and both
(``DiffParallelScalingBlock``: ``vit_dpwee_*``), and timm's NaFlexVit with
a factorized position embedding (``naflexvit_*_parfac_*``, at the end),
loaded both ways against timm.

Reduced timm models stand for the names: 2 blocks of width 192 in 3 heads
(the names' head width, 64), their MLP ratios, a non-square 4x9 grid of
patches (64x144 images), a 7-class head; beside the released structures,
what only the keys show: timm's ``dual_lambda`` (two scalars), q/k norms
over the half-width heads, a parallel block's fused output projection
(``fuse_out_proj``). State dicts are random at the scales of the
registry's check (:class:`vit_jax.weights.verify.RandomWeights`: the
lambdas, LayerScale gammas, biases N(0, 0.1), far from timm's
initialisation), the images small (std 0.1) so that the norms' epsilon
shows. ``formats.from_timm(state_dict, name)`` (the keys alone where no
released name has the variant) must give timm's logits and
``forward_features`` within 1e-5 (float32, highest matmul precision);
``formats.to_timm`` loads back into timm strictly, bit for bit, in timm's
order. The released names at their real widths are checked by
``tests/weights/test_registry.py`` (``-k "dwee or dlittle or pwee or
xp_224 or parfac"``).
"""

import functools
import re

import jax
import numpy as np
import pytest

from compare import (assert_close_rel, assert_parity, features_and_logits,
                     parameter_counts, record_round_trip, timm_reference)
from vit_jax import formats, models
from vit_jax.models import diffattn
from vit_jax.weights import build, trees, twins, verify

timm = pytest.importorskip("timm")
torch = pytest.importorskip("torch")
from timm.layers import DiffAttention  # noqa: E402
from timm.models import vision_transformer as timm_vit  # noqa: E402

TOL = 1e-5
# A 4x9 grid of patches: its 36 position rows are a square's count, so the
# weights show that they cover the patches only (no_embed_class), as at the
# names' own square grids; the model adds them row by row, as timm's.
SIZE = (64, 144)
NARROW = dict(depth=2, embed_dim=192, num_heads=3, num_classes=7)


class _DualLambda(DiffAttention):
  """timm's DiffAttention with its two scalars (``dual_lambda``)."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, dual_lambda=True, **kwargs)


# id: (timm name, timm's extra options, the name given to from_timm (False:
# the keys alone), what the loaded model must be: (diff_attn, parallel,
# qk_norm, qkv_bias, norm_type)).
CASES = {
    "diff": ("vit_dwee_patch16_reg1_gap_256", {}, True,
             ("qk", None, False, True, "layer")),
    "dlittle": ("vit_dlittle_patch16_reg1_gap_256", {}, True,
                ("qk", None, False, True, "layer")),
    "dual_qknorm": ("vit_dwee_patch16_reg1_gap_256",
                    dict(attn_layer=_DualLambda, qk_norm=True), False,
                    ("dual", None, True, True, "layer")),
    "parallel": ("vit_pwee_patch16_reg1_gap_256", {}, True,
                 (None, "split", False, True, "layer")),
    "fused": ("vit_pwee_patch16_reg1_gap_256",
              dict(block_fn=functools.partial(timm_vit.ParallelScalingBlock,
                                              fuse_out_proj=True)), False,
              (None, "fused", False, True, "layer")),
    "diff_parallel": ("vit_dpwee_patch16_reg1_gap_256", {}, True,
                      ("qk", "fused", False, True, "layer")),
    "xp": ("vit_base_patch16_xp_224", {}, True,
           (None, "split", True, False, "rms")),
}

# What must move the logits (scaled by 1.5: far more than the tolerance),
# so that the parity is not vacuous: each lambda vector or scalar (in the
# second block: its own lambda_init), the sub-norm, the q/k norms over the
# half-width heads, the parallel blocks' one LayerScale, their MLP's
# output (fused: in out_proj's columns), the MLP bias apart from in_proj.
_ATTN = "Transformer/encoderblock_{}/MultiHeadDotProductAttention_0/"
_BLOCK = "Transformer/encoderblock_{}/"
PARTS = {
    "diff": tuple(_ATTN.format(1) + n for n in (
        "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2",
        "sub_norm/scale")),
    "dual_qknorm": tuple(_ATTN.format(0) + n for n in (
        "lambda_a", "lambda_b", "query_ln/scale", "key_ln/scale")),
    "parallel": (_BLOCK.format(1) + "LayerScale_0/scale",
                 _BLOCK.format(0) + "MlpBlock_0/Dense_1/bias"),
    "fused": (_BLOCK.format(1) + "MlpBlock_0/Dense_1/kernel",
              _ATTN.format(0) + "out/bias"),
    "diff_parallel": (_ATTN.format(0) + "lambda_k2",
                      _ATTN.format(1) + "sub_norm/scale",
                      _BLOCK.format(0) + "MlpBlock_0/Dense_0/kernel"),
    "xp": (_BLOCK.format(0) + "MlpBlock_0/Dense_0/bias",
           _ATTN.format(1) + "key_ln/scale"),
}


@pytest.fixture(autouse=True)
def _highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


def _timm_model(case, sd=None, size=SIZE):
  name, kw, _, _ = CASES[case]
  m = timm.create_model(name, pretrained=False, img_size=size,
                        **NARROW, **kw)
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


def _loaded(case, **kw):
  if kw:
    name, _, named, _ = CASES[case]
    return formats.from_timm(_built(case)[1], name if named else None, **kw)
  if case not in _LOADED:
    _LOADED[case] = _loaded(case, scan_layers=False)
  return _LOADED[case]


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_timm_equals_timm_both_ways(case, record_property):
  m, sd, x, xt, feats, logits = _built(case)
  model, variables = _loaded(case)
  assert (model.diff_attn, model.parallel, model.qk_norm, model.qkv_bias,
          model.norm_type) == CASES[case][3]
  assert (model.num_layers, model.num_heads, model.hidden_size) == (2, 3, 192)
  run = features_and_logits(model)
  assert_parity(run(variables, x), (feats, logits), TOL, record_property,
                f"timm blocks {case} ({CASES[case][0]}; 2 blocks, width "
                f"192, 4x9 grid)")
  flat = trees.flatten(variables)
  if model.parallel:  # one norm, one LayerScale a block
    assert not any("LayerNorm_1" in k or "LayerScale_1" in k for k in flat)
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
  assert type(net).__name__ == "VisionTransformer"
  with torch.no_grad():
    assert_close_rel(net(xt).numpy(), logits, 1e-6, "twin")


def test_scanned_blocks():
  """Under scan_layers each block keeps its own lambda_init (a scanned
  input; the two blocks' differ, 0.2 and 0.356): timm's logits."""
  _, _, x, _, _, logits = _built("diff_parallel")
  model, variables = _loaded("diff_parallel", scan_layers=True)
  lam = variables["params"]["Transformer"]["encoderblock"][
      "MultiHeadDotProductAttention_0"]["lambda_q1"]
  assert lam.shape == (2, 32)
  assert_close_rel(jax.jit(model.apply)(variables, x), logits, TOL)


def test_lambda_init_is_timms():
  for depth in range(16):
    att = DiffAttention(64, num_heads=2, depth=depth)
    assert float(diffattn.lambda_init(depth)) == pytest.approx(
        att.lambda_init, rel=1e-12)


def test_attention_weights_are_the_difference_of_the_maps():
  """Sown attention weights are each head's differential map (rows sum to
  1 - lambda: the maps' rows each sum to 1)."""
  _, _, x, _, _, _ = _built("diff")
  model, variables = _loaded("diff")
  model = model.clone(sow_attention_weights=True)
  _, state = jax.jit(lambda v, x: model.apply(
      v, x, mutable=["intermediates"]))(variables, x)
  w = state["intermediates"]["Transformer"]["encoderblock_1"][
      "MultiHeadDotProductAttention_0"]["attention_weights"][0]
  assert w.shape == (2, 3, 37, 37)  # (B, H, 1 register + 36 patches, ..)
  p = trees.flatten(variables)
  a = "params/" + _ATTN.format(1)
  lam = (np.exp(np.sum(p[a + "lambda_q1"] * p[a + "lambda_k1"])) -
         np.exp(np.sum(p[a + "lambda_q2"] * p[a + "lambda_k2"])) +
         diffattn.lambda_init(1))
  np.testing.assert_allclose(np.asarray(w).sum(-1), 1 - lam, rtol=0,
                             atol=1e-5)


def test_the_keys_decide_and_the_name_is_checked():
  """The keys show differential attention (its kind), parallel blocks
  (fused or not): loaded without a name they are the named model; a name
  of another structure is refused, naming the difference."""
  for case in ("diff", "diff_parallel"):
    model, _ = formats.from_timm(_built(case)[1])
    assert models.arch_record(model) == models.arch_record(_loaded(case)[0])
  with pytest.raises(build.NameMismatch, match=re.escape(
      "differential attention 'dual' (the name: differential attention "
      "'qk')")):
    formats.from_timm(_built("dual_qknorm")[1],
                      "vit_dwee_patch16_reg1_gap_256")
  with pytest.raises(build.NameMismatch, match=re.escape(
      "differential attention 'qk' (the name: no differential attention)")):
    formats.from_timm(_built("diff")[1], "vit_wee_patch16_reg1_gap_256")
  with pytest.raises(build.NameMismatch, match=re.escape(
      "parallel blocks 'fused' (the name: parallel blocks 'split')")):
    formats.from_timm(_built("fused")[1], "vit_pwee_patch16_reg1_gap_256")


def test_arch_record_and_checkpoint_keep_the_architecture(tmp_path):
  record, back = record_round_trip(*_loaded("diff_parallel"),
                                   str(tmp_path / "dpwee.safetensors"))
  assert (record["diff_attn"], record["parallel"]) == ("qk", "fused")
  _, _, x, _, _, logits = _built("diff_parallel")
  assert_close_rel(jax.jit(back.model.apply)(back.variables, x), logits, TOL)


def test_options_that_do_not_combine_are_refused():
  x = np.zeros((1, 32, 32, 3), np.float32)
  for kw, match in (
      (dict(diff_attn="paper"), "expected None, 'qk'"),
      (dict(diff_attn="qk", attention_impl="cudnn"), "cannot be combined"),
      (dict(diff_attn="qk", rope="dinov3", rope_temperature=100.0),
       "rope"),
      (dict(diff_attn="qk", num_heads=64), "odd"),
      (dict(parallel="both"), "expected None, 'split'"),
      (dict(parallel="split", post_norm=True), "post_norm"),
  ):
    model = models.get_model("vit_ti_16", num_classes=0, **kw)
    with pytest.raises(ValueError, match=match):
      jax.eval_shape(model.init, jax.random.key(0), x)
  with pytest.raises(ValueError, match="differential attention nor"):
    formats.to_transformers(_loaded("diff")[1])


@pytest.mark.parametrize("name", ["vit_dwee_patch16_reg1_gap_256",
                                  "vit_dpwee_patch16_reg1_gap_256"])
def test_parameter_count_is_timms(name):
  """The names at their real size (14 or 16 blocks of width 256, 4 heads,
  MLP ratio 5, a register, fc_norm) have timm's parameter count."""
  model, got, want = parameter_counts(name)
  assert (model.hidden_size, model.num_heads, model.diff_attn) == (
      256, 4, "qk")
  assert got == want


# timm's NaFlexVit with a factorized position embedding
# (naflexvit_base_patch16_parfac_gap: pos_embed='factorized', aspect
# preserving): rows and columns of a 5x7 table (not square: neither
# stands for the other), each resized by linear interpolation to the longer
# side of the image's grid, the first rows / columns kept.
PARFAC = "naflexvit_base_patch16_parfac_gap"


@pytest.fixture(scope="module")
def parfac():
  m = timm.create_model(PARFAC, pretrained=False, pos_embed_grid_size=(5, 7),
                        **NARROW).eval()
  sd = verify.RandomWeights(size=1 << 20).state_dict(m.state_dict())
  m.load_state_dict(sd, strict=True)
  return m, sd, formats.from_timm(sd, PARFAC)


def test_factorized_position_embedding_is_timms(parfac, record_property):
  """NaFlex batches (two images of 3x5 and 4x2 patches, padded to 16) and
  NHWC images of 3x7 and 6x4 patches (the tables stretched, kept, cut):
  timm's logits, forward_features too for the images; to_timm back bit
  for bit; each table moves the logits."""
  m, sd, (model, variables) = parfac
  assert (model.naflex, model.naflex_square, model.naflex_factorized,
          model.naflex_grid) == ("bilinear", True, True, (5, 7))
  x, xt = verify.inputs(PARFAC, m, None, batch=2)  # NaFlex dicts
  with torch.no_grad():
    ref = m(xt).numpy()
  run = jax.jit(model.apply)
  head = assert_close_rel(run(variables, x), ref, TOL, "NaFlex logits")
  record_property("rel_err", head.rel)
  print(f"\nPARITY parfac NaFlex: logits rel {head.rel:.2g}")
  flat = trees.flatten(variables)
  for key in ("params/Transformer/posembed_input/pos_y",
              "params/Transformer/posembed_input/pos_x"):
    moved = trees.unflatten(dict(flat, **{key: flat[key] * 1.5}))
    err = np.abs(np.asarray(run(moved, x)) - ref).max()
    assert err > 100 * TOL * np.abs(ref).max(), (key, err)
  for size in ((48, 112), (96, 64)):
    xi, xti = verify.inputs(PARFAC, m, size, batch=2)
    with torch.no_grad():
      feats = m.forward_features(xti).numpy()
      logits = m.forward_head(torch.from_numpy(feats)).numpy()
    assert_parity(features_and_logits(model)(variables, xi), (feats, logits),
                  TOL, record_property, f"parfac images {size}")
  back = formats.to_timm(variables)
  assert list(back) == list(sd)
  for k, v in sd.items():
    assert torch.equal(back[k], v), k
  m.load_state_dict(back, strict=True)
  with pytest.raises(ValueError, match="factorized position embedding"):
    formats.to_transformers(variables)


def test_factorized_needs_linear_resize():
  x = np.zeros((1, 32, 32, 3), np.float32)
  for kw in (dict(naflex="bicubic_aa", naflex_factorized=True),
             dict(naflex_factorized=True)):
    model = models.get_model("vit_ti_16", num_classes=0, classifier="gap",
                             **kw)
    with pytest.raises(ValueError, match="naflex_factorized"):
      jax.eval_shape(model.init, jax.random.key(0), x)
