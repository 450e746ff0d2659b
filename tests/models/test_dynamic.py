"""Any resolution, any patch size: PyTorch's bicubic matrices, the
``dynamic_img_size`` / ``dynamic_img_pad`` forward pass and FlexiViT's
patch-embedding resampling, each against timm's own functions and models
with random (perturbed) weights."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from compare import (apply, assert_close_rel, images, perturb_torch,
                     random_ours, torch_in)

timm = pytest.importorskip("timm")

from timm.layers import resample_abs_pos_embed, resample_patch_embed  # noqa: E402

from vit_jax import convert, formats, models, weights  # noqa: E402
from vit_jax.models import interpolate  # noqa: E402
from vit_jax.weights import posemb  # noqa: E402

SIZE = 64  # the weights' resolution: a 4x4 grid of /16 patches
# (height, width): the native size, a larger one, a non-square one.
SIZES = [(64, 64), (96, 96), (48, 80)]
FAMILIES = {
    "classic": {},
    "registers": dict(reg_tokens=4, no_embed_class=True),  # DINOv2 +reg
    "registers_embedded": dict(reg_tokens=2),  # registers with pos rows
    "no_class_token": dict(class_token=False, global_pool="avg",
                           fc_norm=False),
}


def random_timm(seed=0, depth=3, size=SIZE, **kw):
  torch.manual_seed(seed)
  m = timm.create_model("vit_tiny_patch16_224", pretrained=False,
                        num_classes=10, img_size=size, depth=depth, **kw)
  return perturb_torch(m, seed)


def run_timm(m, x, method="forward"):
  with torch.no_grad():
    return getattr(m, method)(torch_in(x)).numpy()


# ------------------------------------------------------ the matrices -----


@pytest.mark.parametrize("n_in", [1, 3, 4, 7, 14])
@pytest.mark.parametrize("n_out", [1, 2, 5, 8, 14, 37])
def test_matrices_equal_torch_interpolate(n_in, n_out):
  eye = torch.eye(n_in, dtype=torch.float64).reshape(n_in, 1, 1, n_in)
  aa = F.interpolate(eye, size=(1, n_out), mode="bicubic", antialias=True,
                     align_corners=False)[:, 0, 0].numpy().T
  np.testing.assert_allclose(interpolate.aa_bicubic_matrix(n_in, n_out), aa,
                             rtol=0, atol=1e-12)
  if n_in > 1:
    plain = F.interpolate(eye, size=(1, n_out), mode="bicubic",
                          align_corners=True)[:, 0, 0].numpy().T
    np.testing.assert_allclose(
        interpolate.bicubic_matrix(n_in, n_out, np.float64), plain, rtol=0,
        atol=1e-12)


def test_antialiased_bicubic_is_another_kernel():
  """Why a second matrix: timm's antialiased bicubic differs from the plain
  one even when upsampling (A = -0.5 vs -0.75, border renormalisation)."""
  plain = F.interpolate(torch.eye(4).reshape(4, 1, 1, 4), size=(1, 6),
                        mode="bicubic", align_corners=False)[:, 0, 0].numpy().T
  assert np.abs(plain - interpolate.aa_bicubic_matrix(4, 6)).max() > 1e-2


@pytest.mark.parametrize("new", [(6, 6), (3, 5), (9, 7)])
@pytest.mark.parametrize("prefix", [0, 1, 5])
def test_resample_posemb_timm_method_equals_resample_abs_pos_embed(new, prefix):
  pe = np.random.default_rng(0).standard_normal(
      (1, prefix + 16, 24)).astype(np.float32)
  ref = resample_abs_pos_embed(torch.from_numpy(pe), list(new),
                               num_prefix_tokens=prefix).numpy()
  ours = convert.resample_posemb(pe, new, num_prefix_tokens=prefix,
                                 method="timm")
  assert ours.dtype == np.float32
  assert_close_rel(ours, ref, 1e-6, "pos_embedding")
  with pytest.raises(ValueError, match="method='bilinear'.*torchvision"):
    convert.resample_posemb(pe, new, num_prefix_tokens=prefix,
                            method="bilinear")


# ------------------------------------------------- dynamic_img_size -----


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dynamic_img_size_equals_timm_at_three_sizes(family, record_property):
  m = random_timm(dynamic_img_size=True, **FAMILIES[family])
  model, variables = formats.from_timm(m.state_dict(), dynamic_img_size=True)
  assert model.dynamic_img_size
  worst = 0.0
  for h, w in SIZES:
    x = images(2, w, height=h, seed=h + w)
    rel = assert_close_rel(apply(model, variables, x), run_timm(m, x),
                           what=f"{family} logits at {h}x{w}")
    worst = max(worst, rel.rel, assert_close_rel(
        apply(model, variables, x, method=model.forward_features),
        run_timm(m, x, "forward_features"),
        what=f"{family} tokens {h}x{w}").rel)
  record_property("rel_err", worst)


def test_dynamic_img_size_with_scan_under_jit_compiles_once_per_shape():
  m = random_timm(dynamic_img_size=True, reg_tokens=4, no_embed_class=True)
  model, variables = formats.from_timm(m.state_dict(), dynamic_img_size=True,
                                       scan_layers=True)
  traces = []

  @jax.jit
  def f(v, x):
    traces.append(x.shape)
    return model.apply(v, x, train=False)

  for h, w in SIZES + [(48, 80), (96, 96)]:
    x = images(2, w, height=h)
    assert_close_rel(f(variables, x), run_timm(m, x), what=f"{h}x{w}")
  assert traces == [(2, h, w, 3) for h, w in SIZES]  # repeats: cached


def test_dynamic_img_size_trains_the_stored_embedding():
  """Gradients reach the stored (4x4) embedding through the resampling."""
  model, variables = random_ours(dynamic_img_size=True, image_size=SIZE,
                                 num_layers=1)
  x = jnp.asarray(images(2, 96, height=48))

  def loss(params):
    return jnp.sum(model.apply({"params": params}, x) ** 2)

  grads = jax.jit(jax.grad(loss))(variables["params"])
  g = grads["Transformer"]["posembed_input"]["pos_embedding"]
  assert g.shape == (1, 17, 192) and np.abs(np.asarray(g[0, 1:])).min() > 0


def test_dynamic_model_initialises_at_any_size_for_its_image_size():
  model = models.get_model("vit_ti_16", num_layers=1, image_size=(32, 48),
                           dynamic_img_size=True)
  variables = jax.eval_shape(model.init, jax.random.key(0),
                             jnp.zeros((1, 80, 64, 3)))
  pe = variables["params"]["Transformer"]["posembed_input"]["pos_embedding"]
  assert pe.shape == (1, 1 + 2 * 3, 192)  # the 2x3 grid of image_size
  out = jax.eval_shape(model.apply, variables, jnp.zeros((1, 16, 96, 3)))
  assert out.shape == (1, 1000)


def test_dynamic_model_needs_the_grid_of_a_non_square_embedding():
  model, variables = random_ours(dynamic_img_size=True)
  wide = convert.resize_posemb(variables, (32, 64))  # a 2x4 grid
  with pytest.raises(ValueError, match="not a square grid.*image_size"):
    apply(model, wide, images(1, 64))
  out = apply(model.clone(image_size=(32, 64)), wide, images(1, 64, height=48))
  assert out.shape == (1, 10)


def test_fixed_size_model_names_dynamic_img_size_in_its_error():
  model, variables = random_ours()
  with pytest.raises(ValueError, match="dynamic_img_size=True"):
    apply(model, variables, images(1, 96))


def test_dynamic_img_pad_equals_timm():
  m = random_timm(dynamic_img_size=True, dynamic_img_pad=True)
  model, variables = formats.from_timm(
      m.state_dict(), dynamic_img_size=True, dynamic_img_pad=True)
  for h, w in [(50, 70), (64, 64), (33, 90)]:
    x = images(2, w, height=h)
    assert_close_rel(apply(model, variables, x), run_timm(m, x),
                     what=f"{h}x{w} padded")
  with pytest.raises(ValueError, match="dynamic_img_pad=True"):
    apply(model.clone(dynamic_img_pad=False), variables, images(1, 60))


# ----------------------------------------------------- FlexiViT ---------


@pytest.mark.parametrize("old, new", [(16, 8), (16, 32), (14, 16), (16, 12),
                                      (4, 3)])
def test_resample_patch_embed_equals_timm(old, new, record_property):
  kernel = np.random.default_rng(old * new).standard_normal(
      (old, old, 3, 8)).astype(np.float32)
  ref = resample_patch_embed(torch.from_numpy(kernel.transpose(3, 2, 0, 1)),
                             [new, new]).numpy().transpose(2, 3, 1, 0)
  ours = convert.resample_patch_embed(kernel, new)
  assert ours.shape == (new, new, 3, 8) and ours.dtype == np.float32
  # timm's pseudo-inverse runs in float32, ours in float64.
  record_property("rel_err", assert_close_rel(
      ours, ref, 1e-5, f"kernel {old}->{new}").rel)


def test_resampled_kernel_sees_an_upsampled_patch_as_the_original():
  """FlexiViT's defining property: <x, w> = <resize(x), resample(w)> for a
  patch x upsampled (exact: resizing up has full column rank)."""
  rng = np.random.default_rng(0)
  kernel = rng.standard_normal((8, 8, 3, 5))
  patch = rng.standard_normal((8, 8, 3))
  up = interpolate.resize_2d(patch, interpolate.aa_bicubic_matrix(8, 20),
                             interpolate.aa_bicubic_matrix(8, 20))
  new = posemb.resample_patch_embed(kernel, 20)
  np.testing.assert_allclose(np.einsum("hwc,hwcd->d", up, new),
                             np.einsum("hwc,hwcd->d", patch, kernel),
                             rtol=1e-9)


@pytest.mark.parametrize("family", ["classic", "registers"])
@pytest.mark.parametrize("patch, size", [(8, None), (32, None), (12, 48)])
def test_load_at_another_patch_size_equals_timm_set_input_size(
    family, patch, size, record_property):
  m = random_timm(**FAMILIES[family])
  sd = {k: v.clone() for k, v in m.state_dict().items()}
  m.set_input_size(img_size=size, patch_size=patch)
  model, variables = formats.from_timm(sd, patch_size=patch, image_size=size,
                                       scan_layers=patch == 12)
  assert model.patch_size == patch
  x = images(2, size or SIZE)
  record_property("rel_err", assert_close_rel(
      apply(model, variables, x), run_timm(m, x),
      what=f"{family} at /{patch}").rel)


def test_weights_load_takes_patch_size_with_a_name(tmp_path):
  m = random_timm(depth=12)
  path = tmp_path / "vit_tiny_16.pth"
  torch.save(m.state_dict(), path)
  loaded = weights.load(str(path), model_name="vit_tiny_patch16_224",
                        patch_size=8)
  assert loaded.model.patch_size == 8 and loaded.image_size == SIZE
  assert "patch 8" in loaded.description
  ref = copy.deepcopy(m)
  ref.set_input_size(patch_size=8)
  x = images(1, SIZE)
  assert_close_rel(apply(loaded.model, loaded.variables, x), run_timm(ref, x))
  with pytest.raises(weights.CheckpointError, match="does not divide"):
    weights.load(str(path), patch_size=24)


def test_training_workdir_loads_at_another_patch_size(digits_run):
  """An Orbax run (4 px patches, 8 px images) at patch_size=2 equals timm's
  model of the same weights after set_input_size(patch_size=2)."""
  workdir, _ = digits_run
  plain = weights.load(workdir)
  loaded = weights.load(workdir, patch_size=2)
  assert (plain.model.patch_size, loaded.model.patch_size) == (4, 2)
  assert loaded.image_size == plain.image_size == 8
  m = timm.create_model("vit_tiny_patch16_224", pretrained=False,
                        num_classes=10, img_size=8, patch_size=4, depth=1,
                        embed_dim=32, num_heads=2, mlp_ratio=2.0)
  m.load_state_dict(formats.to_timm(plain.variables), strict=True)
  m.eval().set_input_size(patch_size=2)
  x = images(2, 8)
  assert_close_rel(apply(loaded.model, loaded.variables, x), run_timm(m, x))
