"""timm's RoPE ViTs of its ``eva`` module, loaded both ways, against timm:
timm's own SBB ViTs (``vit_*_patch16_rope_reg*_gap_256``), Naver's
RoPE-ViT (``vit_*_patch16_rope[_ape]_224``: axial RoPE; ``_rope_mixed``:
RoPE-Mixed, learned frequencies per block and head) and LingBot-Vision
(``vit_*_patch16_lingbot``: DINOv3's RoPE).

Reduced timm models stand for the names: 2 blocks of width 192 in 3 heads
(the names' head width, 64), a 7-class head, non-square grids of patches
(3x5 and 5x3: which axis RoPE rotates by first shows only there). Their
state dicts are random at the registry check's scales
(:class:`vit_jax.weights.verify.RandomWeights`; RoPE-Mixed's frequencies
scaled to N(0, 1), turns of a radian per patch). ``formats.from_timm(
state_dict, name)`` must give timm's logits and ``forward_features`` within
1e-5 (float32, highest matmul precision), its ``forward_intermediates``
too, and at another input size where timm takes one; ``formats.to_timm``
loads back into timm strictly, bit for bit. The names at their real widths
are checked by ``tests/weights/test_registry.py`` (``-k "rope or
lingbot"``).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vit_jax
from compare import (assert_close_rel, assert_parity, features_and_logits,
                     parameter_counts, record_round_trip, timm_reference)
from vit_jax import formats, models
from vit_jax.models import rope as rope_lib
from vit_jax.weights import build, layouts, trees, twins, verify

timm = pytest.importorskip("timm")
torch = pytest.importorskip("torch")
from timm.layers import pos_embed_sincos  # noqa: E402

TOL = 1e-5
NARROW = dict(depth=2, embed_dim=192, num_heads=3, num_classes=7)

# id: (timm name, timm's extra options, patch grid, what the loaded model
# must be: (rope, rope_temperature, rope_grid_indexing, rope_ref_grid,
# classifier, class token, registers, abs_pos_embed, no_embed_class,
# qkv_bias, key_bias, gated_mlp)).
CASES = {
    "sbb": ("vit_medium_patch16_rope_reg1_gap_256", {}, (3, 5),
            ("cat", 1e4, "ij", (16, 16), "gap", False, 1, False, False,
             True, False, None)),
    "sbb_nobias": ("vit_mediumd_patch16_rope_reg1_gap_256", {}, (5, 3),
                   ("cat", 1e4, "ij", (16, 16), "gap", False, 1, False,
                    False, False, True, None)),
    "axial": ("vit_small_patch16_rope_224", {}, (5, 3),
              ("cat", 100.0, "xy", None, "token", True, 0, False, False,
               True, True, None)),
    "axial_ape": ("vit_base_patch16_rope_ape_224", {}, (3, 5),
                  ("cat", 100.0, "xy", None, "token", True, 0, True, True,
                   True, True, None)),
    "mixed": ("vit_small_patch16_rope_mixed_224", {}, (5, 3),
              ("mixed", 10.0, "xy", None, "token", True, 0, False, False,
               True, True, None)),
    "mixed_ape": ("vit_large_patch16_rope_mixed_ape_224", {}, (3, 5),
                  ("mixed", 10.0, "xy", None, "token", True, 0, True, True,
                   True, True, None)),
    "lingbot": ("vit_small_patch16_lingbot", {}, (3, 5),
                ("dinov3", 100.0, "ij", None, "token", True, 4, False, False,
                 True, False, None)),
    "lingbot_giant": ("vit_giant_patch16_lingbot", {}, (5, 3),
                      ("dinov3", 100.0, "ij", None, "token", True, 4, False,
                       False, False, True, "split")),
}
FREQS = "params/Transformer/rope_freqs"


@pytest.fixture(autouse=True)
def _highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


def _pixels(grid):
  return (16 * grid[0], 16 * grid[1])


def _timm_model(case, sd=None, grid=None, **kw):
  name, extra, own, _ = CASES[case]
  m = timm.create_model(name, pretrained=False, img_size=_pixels(grid or own),
                        **NARROW, **extra, **kw)
  if sd is not None:
    m.load_state_dict(sd, strict=True)
  return m.eval()


_BUILT, _LOADED = {}, {}  # once per process, whatever tests it is sent


def _built(case):
  """(timm model, its random state dict, NHWC images, NCHW images, timm's
  forward_features, timm's logits)."""
  if case not in _BUILT:
    _BUILT[case] = timm_reference(_timm_model(case), CASES[case][0],
                                  _pixels(CASES[case][2]),
                                  # turns of a radian per patch, not a tenth
                                  scale={"rope.freqs": 10})
  return _BUILT[case]


def _loaded(case, **kw):
  key = (case, tuple(sorted(kw.items())))
  if key not in _LOADED:
    _LOADED[key] = formats.from_timm(_built(case)[1], CASES[case][0], **kw)
  return _LOADED[key]


def _fields(model):
  return (model.rope, model.rope_temperature, model.rope_grid_indexing,
          model.rope_ref_grid and tuple(model.rope_ref_grid),
          model.classifier, model.has_class_token, model.num_registers,
          model.abs_pos_embed, model.no_embed_class, model.qkv_bias,
          model.key_bias, model.gated_mlp)


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_timm_equals_timm_both_ways(case, record_property):
  name, _, grid, want = CASES[case]
  m, sd, x, xt, feats, logits = _built(case)
  model, variables = _loaded(case)
  assert _fields(model) == want
  assert model.num_heads == 3 and model.layer_scale_init is not None
  run = features_and_logits(model)
  assert_parity(run(variables, x), (feats, logits), TOL, record_property,
                f"rope {case} ({name}; 2 blocks, width 192, {grid[0]}x"
                f"{grid[1]} grid)")
  # Naver's axial _ape_ tree is DeiT-III's too: Eva's names by the name.
  layout = layouts.timm_layout_for_name(name)
  assert (layout == "timm_eva") == (case == "axial_ape")
  back = formats.to_timm(variables, layout)
  assert sorted(back) == sorted(sd)
  for k, v in sd.items():
    assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
  _timm_model(case, back)  # strict
  net = twins.timm_model(model, variables, image_size=_pixels(grid))
  assert type(net).__name__ == "Eva"
  with torch.no_grad():
    assert_close_rel(net(xt).numpy(), logits, 1e-6, "twin")


def test_what_must_move_the_logits_moves_them():
  """Each block's learned frequencies (RoPE-Mixed), the position
  embedding beside them, the axis RoPE rotates by first (x for Naver's,
  y for SBB's and LingBot's: on a non-square grid the other order is
  another function), the class token pooled."""
  def moved(case, logits, **kw):
    model, variables = _loaded(case)
    got = jax.jit(model.clone(**kw).apply)(variables, _built(case)[2])
    return np.abs(np.asarray(got) - logits).max() / np.abs(logits).max()

  _, _, x, _, _, logits = _built("mixed_ape")
  model, variables = _loaded("mixed_ape")
  flat = trees.flatten(variables)
  for part in ((0,), (1,), (0, 1)):  # block 0's, block 1's, both
    freqs = np.array(flat[FREQS])
    for i in part:
      freqs[:, i] *= 1.5
    got = jax.jit(model.apply)(trees.unflatten(dict(flat, **{FREQS: freqs})),
                               x)
    assert np.abs(np.asarray(got) - logits).max() > 100 * TOL * np.abs(
        logits).max(), part
  pos = "params/Transformer/posembed_input/pos_embedding"
  got = jax.jit(model.apply)(
      trees.unflatten(dict(flat, **{pos: flat[pos] * 1.5})), x)
  assert np.abs(np.asarray(got) - logits).max() > 100 * TOL * np.abs(
      logits).max()
  for case, other in (("axial", "ij"), ("mixed", "ij"), ("sbb", "xy"),
                      ("lingbot", "xy")):
    assert moved(case, _built(case)[5],
                 rope_grid_indexing=other) > 100 * TOL, case
  assert moved("sbb", _built("sbb")[5], rope_ref_grid=None) > 100 * TOL
  assert moved("lingbot", _built("lingbot")[5], classifier="gap") > 100 * TOL


@pytest.mark.parametrize("case, norm", [("mixed", True), ("sbb", False),
                                        ("lingbot", True)])
def test_intermediates_are_timms(case, norm):
  """forward_intermediates as timm's: NCHW patch tokens and the prefix
  tokens apart, through the final norm with ``norm`` (an fc_norm model
  has none: timm's norm is an identity there)."""
  m, _, x, xt, _, _ = _built(case)
  model, variables = _loaded(case)
  with torch.no_grad():
    want_final, want = m.forward_intermediates(xt, norm=norm,
                                               return_prefix_tokens=True)
  final, got = jax.jit(lambda v, x: model.apply(
      v, x, method=model.forward_intermediates, norm=norm,
      output_fmt="NCHW", return_prefix_tokens=True))(variables, x)
  assert_close_rel(final, want_final.numpy(), TOL, "final features")
  grid, prefix = CASES[case][2], model.num_prefix_tokens
  assert len(got) == len(want) == 2
  for (g, g_pre), (w, w_pre) in zip(got, want):
    assert g.shape == (2, 192, *grid) and g_pre.shape == (2, prefix, 192)
    assert_close_rel(g, w.numpy(), TOL, "intermediate")
    assert_close_rel(g_pre, w_pre.numpy(), TOL, "prefix tokens")


@pytest.mark.parametrize("case", ["sbb", "mixed_ape", "lingbot"])
def test_another_input_size_as_timms_dynamic_img_size(case):
  """timm's model with ``dynamic_img_size`` (LingBot's own default) at a
  grid other than the weights': RoPE for the input's grid (SBB's rescaled
  onto its 16x16 reference, the mixed frequencies over the larger grid),
  a learned embedding resampled per input as timm's (ours with
  ``dynamic_img_size``)."""
  _, sd, _, _, _, _ = _built(case)
  m = _timm_model(case, sd, dynamic_img_size=True)
  x, xt = verify.inputs(CASES[case][0], m, _pixels((4, 6)), batch=2)
  with torch.no_grad():
    ref = m(xt).numpy()
  kw = dict(dynamic_img_size=True) if case == "mixed_ape" else {}
  model, variables = _loaded(case, **kw)
  if kw:  # the 3x5 grid the embedding was made for (not a square)
    model = model.clone(image_size=_pixels(CASES[case][2]))
  assert_close_rel(jax.jit(model.apply)(variables, x), ref, TOL, case)


def test_scanned_blocks_take_their_own_frequencies():
  """Under nn.scan each block gets its own tables (scanned, not
  broadcast): the same logits, and a gradient for every block's
  frequencies."""
  _, sd, x, _, _, logits = _built("mixed")
  model, variables = formats.from_timm(sd, CASES["mixed"][0],
                                       scan_layers=True)
  assert_close_rel(jax.jit(model.apply)(variables, x), logits, TOL)
  grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2)))(
      variables)
  g = np.asarray(grads["params"]["Transformer"]["rope_freqs"])
  assert g.shape == (2, 2, 3, 32)
  assert all(np.abs(g[:, i]).max() > 0 for i in range(2))


def test_mixed_initial_frequencies_are_timms():
  """A fresh model's frequencies are timm's init_random_2d_freqs: its
  magnitudes (T 10), each block's head turned by one angle, the y
  frequencies the x ones a quarter turn on."""
  model = models.get_model("vit_ti_16", num_classes=0, num_layers=3,
                           rope="mixed", rope_temperature=10.0)
  params = jax.jit(model.init, static_argnames="train")(
      jax.random.key(0), jnp.zeros((1, 32, 32, 3)), train=False)["params"]
  f = np.asarray(params["Transformer"]["rope_freqs"])
  ref = pos_embed_sincos.init_random_2d_freqs(64, 3, 3, temperature=10.0)
  assert f.shape == tuple(ref.shape) == (2, 3, 3, 32)
  mag = np.hypot(f[0], f[1])
  np.testing.assert_allclose(mag, np.hypot(ref[0].numpy(), ref[1].numpy()),
                             rtol=1e-6)
  angles = np.arctan2(f[1, ..., 0], f[0, ..., 0])  # one per block and head
  assert len(np.unique(np.round(angles, 5))) == 9
  np.testing.assert_allclose(np.arctan2(f[1, ..., 16], f[0, ..., 16]),
                             np.angle(np.exp(1j * (angles + np.pi / 2))),
                             atol=1e-5)


def test_the_name_decides_what_the_keys_cannot():
  """Without a name an Eva checkpoint is refused (its RoPE is not in the
  keys); a name of another structure is refused naming the difference;
  the learned frequencies are a structure the keys show."""
  for case in ("sbb", "mixed"):
    with pytest.raises(layouts.Undecided, match="rotary position embedding "
                       "is not stored"):
      formats.from_timm(_built(case)[1])
  with pytest.raises(build.NameMismatch, match=re.escape(
      "learned RoPE frequencies (the name: no learned RoPE frequencies)")):
    formats.from_timm(_built("mixed")[1], "vit_small_patch16_rope_224")
  with pytest.raises(build.NameMismatch, match="1 registers"):
    formats.from_timm(_built("sbb")[1], "vit_betwixt_patch16_rope_reg4_gap_256")
  # The tree of Naver's axial _ape_ model is DeiT-III's: without the
  # layout, to_timm gives VisionTransformer's names.
  back = formats.to_timm(_loaded("axial_ape")[1])
  assert "blocks.0.ls1.gamma" in back and "blocks.0.gamma_1" not in back


def test_arch_record_and_checkpoint_keep_the_architecture(tmp_path):
  record, back = record_round_trip(*_loaded("mixed_ape"),
                                   str(tmp_path / "mixed.safetensors"))
  assert (record["rope"], record["rope_grid_indexing"]) == ("mixed", "xy")
  _, _, x, _, _, logits = _built("mixed_ape")
  assert_close_rel(jax.jit(back.model.apply)(back.variables, x), logits, TOL)


def test_options_that_do_not_combine_are_refused():
  x = np.zeros((1, 32, 32, 3), np.float32)
  for kw, match in (
      (dict(rope="mixed", rope_ref_grid=(16, 16)), "do not apply"),
      (dict(rope="mixed", rope_grid_offset=1.0), "do not apply"),
      (dict(rope="mixed", num_heads=5, hidden_size=190), "divisible by 4"),
      (dict(rope="axial"), "RoPE-Mixed's learned frequencies"),
  ):
    model = models.get_model("vit_ti_16", num_classes=0, **kw)
    with pytest.raises(ValueError, match=match):
      jax.eval_shape(model.init, jax.random.key(0), x)
  with pytest.raises(ValueError, match="learned frequencies"):
    rope_lib.sincos("mixed", (2, 2), 64)


@pytest.mark.parametrize("name, want", [
    ("vit_base_patch16_rope_mixed_ape_224", (12, 12, "mixed", True)),
    ("vit_betwixt_patch16_rope_reg4_gap_256", (12, 10, "cat", False)),
    ("vit_giant_patch16_lingbot", (40, 24, "dinov3", False))])
def test_parameter_count_is_timms(name, want):
  model, got, count = parameter_counts(name)
  assert (model.num_layers, model.num_heads, model.rope,
          model.abs_pos_embed) == want
  assert got == count


def test_listed_names_are_timms():
  """Every RoPE ViT and LingBot-Vision architecture of timm's eva module,
  each verified by the registry's check; the tags are timm's released
  ones."""
  for pattern, n in (("*_rope_*", 16), ("*_lingbot", 4)):
    archs = sorted(timm.list_models(pattern))
    assert vit_jax.list_models(pattern) == archs and len(archs) == n
    released = sorted(timm.list_models(pattern, pretrained=True))
    assert vit_jax.list_models(pattern, pretrained=True) == released
