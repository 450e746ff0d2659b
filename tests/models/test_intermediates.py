"""``forward_intermediates``: every layer's features, equal to timm's
``forward_intermediates`` (NCHW transposed) on random (perturbed) weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from compare import assert_close_rel, images, perturb_torch, torch_in

timm = pytest.importorskip("timm")

from vit_jax import formats, models  # noqa: E402

SIZE = 64
DEPTH = 4
FAMILIES = {
    "classic": {},
    "registers": dict(reg_tokens=4, no_embed_class=True),
    "no_class_token": dict(class_token=False, global_pool="avg",
                           fc_norm=True),
}
# (indices, norm, return_prefix_tokens): all blocks; the last 2, normed;
# a list with a negative index; an unsorted list (returned in block order).
CALLS = [(None, False, False), (2, True, True), ([0, -1], True, False),
         ([2, 1], False, True)]


def random_timm(depth=DEPTH, **kw):
  torch.manual_seed(0)
  m = timm.create_model("vit_tiny_patch16_224", pretrained=False,
                        num_classes=10, img_size=SIZE, depth=depth, **kw)
  return perturb_torch(m)


def check_against_timm(m, model, variables, x, calls=CALLS):
  """Compares every call's outputs; returns the worst relative error."""
  p = model.num_prefix_tokens
  worst = 0.0
  for indices, norm, prefix in calls:
    with torch.no_grad():
      final, inter = m.forward_intermediates(
          torch_in(x), indices=indices, norm=norm, return_prefix_tokens=prefix)
    fn = jax.jit(lambda v, x: model.apply(  # noqa: B023
        v, x, method=model.forward_intermediates, indices=indices,  # noqa: B023
        norm=norm, return_prefix_tokens=prefix))  # noqa: B023
    ours_final, ours = fn(variables, jnp.asarray(x))
    what = f"indices={indices} norm={norm}"
    worst = max(worst, assert_close_rel(ours_final, final.numpy(),
                                        what=f"final, {what}").rel)
    assert len(ours) == len(inter)
    for a, b in zip(ours, inter):
      if prefix and p:
        (a, a_prefix), (b, b_prefix) = a, b
        assert a_prefix.shape == (len(x), p, model.hidden_size)
        assert_close_rel(a_prefix, b_prefix.numpy(), what=f"prefix, {what}")
      h, w = x.shape[1] // 16, x.shape[2] // 16
      assert a.shape == (len(x), h, w, model.hidden_size)
      worst = max(worst, assert_close_rel(
          a, b.numpy().transpose(0, 2, 3, 1), what=what).rel)
  return worst


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forward_intermediates_equal_timm(family, scan, record_property):
  m = random_timm(**FAMILIES[family])
  model, variables = formats.from_timm(m.state_dict(), scan_layers=scan)
  record_property("rel_err", check_against_timm(m, model, variables,
                                                images(2, SIZE)))


def test_forward_intermediates_at_a_dynamic_non_square_size():
  m = random_timm(dynamic_img_size=True, reg_tokens=4, no_embed_class=True)
  model, variables = formats.from_timm(m.state_dict(), dynamic_img_size=True)
  check_against_timm(m, model, variables, images(2, 80, height=48),
                     calls=[([1, 3], True, True)])


def test_output_formats_and_intermediates_only():
  m = random_timm()
  model, variables = formats.from_timm(m.state_dict())
  x = jnp.asarray(images(2, SIZE))
  nhwc = model.apply(variables, x, method=model.forward_intermediates,
                     indices=[1], intermediates_only=True)
  nlc = model.apply(variables, x, method=model.forward_intermediates,
                    indices=[1], intermediates_only=True, output_fmt="NLC")
  nchw = model.apply(variables, x, method=model.forward_intermediates,
                     indices=[1], intermediates_only=True, output_fmt="NCHW")
  assert isinstance(nhwc, list) and len(nhwc) == 1
  assert nhwc[0].shape == (2, 4, 4, 192) and nlc[0].shape == (2, 16, 192)
  np.testing.assert_array_equal(nlc[0], nhwc[0].reshape(2, 16, 192))
  np.testing.assert_array_equal(nchw[0], nhwc[0].transpose(0, 3, 1, 2))
  with torch.no_grad():
    ref = m.forward_intermediates(torch_in(np.asarray(x)), indices=[1],
                                  output_fmt="NLC", intermediates_only=True)
  assert_close_rel(nlc[0], ref[0].numpy())
  tokens = model.apply(variables, x, method=model.forward_features)
  final, _ = model.apply(variables, x, method=model.forward_intermediates)
  np.testing.assert_allclose(final, tokens, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("indices, match", [
    (0, r"1 <= n <= 4"), (5, r"1 <= n <= 4"), ([4], "block 4 is out of range"),
    ([-5], "block -5 is out of range"), ([], "at least one block")])
def test_bad_indices_are_named(indices, match):
  with pytest.raises(ValueError, match=match):
    models.feature_take_indices(DEPTH, indices)


def test_feature_take_indices_is_timms():
  from timm.models._features import feature_take_indices  # pylint: disable=import-outside-toplevel
  for indices in (None, 1, 3, [0, 2], [-1, 0], [3, 1, 1]):
    want = sorted(set(feature_take_indices(DEPTH, indices)[0]))
    assert models.feature_take_indices(DEPTH, indices) == want


def test_unknown_output_format_is_named():
  model = models.get_model("vit_ti_16", num_layers=1, num_classes=0)
  x = jnp.zeros((1, 32, 32, 3))
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="output_fmt='NCL'"):
    model.apply(variables, x, method=model.forward_intermediates,
                output_fmt="NCL")
