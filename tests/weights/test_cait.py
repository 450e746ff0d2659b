"""CaiT (timm's ``Cait``, ``cait_*``) loaded both ways, against timm.

One reduced timm model stands for the family: ``cait_xxs24_224`` with 2
blocks (talking-heads attention, LayerScale) and timm's 2 class-attention
blocks, width 192 in 4 heads, a non-square 3x4 grid of patches (48x64
images), a 7-class head. Its state dict is random at the scales of the
registry's check (:class:`vit_jax.weights.verify.RandomWeights`: Linear
weights N(0, 1/fan_in), so the (4, 4) head-mixing maps mix for real;
LayerScale gammas, biases, tokens N(0, 0.1), far from timm's 1e-5 and
zeros), and the images are small (std 0.1) so that the norms' epsilon
shows. ``formats.from_timm(state_dict, 'cait_xxs24_224')`` must give
timm's logits and ``forward_features`` within 1e-5 (float32, highest
matmul precision), its ``forward_intermediates`` too; ``formats.to_timm``
loads back into timm strictly, bit for bit, in timm's key order. The
released names at their real widths are checked by
``tests/weights/test_registry.py`` (``-k cait``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vit_jax
from compare import (assert_close_rel, assert_parity, features_and_logits,
                     parameter_counts, record_round_trip, timm_reference)
from vit_jax import formats, models
from vit_jax.weights import trees, twins

timm = pytest.importorskip("timm")
torch = pytest.importorskip("torch")

TOL = 1e-5
NAME = "cait_xxs24_224"
SIZE = (48, 64)  # a 3x4 grid of patches
KWARGS = dict(depth=2, img_size=SIZE, num_classes=7)


@pytest.fixture(autouse=True)
def _highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


def _timm_cait(sd=None):
  m = timm.create_model(NAME, pretrained=False, **KWARGS)
  if sd is not None:
    m.load_state_dict(sd, strict=True)
  return m.eval()


@pytest.fixture(scope="module")
def cait():
  """(timm model, its state dict, NHWC images, NCHW images, timm's
  forward_features, timm's logits)."""
  return timm_reference(_timm_cait(), NAME, SIZE)


@pytest.fixture(scope="module")
def loaded(cait):
  return formats.from_timm(cait[1], NAME)


def test_from_timm_equals_timm(cait, loaded, record_property):
  _, _, x, _, feats, logits = cait
  model, variables = loaded
  assert model.talking_heads and model.class_attn_layers == 2
  assert (model.num_heads, model.no_embed_class, model.layer_norm_eps,
          model.drop_path_schedule) == (4, True, 1e-6, "constant")
  assert model.num_prefix_tokens == 1 and model.classifier == "token"
  got_feats, got_logits = features_and_logits(model)(variables, x)
  head = assert_parity(
      (got_feats, got_logits), (feats, logits), TOL, record_property,
      f"{NAME} (2 blocks + 2 class-attention, width 192, 3x4 grid)")
  whole = jax.jit(lambda v, x: model.apply(v, x))(variables, x)
  np.testing.assert_allclose(whole, got_logits, rtol=0,
                             atol=TOL * head.scale)


@pytest.mark.parametrize("norm", [False, True])
def test_intermediates_are_timms(cait, loaded, norm):
  """forward_intermediates as timm's: the blocks' patch tokens (the class
  token joins after them), NCHW, through the final norm with ``norm``."""
  m, _, x, xt, _, _ = cait
  model, variables = loaded
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
  with pytest.raises(ValueError, match="patch tokens only"):
    model.apply(variables, x, method=model.forward_intermediates,
                return_prefix_tokens=True)


def test_to_timm_round_trip_is_strict_and_exact(cait, loaded):
  _, sd, _, _, _, _ = cait
  back = formats.to_timm(loaded[1])
  assert list(back) == list(sd)  # timm's own order
  for k, v in sd.items():
    assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
  _timm_cait(back)  # strict


def test_without_a_name_the_keys_decide(cait, loaded):
  """The keys show all of CaiT (its heads in the (heads, heads) mixing
  maps; every Cait's one drop-path rate): the same model without a name.
  A Cait without class-attention blocks is refused, naming them."""
  _, sd, x, _, _, logits = cait
  model, variables = formats.from_timm(sd)
  assert models.arch_record(model) == models.arch_record(loaded[0])
  assert_close_rel(jax.jit(model.apply)(variables, x), logits, TOL)
  no_class_blocks = {k: v for k, v in sd.items()
                     if not k.startswith("blocks_token_only.")}
  with pytest.raises(ValueError, match="class-attention blocks"):
    formats.from_timm(no_class_blocks)
  with pytest.raises(ValueError, match="not a vit_base_patch16_224"):
    formats.from_timm(sd, "vit_base_patch16_224")


def test_timm_twin(cait, loaded):
  """The PyTorch twin (ONNX export, to_torch) is timm's Cait, built from
  our fields and loaded strictly: timm's logits."""
  _, _, _, xt, _, logits = cait
  net = twins.timm_model(*loaded, image_size=SIZE)
  assert type(net).__name__ == "Cait"
  with torch.no_grad():
    assert_close_rel(net(xt).numpy(), logits, 1e-6)


def test_scanned_and_rematerialised_blocks(cait):
  """scan_layers (the blocks stacked; the class-attention blocks after
  the scan) and remat give the same logits and a gradient."""
  _, sd, x, _, _, logits = cait
  model, variables = formats.from_timm(sd, NAME, scan_layers=True,
                                       remat_policy="full")
  assert "encoderblock" in variables["params"]["Transformer"]
  assert "classblock_1" in variables["params"]["Transformer"]
  assert_close_rel(jax.jit(model.apply)(variables, x), logits, TOL)
  grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x))))(variables)
  mix = grads["params"]["Transformer"]["encoderblock"][
      "MultiHeadDotProductAttention_0"]["proj_l"]["kernel"]
  assert mix.shape == (2, 4, 4) and float(jnp.abs(mix).max()) > 0


def test_arch_record_and_checkpoint_keep_the_architecture(loaded, cait,
                                                          tmp_path):
  record, back = record_round_trip(*loaded,
                                   str(tmp_path / "cait.safetensors"))
  assert (record["talking_heads"], record["class_attn_layers"],
          record["drop_path_schedule"]) == (True, 2, "constant")
  _, _, x, _, _, logits = cait
  assert_close_rel(jax.jit(back.model.apply)(back.variables, x), logits, TOL)


def test_every_part_matters(cait, loaded):
  """The parity is not vacuous: the head-mixing maps, the class-attention
  blocks' LayerScale and the blocks' move the logits by far more than the
  tolerance when scaled by 1.5."""
  _, _, x, _, _, logits = cait
  model, variables = loaded
  scale = np.abs(logits).max()
  apply = jax.jit(model.apply)
  flat = trees.flatten(variables)
  for part in ("encoderblock_1/MultiHeadDotProductAttention_0/proj_l/kernel",
               "encoderblock_1/MultiHeadDotProductAttention_0/proj_w/kernel",
               "encoderblock_0/LayerScale_1/scale",
               "classblock_0/LayerScale_0/scale"):
    key = "params/Transformer/" + part
    moved = trees.unflatten(dict(flat, **{key: flat[key] * 1.5}))
    err = np.abs(np.asarray(apply(moved, x)) - logits).max() / scale
    assert err > 100 * TOL, (part, err)


def test_stochastic_depth_at_one_rate_as_timms():
  """drop_path_schedule='constant': the first block drops its branches at
  drop_path_rate too (timm's CaiT); 'linear' starts from 0."""
  x = np.full((16, 32, 32, 3), 0.1, np.float32)

  def first_block(schedule):
    model = models.get_model(NAME, num_layers=2, hidden_size=32, num_heads=2,
                             mlp_dim=64, class_attn_layers=1, image_size=32,
                             drop_path_rate=0.5, drop_path_schedule=schedule)
    variables = models.init_params(model, 32)
    (y,) = jax.jit(lambda v, x: model.apply(
        v, x, method=model.forward_intermediates, indices=[0],
        output_fmt="NLC", intermediates_only=True, train=True,
        rngs={"dropout": jax.random.key(1)}))(variables, x)
    return np.asarray(y)

  linear, constant = first_block("linear"), first_block("constant")
  assert np.allclose(linear, linear[:1])  # every image the same: no drops
  assert not np.allclose(constant, constant[:1])


def test_options_that_do_not_combine_are_refused():
  x = np.zeros((1, 32, 32, 3), np.float32)
  for kw, match in (
      (dict(class_attn_layers=2), "no_embed_class"),
      (dict(class_attn_layers=2, no_embed_class=True, num_registers=4),
       "registers"),
      (dict(talking_heads=True, attention_impl="cudnn"), "cudnn"),
      (dict(drop_path_schedule="cosine"), "drop_path_schedule"),
  ):
    model = models.get_model("vit_ti_16", num_classes=0, **kw)
    with pytest.raises(ValueError, match=match):
      model.init(jax.random.key(0), x)


def test_parameter_count_is_timms():
  """A real-size name: cait_s24_384 (24 blocks, 2 class-attention blocks,
  width 384 in 8 heads, a 24x24 grid) has timm's parameter count."""
  model, got, want = parameter_counts("cait_s24_384")
  assert (model.num_layers, model.class_attn_layers, model.num_heads) == (
      24, 2, 8)
  assert got == want


def test_listed_names_are_timms_released_ones():
  released = sorted({n.split(".", 1)[0]
                     for n in timm.list_models("cait_*", pretrained=True)})
  assert vit_jax.list_models("cait*") == released
  assert len(vit_jax.list_models("cait*", pretrained=True)) == len(released)
