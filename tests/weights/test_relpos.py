"""timm's ``vision_transformer_relpos`` family (``VisionTransformerRelPos``:
``vit_relpos_*``, ``vit_srelpos_*``) loaded both ways, against timm.

Reduced timm models stand for its variants: 2 blocks of width 192 in 3
heads, a non-square 3x4 grid of patches (48x64 images), a 7-class head;
the relative position MLP in timm's ``'cr'`` mode (every released name:
one per block, or one shared) and Swin v2's ``'swin'`` mode, timm's table
(``RelPosBias``, without and with a class token), class-token pooling
(``_cls_``), a class token with mean pooling and ``fc_norm``
(``_clsgap_``), res-post-norm blocks (``_rpn_``). Their state dicts are
random at the scales of the registry's check
(:class:`vit_jax.weights.verify.RandomWeights`: LayerScale gammas, biases,
tokens N(0, 0.1), far from timm's 1e-6 and zeros), and the images are
small (std 0.1) so that the norms' epsilon shows.
``formats.from_timm(state_dict, name)`` (the keys alone where no
released name has the variant) must give timm's logits and
``forward_features`` within 1e-5 (float32, highest matmul precision), its
``forward_intermediates`` too; ``formats.to_timm`` loads back into timm
strictly, bit for bit. The released names at their real widths are
checked by ``tests/weights/test_registry.py`` (``-k relpos``).
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
from vit_jax.models import relpos
from vit_jax.weights import build, trees, twins, verify

timm = pytest.importorskip("timm")
torch = pytest.importorskip("torch")
from timm.layers import pos_embed_rel  # noqa: E402
from timm.models import vision_transformer_relpos as timm_relpos  # noqa: E402

TOL = 1e-5
SIZE = (48, 64)  # a 3x4 grid of patches
NARROW = dict(depth=2, embed_dim=192, num_heads=3, num_classes=7)

# id: (timm name, timm's extra options, the name given to from_timm (None:
# the keys alone), what the loaded model must be: (rel_pos_bias,
# rel_pos_mlp, rel_pos_mlp_dim, classifier, class token, fc_norm,
# post_norm)).
CASES = {
    "mlp": ("vit_relpos_medium_patch16_224", {}, True,
            ("block", "cr", 128, "gap", False, True, False)),
    "shared": ("vit_srelpos_small_patch16_224", {}, True,
               ("shared", "cr", 384, "gap", False, False, False)),
    "cls": ("vit_relpos_medium_patch16_cls_224", {}, True,
            ("block", "cr", 256, "token", True, False, False)),
    "clsgap": ("vit_relpos_base_patch16_clsgap_224", {}, True,
               ("block", "cr", 128, "gap", True, True, False)),
    "rpn": ("vit_relpos_medium_patch16_rpn_224", {}, True,
            ("block", "cr", 128, "gap", False, False, True)),
    "swin": ("vit_relpos_small_patch16_224", dict(rel_pos_type="mlp_swin"),
             False, ("block", "swin", 128, "gap", False, True, False)),
    "table": ("vit_relpos_small_patch16_224", dict(rel_pos_type="bias"),
              False, ("block", None, 128, "gap", False, True, False)),
    "table_cls": ("vit_srelpos_small_patch16_224",
                  dict(rel_pos_type="bias", class_token=True,
                       global_pool="token"), False,
                  ("shared", None, 128, "token", True, False, False)),
}


# What must move the logits (scaled by 1.5: far more than the tolerance),
# so that the parity is not vacuous: each MLP layer, the shared MLP, a
# table, LayerScale, fc_norm. (The MLP's output bias only with a class
# token, and before the last block: a constant on every pair of patches
# leaves the softmax as it is, and the class token's own row has none.)
_ATTN = "Transformer/encoderblock_{}/MultiHeadDotProductAttention_0/"
PARTS = {
    "mlp": (_ATTN.format(1) + "rel_pos_bias/Dense_0/kernel",
            _ATTN.format(1) + "rel_pos_bias/Dense_1/kernel",
            "Transformer/encoderblock_0/LayerScale_1/scale"),
    "cls": (_ATTN.format(0) + "rel_pos_bias/Dense_1/bias",),
    "shared": ("Transformer/rel_pos_bias/Dense_0/bias",),
    "table": (_ATTN.format(1) + "rel_pos_bias/table",),
    "clsgap": ("fc_norm/scale",),
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


def _loaded(case):
  if case not in _LOADED:
    name, _, named, _ = CASES[case]
    _LOADED[case] = formats.from_timm(_built(case)[1],
                                      name if named else None)
  return _LOADED[case]


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_timm_equals_timm_both_ways(case, record_property):
  m, sd, x, xt, feats, logits = _built(case)
  model, variables = _loaded(case)
  assert (model.rel_pos_bias, model.rel_pos_mlp, model.rel_pos_mlp_dim,
          model.classifier, model.has_class_token, model.fc_norm,
          model.post_norm) == CASES[case][3]
  assert not model.abs_pos_embed and model.num_heads == 3
  assert (model.layer_scale_init is None) == model.post_norm
  run = features_and_logits(model)
  assert_parity(run(variables, x), (feats, logits), TOL, record_property,
                f"relpos {case} ({CASES[case][0]} {CASES[case][1]}; 2 "
                f"blocks, width 192, 3x4 grid)")
  flat = trees.flatten(variables)
  for part in PARTS.get(case, ()):
    key = "params/" + part
    moved = trees.unflatten(dict(flat, **{key: flat[key] * 1.5}))
    err = np.abs(np.asarray(run(moved, x)[1]) - logits).max()
    assert err > 100 * TOL * np.abs(logits).max(), (part, err)
  # A table with the class token's rows and no key bias is Beit's too
  # (BEiT's table: the same index and rows): to_timm gives Beit's names
  # unless told VisionTransformerRelPos's, and the twin is timm's Beit.
  layout = "timm_relpos" if case == "table_cls" else None
  back = formats.to_timm(variables, layout)
  if not model.post_norm:  # (ResPostRelPosBlock lists attn before norm1)
    assert list(back) == list(sd)  # timm's own order
  assert sorted(back) == sorted(sd)
  for k, v in sd.items():
    assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
  _timm_model(case, back)  # strict
  net = twins.timm_model(model, variables, image_size=SIZE)
  assert type(net).__name__ == ("Beit" if case == "table_cls"
                                else "VisionTransformerRelPos")
  with torch.no_grad():
    assert_close_rel(net(xt).numpy(), logits, 1e-6, "twin")


@pytest.mark.parametrize("case, norm", [("cls", False), ("cls", True),
                                        ("clsgap", True)])
def test_intermediates_are_timms(case, norm):
  """forward_intermediates as timm's: NCHW patch tokens and the class
  token apart, through the final norm with ``norm`` (an fc_norm model has
  none: timm's norm is an identity there)."""
  m, _, x, xt, _, _ = _built(case)
  model, variables = _loaded(case)
  with torch.no_grad():
    want_final, want = m.forward_intermediates(xt, norm=norm,
                                               return_prefix_tokens=True)
  final, got = jax.jit(lambda v, x: model.apply(
      v, x, method=model.forward_intermediates, norm=norm,
      output_fmt="NCHW", return_prefix_tokens=True))(variables, x)
  assert_close_rel(final, want_final.numpy(), TOL, "final features")
  assert len(got) == len(want) == 2
  for (g, g_cls), (w, w_cls) in zip(got, want):
    assert g.shape == (2, 192, 3, 4) and g_cls.shape == (2, 1, 192)
    assert_close_rel(g, w.numpy(), TOL, "intermediate")
    assert_close_rel(g_cls, w_cls.numpy(), TOL, "class token")


def test_the_name_decides_what_the_keys_cannot():
  """The keys show the bias (MLP or table, its mode and width, where it
  lives, the heads: an output or column per head) and the pooling timm's
  configs use (a class token without fc_norm: the token); a name of
  another structure is refused naming the difference; only the name says
  res-post-norm (_rpn_), as for timm's VisionTransformer."""
  for case in ("cls", "clsgap"):
    model, _ = formats.from_timm(_built(case)[1])
    assert models.arch_record(model) == models.arch_record(_loaded(case)[0])
  for kw in ({}, dict(rel_pos_type="bias", shared_rel_pos=True)):
    m = timm.create_model("vit_relpos_small_patch16_224", depth=1,
                          embed_dim=256, num_heads=8, img_size=SIZE, **kw)
    assert formats.from_timm(m.state_dict())[0].num_heads == 8  # width: 4
  _, sd, x, _, _, logits = _built("rpn")
  pre, variables = formats.from_timm(sd)
  assert not pre.post_norm
  err = np.abs(np.asarray(jax.jit(pre.apply)(variables, x)) - logits).max()
  assert err > 100 * TOL * np.abs(logits).max()
  with pytest.raises(build.NameMismatch, match=re.escape(
      "relative position bias 'shared' (the name: relative position bias "
      "'block')")):
    formats.from_timm(_built("shared")[1], "vit_relpos_small_patch16_224")
  with pytest.raises(build.NameMismatch, match=re.escape(
      "a relative position MLP 'swin' (the name: a relative position MLP "
      "'cr')")):
    formats.from_timm(_built("swin")[1], "vit_relpos_small_patch16_224")


def test_the_mlp_at_another_grid_as_timms_set_input_size():
  """The MLP's coordinates are the grid's: weights of a 3x4 grid run at
  5x6 as timm's model after set_input_size (Swin v2's mode scales them by
  the grid)."""
  for case in ("mlp", "swin"):
    _, sd, _, _, _, _ = _built(case)
    m = _timm_model(case, sd)
    m.set_input_size(img_size=(80, 96))
    x, xt = verify.inputs(CASES[case][0], m, (80, 96), batch=2)
    with torch.no_grad():
      ref = m(xt).numpy()
    model, variables = _loaded(case)
    assert_close_rel(jax.jit(model.apply)(variables, x), ref, TOL, case)


def test_the_table_at_another_grid_as_timms():
  """A table made for a 4x4 grid (timm's RelPosBias, no class token) at
  5x7: timm builds its model there and resizes the table on load
  (checkpoint_filter_fn); ours the same with image_size=, and in the
  forward pass with dynamic_img_size."""
  size = (5, 7)
  m = _timm_model("table", size=(64, 64))
  sd = verify.RandomWeights(size=1 << 20).state_dict(m.state_dict())
  pixels = (16 * size[0], 16 * size[1])
  big = _timm_model("table", size=pixels)
  big.load_state_dict(timm_relpos.checkpoint_filter_fn(dict(sd), big),
                      strict=True)
  x, xt = verify.inputs("table", big, pixels, batch=2)
  with torch.no_grad():
    ref = big(xt).numpy()
  for what, kw in (("image_size", dict(image_size=pixels)),
                   ("dynamic", dict(dynamic_img_size=True))):
    model, variables = formats.from_timm(sd, **kw)
    assert_close_rel(jax.jit(model.apply)(variables, x), ref, TOL, what)


def test_index_coordinates_and_resize_are_timms():
  for grid in ((4, 4), (3, 5), (1, 2)):
    np.testing.assert_array_equal(
        relpos.position_index(grid, class_token=False),
        pos_embed_rel.gen_relative_position_index(grid).numpy())
    np.testing.assert_array_equal(
        relpos.position_index(grid),
        pos_embed_rel.gen_relative_position_index(grid,
                                                  class_token=True).numpy())
  for grid in ((4, 4), (3, 5)):
    for mode in relpos.MLP_MODES:
      np.testing.assert_allclose(
          relpos.log_coords(grid, mode),
          pos_embed_rel.gen_relative_log_coords(grid, mode=mode).numpy(),
          rtol=0, atol=1e-7)
  table = torch.randn(relpos.table_rows((4, 4), class_token=False), 3)
  for new in ((7, 7), (6, 9), (2, 2)):
    ref = pos_embed_rel.resize_rel_pos_bias_table(
        table, new_window_size=new,
        new_bias_shape=(relpos.table_rows(new, class_token=False), 3))
    np.testing.assert_allclose(
        relpos.resize_table(table.numpy(), new, class_token=False),
        ref.numpy(), rtol=0, atol=2e-6)


def test_scanned_blocks_and_xla_attention():
  """The MLPs scan with the blocks (XLA's attention with the bias): the
  same logits, and a gradient for the MLP."""
  _, sd, x, _, _, logits = _built("mlp")
  model, variables = formats.from_timm(
      sd, CASES["mlp"][0], scan_layers=True, attention_impl="xla")
  assert_close_rel(jax.jit(model.apply)(variables, x), logits, TOL)
  grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x))))(variables)
  mlp = grads["params"]["Transformer"]["encoderblock"][
      "MultiHeadDotProductAttention_0"]["rel_pos_bias"]["Dense_0"]["kernel"]
  assert mlp.shape == (2, 2, 128) and float(jnp.abs(mlp).max()) > 0


def test_the_mlp_drops_hidden_units_in_training():
  """timm drops the position MLP's hidden units at 0.125 in training
  (its only dropout in these models): the 'dropout' rng moves the
  logits (in evaluation they are timm's: the parity test)."""
  _, _, x, _, _, logits = _built("shared")
  model, variables = _loaded("shared")
  run = jax.jit(lambda v, x, key: model.apply(
      v, x, train=True, rngs={"dropout": key}))
  a, b = (np.asarray(run(variables, x, jax.random.key(k))) for k in (1, 2))
  assert np.abs(a - b).max() > 100 * TOL * np.abs(logits).max()


def test_arch_record_and_checkpoint_keep_the_architecture(tmp_path):
  record, back = record_round_trip(*_loaded("cls"),
                                   str(tmp_path / "relpos.safetensors"))
  assert (record["rel_pos_bias"], record["rel_pos_mlp"],
          record["rel_pos_mlp_dim"]) == ("block", "cr", 256)
  _, _, x, _, _, logits = _built("cls")
  assert_close_rel(jax.jit(back.model.apply)(back.variables, x), logits, TOL)


def test_options_that_do_not_combine_are_refused():
  x = np.zeros((1, 32, 32, 3), np.float32)
  for kw, match in (
      (dict(rel_pos_mlp="cr"), "rel_pos_bias='block' or 'shared'"),
      (dict(rel_pos_bias="block", rel_pos_mlp="rw"), "expected None"),
      (dict(rel_pos_bias="block", rel_pos_mlp="cr", num_registers=4),
       "no registers"),
      (dict(rel_pos_bias="shared", rel_pos_mlp="cr",
            attention_impl="cudnn"), "cuDNN path does not take"),
      (dict(rel_pos_bias="block", classifier="gap", window_size=1),
       "rel_pos_bias"),
  ):
    model = models.get_model("vit_ti_16", num_classes=0, **kw)
    with pytest.raises(ValueError, match=match):
      jax.eval_shape(model.init, jax.random.key(0), x)
  with pytest.raises(ValueError, match="relative position bias from an MLP"):
    formats.to_transformers(_loaded("mlp")[1])


def test_parameter_count_is_timms():
  """A real-size name: vit_relpos_base_patch16_clsgap_224 (12 blocks of
  width 768, a class token, an MLP of width 128 in each, fc_norm) has
  timm's parameter count."""
  model, got, want = parameter_counts("vit_relpos_base_patch16_clsgap_224")
  assert (model.num_layers, model.num_heads, model.rel_pos_mlp,
          model.classifier, model.has_class_token) == (
              12, 12, "cr", "gap", True)
  assert got == want


def test_listed_names_are_timms():
  """Every architecture of timm's module (but its unit-test model), each
  verified by the registry's check; the tags are timm's released ones."""
  module = "vision_transformer_relpos"
  archs = sorted(n for n in timm.list_models(module=module)
                 if not n.startswith("test_"))
  assert vit_jax.list_models("vit_*relpos_*") == archs
  released = sorted(timm.list_models(module=module, pretrained=True))
  assert vit_jax.list_models("vit_*relpos_*", pretrained=True) == released
  assert len(released) == 9
