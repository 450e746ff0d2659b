"""Flax NNX: a loaded model as an ``nnx.Module`` gives the linen model's
numbers (and timm's), fine-tunes with ``nnx.Optimizer``, and goes back to
linen variables bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx

import vit_jax.nnx as vnnx
from compare import apply, assert_close_rel, images, random_timm, timm_logits
from vit_jax import formats, weights


def _dinov2(tmp_path):
  m = random_timm(name="vit_small_patch14_reg4_dinov2", depth=2, size=56,
                  num_classes=7)
  path = str(tmp_path / "dinov2.pth")
  torch.save(m.state_dict(), path)
  return m, weights.load(path, model_name="vit_small_patch14_reg4_dinov2")


def test_nnx_module_computes_the_loaded_model(tmp_path):
  tm, loaded = _dinov2(tmp_path)
  module = vnnx.to_nnx(loaded)
  assert isinstance(module, nnx.Module)
  x = images(2, 56)
  got = np.asarray(module(jnp.asarray(x), train=False))
  want = apply(loaded.model, loaded.variables, x)
  assert_close_rel(got, want, rel=1e-6)  # the linen model's numbers
  assert_close_rel(got, timm_logits(tm, x))  # and so timm's
  feats = module.forward_features(jnp.asarray(x), train=False)
  assert feats.shape == (2, 1 + 4 + 16, 384)
  model, variables = vnnx.to_linen(module)
  assert model is loaded.model
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         jax.tree_util.tree_map(np.asarray, variables),
                         jax.tree_util.tree_map(np.asarray,
                                                dict(loaded.variables)))


def test_fine_tune_with_nnx_optimizer(tmp_path):
  """The short NNX fine-tuning loop of vit_jax/nnx.py's docstring: a few
  AdamW steps (drop path on: the 'dropout' stream) lower the loss, and the
  tuned weights go back to linen, where to_timm loads them strictly."""
  _, loaded = _dinov2(tmp_path)
  model = loaded.model.clone(drop_path_rate=0.1)
  module = vnnx.to_nnx(model, loaded.variables,
                       rngs=nnx.Rngs(params=0, dropout=1))
  optimizer = nnx.Optimizer(module, optax.adamw(3e-3), wrt=nnx.Param)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((8, 56, 56, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 7, 8))

  def loss_fn(m):
    logits = m(x, train=True)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @nnx.jit
  def step(m, opt):
    loss, grads = nnx.value_and_grad(loss_fn)(m)
    opt.update(m, grads)
    return loss

  losses = [float(step(module, optimizer)) for _ in range(8)]
  assert losses[-1] < losses[0], losses
  tuned_model, tuned = vnnx.to_linen(module)
  sd = formats.to_timm(tuned)
  import timm  # pylint: disable=import-outside-toplevel
  twin = timm.create_model("vit_small_patch14_reg4_dinov2", pretrained=False,
                           depth=2, img_size=56, num_classes=7)
  twin.load_state_dict(sd, strict=True)
  before = np.asarray(loaded.model.apply(loaded.variables, np.asarray(x),
                                         train=False))
  after = np.asarray(tuned_model.apply(tuned, np.asarray(x), train=False))
  assert not np.allclose(before, after)
