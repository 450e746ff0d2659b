"""Layer stacking with nn.scan: same function, same gradients, same weights.

``scan_layers=True`` stores the blocks under ``Transformer/encoderblock``
with a leading layer axis; everything else about the model is unchanged.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import convert, models

DEPTH = 3


def _model(**kw):
  kw.setdefault("num_layers", DEPTH)
  return models.get_model("vit_ti_16", num_classes=5, **kw)


def _variables(model):
  v = models.init_params(model, 32)
  # Non-trivial values everywhere (the head and biases start at zero).
  @jax.jit  # one program, not one per leaf
  def noisy(v):
    leaves, treedef = jax.tree_util.tree_flatten(v)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    leaves = [a + 0.05 * jax.random.normal(k, a.shape, a.dtype)
              for a, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(treedef, leaves)
  return noisy(v)


def _images(n=2, size=32, seed=0):
  return jax.random.normal(jax.random.key(seed), (n, size, size, 3))


def _loss(model, params, x):
  logits = model.apply({"params": params}, x, train=True)
  return jnp.mean(jax.nn.log_softmax(logits)[:, 0] * -1.0) + jnp.mean(logits ** 2)


@pytest.fixture(scope="module")
def unrolled():
  model = _model()
  return model, _variables(model)


def test_scanned_tree_is_the_stacked_unrolled_tree(unrolled):
  model, variables = unrolled
  scanned = _model(scan_layers=True)
  shapes = jax.eval_shape(lambda: models.init_params(scanned, 32))
  stacked = convert.stack_layers(variables)
  assert (jax.tree_util.tree_structure(shapes)
          == jax.tree_util.tree_structure(stacked))
  for a, b in zip(jax.tree_util.tree_leaves(shapes),
                  jax.tree_util.tree_leaves(stacked)):
    assert a.shape == b.shape
  block = stacked["params"]["Transformer"]["encoderblock"]
  assert block["MultiHeadDotProductAttention_0"]["query"]["kernel"].shape == (
      DEPTH, 192, 3, 64)
  back = convert.unstack_layers(stacked)
  jax.tree_util.tree_map(np.testing.assert_array_equal, back, variables)


@pytest.mark.parametrize("remat_policy", [None, "full", "dots"])
def test_scanned_logits_equal_unrolled(unrolled, remat_policy):
  model, variables = unrolled
  x = _images()
  ref = model.apply(variables, x)
  scanned = _model(scan_layers=True, remat_policy=remat_policy)
  got = scanned.apply(convert.stack_layers(variables), x)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("remat_policy", [None, "dots"])
def test_scanned_gradients_equal_unrolled(unrolled, remat_policy):
  model, variables = unrolled
  x = _images(seed=1)
  ref = jax.grad(lambda p: _loss(model, p, x))(variables["params"])
  scanned = _model(scan_layers=True, remat_policy=remat_policy)
  stacked = convert.stack_layers(variables)["params"]
  got = jax.grad(lambda p: _loss(scanned, p, x))(stacked)
  got = convert.unstack_layers(got)
  flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref))
  flat_got = dict(jax.tree_util.tree_leaves_with_path(got))
  assert flat_ref.keys() == flat_got.keys()
  for k, g in flat_ref.items():
    np.testing.assert_allclose(flat_got[k], g, rtol=2e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(k))


def test_scanned_program_size_is_independent_of_depth():
  """What makes compile time flat in depth: one block body in the program."""
  def hlo_size(depth, scan):
    model = _model(num_layers=depth, scan_layers=scan)
    shapes = jax.eval_shape(lambda: models.init_params(model, 32))
    x = jax.ShapeDtypeStruct((2, 32, 32, 3), jnp.float32)
    step = jax.jit(jax.grad(lambda p, x: _loss(model, p, x)))
    return len(step.lower(shapes["params"], x).as_text().splitlines())

  assert hlo_size(2, True) == hlo_size(6, True)
  assert hlo_size(6, False) > 2 * hlo_size(2, False)


def test_scanned_tree_round_trips_through_torchvision():
  torch = pytest.importorskip("torch")
  import torchvision  # pylint: disable=import-outside-toplevel

  torch.manual_seed(0)
  tv = torchvision.models.VisionTransformer(
      image_size=32, patch_size=16, num_layers=DEPTH, num_heads=3,
      hidden_dim=192, mlp_dim=768, num_classes=5).eval()
  with torch.no_grad():
    torch.nn.init.normal_(tv.heads.head.weight, std=0.5)
  model, variables = convert.from_torchvision(
      tv.state_dict(), "vit_ti_16", scan_layers=True, num_layers=DEPTH)
  assert model.scan_layers
  assert "encoderblock" in variables["params"]["Transformer"]
  back = convert.to_torchvision(variables)
  for k, t in tv.state_dict().items():
    assert torch.equal(back[k], t), k
  x = np.asarray(_images(2, 32, seed=2))
  with torch.inference_mode():
    ref = tv(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
  np.testing.assert_allclose(model.apply(variables, x), ref, rtol=1e-4,
                             atol=1e-4)
