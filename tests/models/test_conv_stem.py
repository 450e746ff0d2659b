"""torchvision's convolutional stem (``conv_stem_configs``: 3x3 conv + BN +
ReLU layers, then a 1x1 projection; Xiao et al., "Early convolutions help
transformers see better") against torchvision itself, on random weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torchvision
from torchvision.models.vision_transformer import ConvStemConfig as TvStem

from vit_jax import convert, models
from compare import apply, assert_close_rel

SIZE = 64
REL = 1e-4
# The paper's stem for /16: four stride-2 3x3 convs (channels scaled to Ti).
PAPER = [(24, 3, 2), (48, 3, 2), (96, 3, 2), (192, 3, 2)]


def tv_stem_vit(stem, *, name="vit_ti_16", num_layers=2, seed=0):
  """A torchvision ViT with a conv stem and random weights, BN statistics
  and head (torchvision zero-initialises the head and BN stats are 0/1)."""
  v = models.decode_variant(name)
  torch.manual_seed(seed)
  m = torchvision.models.VisionTransformer(
      image_size=SIZE, patch_size=v.patch_size, num_layers=num_layers,
      num_heads=v.num_heads, hidden_dim=v.hidden_size, mlp_dim=v.mlp_dim,
      num_classes=10, conv_stem_configs=[TvStem(*c) for c in stem])
  with torch.no_grad():
    for mod in m.modules():
      if isinstance(mod, torch.nn.BatchNorm2d):
        mod.running_mean.normal_(std=0.5)
        mod.running_var.uniform_(0.5, 2.0)
        mod.weight.normal_(1.0, 0.2)
        mod.bias.normal_(std=0.2)
    m.heads.head.weight.normal_(std=0.5)
    m.heads.head.bias.normal_(std=0.5)
  return m.eval()


def images(n=2, seed=0):
  return np.random.default_rng(seed).standard_normal(
      (n, 3, SIZE, SIZE)).astype(np.float32)


def nhwc(x):
  return np.ascontiguousarray(x.transpose(0, 2, 3, 1))


def ours_of(m, stem=None, num_layers=2, **kw):
  overrides = dict(num_layers=num_layers, **kw)
  if stem is not None:
    overrides["conv_stem"] = [models.ConvStemConfig(*c) for c in stem]
  return convert.from_torchvision(m.state_dict(), "vit_ti_16", **overrides)


@pytest.mark.parametrize("stem", [
    PAPER,
    PAPER + [(192, 3, 1)],  # an extra stride-1 layer at the end
])
def test_eval_logits_match_torchvision(stem, record_property):
  m = tv_stem_vit(stem)
  model, variables = ours_of(m)  # strides inferred: 2 until /16, then 1
  assert model.conv_stem == tuple(models.ConvStemConfig(*c) for c in stem)
  x = images()
  with torch.no_grad():
    ref = m(torch.from_numpy(x)).numpy()
  out = apply(model, variables, nhwc(x))
  record_property("rel_err", assert_close_rel(out, ref))
  # Same number of parameters as torchvision (BN running stats excluded).
  tv_params = sum(p.numel() for p in m.parameters())
  assert models.count_params(variables) == tv_params


def test_full_depth_vit_ti_16_with_stem_matches():
  m = tv_stem_vit(PAPER, num_layers=12)
  model, variables = ours_of(m, num_layers=12)
  x = images()
  with torch.no_grad():
    ref = m(torch.from_numpy(x)).numpy()
  assert_close_rel(apply(model, variables, nhwc(x)), ref)


@pytest.mark.parametrize("stem", [
    [(24, 3, 1), (48, 3, 2), (96, 3, 2), (192, 3, 2), (192, 3, 2)],
    [(32, 4, 4), (64, 4, 4)],  # even kernels: torchvision pads (k-1)//2
    [(32, 5, 2), (64, 3, 2), (64, 1, 4)],
])
def test_strides_that_cannot_be_inferred_are_taken_from_conv_stem(stem):
  m = tv_stem_vit(stem)
  model, variables = ours_of(m, stem=stem)
  assert [c.stride for c in model.conv_stem] == [s for _, _, s in stem]
  x = images()
  with torch.no_grad():
    ref = m(torch.from_numpy(x)).numpy()
  assert_close_rel(apply(model, variables, nhwc(x)), ref)
  # And back: torchvision built with the same strides, strict=True.
  tv = convert.to_torchvision_model(
      variables, "vit_ti_16", num_layers=2,
      conv_stem=[models.ConvStemConfig(*c) for c in stem])
  assert [layer[0].stride[0] for layer in list(tv.conv_proj)[:-1]] == [
      s for _, _, s in stem]
  with torch.no_grad():
    np.testing.assert_allclose(tv(torch.from_numpy(x)).numpy(), ref,
                               rtol=0, atol=1e-5 * np.abs(ref).max())


def test_converted_variables_do_not_alias_the_torch_tensors():
  """Training the torch model on (BN statistics update in place) must not
  change variables converted before."""
  m = tv_stem_vit(PAPER)
  _, variables = ours_of(m)
  before = jax.tree_util.tree_map(np.array, variables)
  m.train()
  with torch.no_grad():
    m(torch.from_numpy(images()))
    for p in m.parameters():
      p.add_(1.0)
  jax.tree_util.tree_map(np.testing.assert_array_equal, variables, before)


def test_conv_stem_that_does_not_match_the_weights_is_an_error():
  m = tv_stem_vit(PAPER)
  wrong = [(24, 3, 2), (48, 3, 2), (96, 5, 2), (192, 3, 2)]
  with pytest.raises(ValueError, match=r"conv_stem.*\(96, 5\).*\(96, 3\)"):
    ours_of(m, stem=wrong)


def test_train_mode_batchnorm_matches_torch():
  """Train mode: BN normalises with the batch statistics in both; the
  running mean updates identically (flax momentum 0.9 = torch 0.1). The
  running variance differs by design: torch averages the *unbiased* batch
  variance, flax the biased one (factor n/(n-1), n = batch*H*W)."""
  m = tv_stem_vit(PAPER)
  model, variables = ours_of(m)
  x = images(4)
  old = {k: v.clone() for k, v in m.state_dict().items() if "running" in k}
  m.train()
  with torch.no_grad():
    ref = m(torch.from_numpy(x)).numpy()
  out, upd = model.apply(variables, nhwc(x), train=True,
                         mutable=["batch_stats"],
                         rngs={"dropout": jax.random.key(0)})
  assert_close_rel(out, ref)
  new = m.state_dict()
  for i, (_, _, s) in enumerate(PAPER):
    pre = f"conv_proj.conv_bn_relu_{i}.1."
    st = upd["batch_stats"][f"stem_bns_{i}"]
    np.testing.assert_allclose(st["mean"], new[pre + "running_mean"].numpy(),
                               atol=1e-5)
    side = SIZE
    for _, _, stride in PAPER[:i + 1]:
      side //= stride
    n = x.shape[0] * side * side
    unbiased = (new[pre + "running_var"] - 0.9 * old[pre + "running_var"]) / 0.1
    flax_rule = 0.9 * old[pre + "running_var"] + 0.1 * unbiased * (n - 1) / n
    np.testing.assert_allclose(st["var"], flax_rule.numpy(), rtol=1e-4)


def test_stem_model_is_a_get_model_option():
  stem = [models.ConvStemConfig(*c) for c in PAPER]
  model = models.get_model("vit_ti_16", num_layers=2, num_classes=10,
                           conv_stem=stem)
  variables = model.init(jax.random.key(0), jnp.zeros((1, SIZE, SIZE, 3)))
  assert set(variables) == {"params", "batch_stats"}
  assert "stem_convs_3" in variables["params"]
  assert variables["params"]["embedding"]["kernel"].shape == (1, 1, 192, 192)
  m = tv_stem_vit(PAPER)
  assert models.count_params(variables) == sum(p.numel() for p in m.parameters())
  with pytest.raises(ValueError, match="multiply to 8, but patch_size is 16"):
    models.get_model("vit_ti_16", conv_stem=stem[:3]).init(
        jax.random.key(0), jnp.zeros((1, SIZE, SIZE, 3)))
