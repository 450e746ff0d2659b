"""Numeric parity with torchvision: same weights + same inputs -> same numbers.

Float32 on CPU, random torchvision weights (``torch.manual_seed``) with a
random head; the named variants from torchvision's own builders, every
parameter random (LayerNorm scales and biases too). Tolerance:
max |ours - torch| <= 1e-4 x max |torch|.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchvision.models.vision_transformer import interpolate_embeddings

from vit_jax import convert
from tv_utils import (assert_close_rel, images, nhwc, random_torchvision,
                      torchvision_vit)

REL = 1e-4


def _logits_pair(tv, name, x, **overrides):
  with torch.inference_mode():
    ref = tv(torch.from_numpy(x)).numpy()
  model, variables = convert.from_torchvision(tv.state_dict(), name, **overrides)
  ours = jax.jit(lambda v, im: model.apply(v, im, train=False))(
      variables, jnp.asarray(nhwc(x)))
  return np.asarray(ours), ref


@pytest.mark.parametrize("name,num_classes,scan", [
    ("vit_b_16", 17, False),
    ("vit_b_32", 5, False),
    ("vit_l_16", 1000, True),
    ("vit_l_32", 3, False),
    pytest.param("vit_h_14", 21, True, marks=pytest.mark.slow),
])
def test_logits_match_torchvision(name, num_classes, scan, record_property):
  tv = random_torchvision(name, num_classes)
  # ViT-H/14 (632M parameters, every one in each image's logits) on one
  # image: the batch's rows are the other variants' check (the same code).
  x = images(1 if name == "vit_h_14" else 2, 224)
  ours, ref = _logits_pair(tv, name, x, scan_layers=scan)
  err, scale = assert_close_rel(ours, ref, REL)
  record_property("max_abs_diff", float(err))
  print(f"{name}: max|diff| {err:.3g} (max|logit| {scale:.3g}, rel {err / scale:.2g})")


def test_logits_match_with_representation_size():
  name = "vit_s_32"
  tv = torchvision_vit(name, num_classes=7, representation_size=96)
  model, variables = convert.from_torchvision(tv.state_dict(), name)
  assert model.representation_size == 96
  assert variables["params"]["pre_logits"]["kernel"].shape == (384, 96)
  x = images(3, 224, seed=1)
  ours, ref = _logits_pair(tv, name, x)
  assert_close_rel(ours, ref, REL)


def test_intermediate_block_outputs_match_layer_by_layer():
  name = "vit_s_16"
  tv = torchvision_vit(name, num_classes=10)
  captured = {}

  def hook(i):
    def fn(_, __, out):
      captured[i] = out.detach().numpy()
    return fn

  for i, layer in enumerate(tv.encoder.layers):
    layer.register_forward_hook(hook(i))
  x = images(2, 224, seed=2)
  with torch.inference_mode():
    tv_stem = tv.conv_proj(torch.from_numpy(x)).numpy()
    ref_logits = tv(torch.from_numpy(x)).numpy()
  model, variables = convert.from_torchvision(tv.state_dict(), name)
  _, state = model.apply(variables, jnp.asarray(nhwc(x)),
                         mutable=["intermediates"])
  inter = state["intermediates"]
  assert_close_rel(inter["stem"][0], nhwc(tv_stem), REL, "stem")
  for i in range(model.num_layers):
    assert_close_rel(inter[f"block{i:02d}"][0], captured[i], REL, f"block{i:02d}")
  assert_close_rel(inter["logits"][0], ref_logits, REL)


def test_gradients_match_torch_autograd():
  """d(loss)/d(input) and d(loss)/d(params), mapped back through the
  converter, equal torch autograd's for ViT-Ti/16."""
  name = "vit_ti_16"
  tv = torchvision_vit(name, num_classes=10).train()  # dropout is 0 anyway
  x = images(2, 224, seed=3)
  labels = np.array([3, 7])

  xt = torch.from_numpy(x).requires_grad_(True)
  loss_t = F.cross_entropy(tv(xt), torch.from_numpy(labels))
  loss_t.backward()
  torch_input_grad = xt.grad.numpy()
  torch_param_grads = {k: p.grad.numpy() for k, p in tv.named_parameters()}

  model, variables = convert.from_torchvision(tv.state_dict(), name)

  def loss_fn(params, im):
    logits = model.apply({"params": params}, im, train=True)
    onehot = jax.nn.one_hot(labels, 10)
    return -jnp.mean(jnp.sum(onehot * jax.nn.log_softmax(logits), -1))

  loss_j, (gp, gx) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(
      variables["params"], jnp.asarray(nhwc(x)))
  np.testing.assert_allclose(float(loss_j), loss_t.item(), rtol=1e-5)
  assert_close_rel(gx, nhwc(torch_input_grad), REL, "d loss / d input")

  ours = convert.params_to_torchvision({"params": gp})
  assert set(ours) == set(torch_param_grads)
  for k, g in torch_param_grads.items():
    assert_close_rel(ours[k], g, REL, f"d loss / d {k}")


def test_resampled_384_matches_torchvision_interpolate_embeddings():
  name = "vit_b_16"
  tv224 = torchvision_vit(name, num_classes=11)
  sd384 = interpolate_embeddings(384, 16, dict(tv224.state_dict()))
  tv384 = torchvision_vit(name, num_classes=11, image_size=384)
  tv384.load_state_dict(sd384, strict=True)

  x = images(1, 384, seed=4)
  with torch.inference_mode():
    ref = tv384(torch.from_numpy(x)).numpy()
  model, variables = convert.from_torchvision(tv224.state_dict(), name,
                                              image_size=384)
  pe = variables["params"]["Transformer"]["posembed_input"]["pos_embedding"]
  np.testing.assert_allclose(pe, sd384["encoder.pos_embedding"].numpy(),
                             rtol=0, atol=1e-6)
  ours = model.apply(variables, jnp.asarray(nhwc(x)))
  assert_close_rel(ours, ref, REL)


@pytest.mark.parametrize("old_grid", [7, 14, 24])
@pytest.mark.parametrize("new_size", [64, 160, 384, 512])
def test_resample_posemb_equals_interpolate_embeddings(old_grid, new_size):
  rng = np.random.default_rng(new_size)
  pe64 = rng.standard_normal((1, old_grid ** 2 + 1, 32))
  for dtype, rel in ((np.float64, 1e-12), (np.float32, 2e-6)):
    # float64: the same algorithm to ~1e-15; float32: PyTorch accumulates in
    # float32, we in float64, so the two differ by float32 rounding only.
    pe = pe64.astype(dtype)
    ref = interpolate_embeddings(new_size, 16, {
        "encoder.pos_embedding": torch.from_numpy(pe)})["encoder.pos_embedding"]
    ours = convert.resample_posemb(pe, new_size // 16)
    assert ours.shape == tuple(ref.shape) and ours.dtype == dtype
    assert_close_rel(ours, ref.numpy(), rel, f"pos_embedding {dtype.__name__}")
    np.testing.assert_array_equal(ours[:, 0], pe[:, 0])  # class token kept


def test_jax_image_resize_is_not_torchvision_bicubic():
  """Documents why resample_posemb exists: jax.image.resize differs."""
  rng = np.random.default_rng(0)
  pe = rng.standard_normal((1, 14 * 14 + 1, 8)).astype(np.float32)
  ref = interpolate_embeddings(384, 16, {
      "encoder.pos_embedding": torch.from_numpy(pe)})["encoder.pos_embedding"]
  grid = jax.image.resize(pe[0, 1:].reshape(14, 14, 8), (24, 24, 8), "bicubic")
  assert np.abs(np.asarray(grid).reshape(-1, 8) - ref.numpy()[0, 1:]).max() > 1e-3
