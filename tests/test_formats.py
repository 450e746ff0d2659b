"""timm state dicts, Google .npz (vision_transformer and big_vision) and
safetensors: parity with timm's own model and loader on random weights."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import _load_weights as timm_load_npz  # noqa: E402

from vit_jax import convert, formats, formats_arch, formats_io, models  # noqa: E402

SIZE = 64  # 4x4 patch grid for /16: small, and the grid is not trivial
DEPTH = 3  # blocks of the small models (the headline test uses all 12)
REL = 1e-4


def assert_close_rel(ours, ref, rel=REL, what="logits"):
  ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
  assert ours.shape == ref.shape, (ours.shape, ref.shape)
  scale, err = np.abs(ref).max(), np.abs(ours - ref).max()
  assert scale > 0, f"{what}: reference is all zeros"
  assert err <= rel * scale, f"{what}: max|diff| {err:.3g} > {rel} x {scale:.3g}"
  return err / scale


def images(n=2, size=SIZE, seed=0):
  """NHWC float32 normalised-looking images."""
  return np.random.default_rng(seed).standard_normal(
      (n, size, size, 3)).astype(np.float32)


def torch_in(x):
  return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


def random_timm(seed=0, num_classes=10, depth=DEPTH, **kw):
  """timm's vit_tiny_patch16_224 (``depth`` blocks) with random weights."""
  torch.manual_seed(seed)
  m = timm.create_model("vit_tiny_patch16_224", pretrained=False,
                        num_classes=num_classes, img_size=SIZE, depth=depth,
                        **kw).eval()
  with torch.no_grad():  # timm zero-initialises the head
    if num_classes:
      m.head.weight.normal_(std=0.5)
      m.head.bias.normal_(std=0.5)
    if getattr(m, "cls_token", None) is not None:
      m.cls_token.normal_(std=0.5)
  return m


def timm_logits(m, x):
  with torch.no_grad():
    return m(torch_in(x)).numpy()


def random_ours(name="vit_ti_16", seed=0, **overrides):
  """Our model with every parameter random (no zero head / class token)."""
  model = models.get_model(name, **{"num_classes": 10, "num_layers": DEPTH,
                                    **overrides})
  variables = model.init(jax.random.key(seed), jnp.zeros((1, SIZE, SIZE, 3)))
  leaves, tdef = jax.tree_util.tree_flatten(variables)
  rng = np.random.default_rng(seed)
  leaves = [np.asarray(l, np.float32) +
            0.05 * rng.standard_normal(np.shape(l)).astype(np.float32)
            for l in leaves]
  return model, jax.tree_util.tree_unflatten(tdef, leaves)


def apply(model, variables, x):
  # Eager: for one call of a small model, cheaper than an XLA compile.
  return np.asarray(model.apply(variables, jnp.asarray(x), train=False))


def tree_equal(a, b):
  fa, fb = formats_arch.flatten(dict(a)), formats_arch.flatten(dict(b))
  assert sorted(fa) == sorted(fb)
  for k in fa:
    assert np.asarray(fa[k]).dtype == np.asarray(fb[k]).dtype, k
    np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]), err_msg=k)


# ------------------------------------------------------------------- timm ---


@pytest.mark.parametrize("scan", [False, True])
def test_timm_state_dict_logits_match_timm(scan, record_property):
  m = random_timm(depth=12)  # the full vit_tiny_patch16_224
  x = images()
  model, variables = formats.from_timm(m.state_dict(), scan_layers=scan)
  assert model.num_heads == 3 and model.num_classes == 10
  rel = assert_close_rel(apply(model, variables, x), timm_logits(m, x))
  record_property("rel_err", rel)


def test_timm_name_gives_heads_and_is_checked():
  sd = random_timm(depth=12).state_dict()
  model, _ = formats.from_timm(sd, "vit_tiny_patch16_224.augreg_in21k")
  assert model.num_heads == 3
  with pytest.raises(ValueError, match=r"not a vit_b_16.*hidden_size 192 "
                     r"\(expected 768\).*vit_ti_16"):
    formats.from_timm(sd, "vit_b_16")


def test_ours_to_timm_loads_strict_and_matches():
  model, variables = random_ours()
  m = random_timm(seed=1)
  m.load_state_dict(formats.to_timm(variables), strict=True)
  x = images()
  assert_close_rel(apply(model, variables, x), timm_logits(m, x))


def test_gap_tree_to_timm_avg_pool_without_fc_norm():
  model, variables = random_ours(classifier="gap")
  m = random_timm(class_token=False, global_pool="avg", fc_norm=False)
  m.load_state_dict(formats.to_timm(variables), strict=True)
  x = images()
  assert_close_rel(apply(model, variables, x), timm_logits(m, x))
  back_model, back = formats.from_timm(m.state_dict())
  assert back_model.classifier == "gap"
  assert_close_rel(apply(back_model, back, x), timm_logits(m, x))


def test_timm_no_embed_class_gets_zero_class_row():
  m = random_timm(no_embed_class=True)  # DeiT-3 style
  assert m.pos_embed.shape[1] == (SIZE // 16) ** 2
  x = images()
  model, variables = formats.from_timm(m.state_dict())
  pe = variables["params"]["Transformer"]["posembed_input"]["pos_embedding"]
  assert pe.shape[1] == (SIZE // 16) ** 2 + 1 and not pe[0, 0].any()
  assert_close_rel(apply(model, variables, x), timm_logits(m, x))


@pytest.mark.parametrize("kw, what", [
    (dict(class_token=False, global_pool="avg"), "fc_norm"),
    (dict(init_values=1e-5), "LayerScale"),
    (dict(qk_norm=True), "qk_norm"),
    (dict(reg_tokens=4), "register tokens"),
])
def test_timm_features_we_lack_are_named(kw, what):
  sd = random_timm(**kw).state_dict()
  with pytest.raises(ValueError, match=what):
    formats.from_timm(sd)


def test_timm_model_of_another_architecture_is_named_as_such():
  sd = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False,
                         depths=(1, 1, 1, 1)).state_dict()
  with pytest.raises(ValueError, match=r"Not a timm VisionTransformer.*"
                     r"layers\.0\.blocks\.0.*another architecture"):
    formats.from_timm(sd)


def test_timm_missing_and_misshaped_keys_are_listed():
  sd = random_timm().state_dict()
  del sd["blocks.1.mlp.fc2.bias"]
  sd["blocks.2.norm1.weight"] = torch.zeros(7)
  with pytest.raises(ValueError) as e:
    formats.from_timm(sd)
  msg = str(e.value)
  assert "missing keys (1)" in msg and "blocks.1.mlp.fc2.bias" in msg
  assert "blocks.2.norm1.weight: expected (192,), got (7,)" in msg


# ------------------------------------------------------------ Google .npz ---


def test_npz_in_vision_transformer_layout_loads_into_timm(tmp_path, record_property):
  model, variables = random_ours()
  path = str(tmp_path / "vit.npz")
  formats.save_npz(variables, path)
  with np.load(path, allow_pickle=False) as f:
    keys = set(f.files)
  blk = "Transformer/encoderblock_0/"
  assert {blk + "MultiHeadDotProductAttention_1/query/kernel",
          blk + "LayerNorm_2/scale", blk + "MlpBlock_3/Dense_1/bias",
          "Transformer/posembed_input/pos_embedding", "cls"} <= keys
  m = random_timm(seed=3)
  timm_load_npz(m, path)  # timm's own loader for Google checkpoints
  x = images()
  ours = apply(model, variables, x)
  rel = assert_close_rel(ours, timm_logits(m, x))
  record_property("rel_err", rel)
  # And back into our tree: the same arrays.
  model2, back = formats.load_npz(path)
  tree_equal(variables, back)
  np.testing.assert_array_equal(apply(model2, back, x), ours)


def test_npz_with_pre_logits_round_trips(tmp_path):
  model, variables = random_ours(representation_size=48)
  path = str(tmp_path / "i21k.npz")
  formats.save_npz(variables, path)
  model2, back = formats.load_npz(path)
  assert model2.representation_size == 48
  tree_equal(variables, back)


@pytest.mark.parametrize("scan", [False, True])
def test_big_vision_token_layout_loads_into_timm_and_back(tmp_path, scan):
  model, variables = random_ours()
  path = str(tmp_path / "bv.npz")
  formats.save_npz(variables, path, layout="big_vision", scan=scan)
  with np.load(path, allow_pickle=False) as f:
    assert f["pos_embedding"].shape == (1, (SIZE // 16) ** 2, 192)
    assert "Transformer/posembed_input/pos_embedding" not in f.files
    block = ("Transformer/encoderblock/" if scan else
             "Transformer/encoderblock_0/") + "MultiHeadDotProductAttention_0/out/bias"
    assert block in f.files
  x = images()
  ours = apply(model, variables, x)
  # big_vision adds the embedding before concatenating the class token:
  # timm's no_embed_class model is that computation.
  m = random_timm(seed=4, no_embed_class=True)
  timm_load_npz(m, path)
  assert_close_rel(ours, timm_logits(m, x))
  model2, back = formats.load_npz(path)
  assert_close_rel(apply(model2, back, x), ours)


def test_big_vision_gap_head(tmp_path):
  model, variables = random_ours(classifier="gap")
  path = str(tmp_path / "gap.npz")
  formats.save_npz(variables, path, layout="big_vision")
  x = images()
  ours = apply(model, variables, x)
  m = random_timm(seed=5, class_token=False, global_pool="avg", fc_norm=False)
  timm_load_npz(m, path)
  assert_close_rel(ours, timm_logits(m, x))
  model2, back = formats.load_npz(path)
  assert model2.classifier == "gap"
  tree_equal(variables, back)


@pytest.mark.parametrize("prefix", ["params/", "opt/target/", "params/img/"])
def test_npz_prefixes_and_bfloat16(tmp_path, prefix):
  import ml_dtypes  # pylint: disable=import-outside-toplevel

  model, variables = random_ours()
  arrays = formats.params_to_npz(variables, layout="big_vision")
  # bfloat16 arrays come out of np.savez as 2-byte void (as in big_vision).
  arrays = {prefix + k: v.astype(ml_dtypes.bfloat16) for k, v in arrays.items()}
  arrays["params/txt/unrelated" if prefix == "params/img/" else "step"] = np.zeros(3)
  path = str(tmp_path / "p.npz")
  np.savez(path, **arrays)
  model2, back = formats.load_npz(path)
  x = images()
  # Same function up to the bfloat16 rounding of the weights.
  assert_close_rel(apply(model2, back, x), apply(model, variables, x), rel=0.05)


def test_big_vision_sincos2d_posemb_is_computed():
  _, variables = random_ours(classifier="gap")
  arrays = formats.params_to_npz(variables, layout="big_vision")
  del arrays["pos_embedding"]
  with pytest.raises(ValueError, match="sincos2d.*image_size"):
    formats.npz_to_params(arrays)
  back, arch = formats.npz_to_params(arrays, image_size=SIZE)
  pe = back["params"]["Transformer"]["posembed_input"]["pos_embedding"]
  # big_vision's posemb_sincos_2d, written independently with jax.numpy.
  y, x = jnp.mgrid[:4, :4]
  omega = 1.0 / (10_000.0 ** (jnp.arange(48) / 47))
  y = jnp.einsum("m,d->md", y.flatten(), omega)
  x = jnp.einsum("m,d->md", x.flatten(), omega)
  want = jnp.concatenate([jnp.sin(x), jnp.cos(x), jnp.sin(y), jnp.cos(y)], 1)
  np.testing.assert_allclose(pe[0], want, atol=1e-6)
  assert arch["image_size"] == SIZE


def test_convert_pre_linen_matches_flax():
  from flax.training.checkpoints import convert_pre_linen  # pylint: disable=import-outside-toplevel

  tree = {"Transformer": {f"encoderblock_{i}": {
      "LayerNorm_0": {"scale": 0}, "MultiHeadDotProductAttention_1": {"out": 1},
      "LayerNorm_2": {"scale": 2}, "MlpBlock_3": {"Dense_0": 3, "Dense_1": 4}}
                          for i in range(12)}, "head": 5, "pre_logits": 6}
  assert formats.convert_pre_linen(tree) == dict(convert_pre_linen(tree))


def test_npz_errors_are_clear(tmp_path):
  path = str(tmp_path / "other.npz")
  np.savez(path, **{"conv1/kernel": np.zeros(3)})
  with pytest.raises(ValueError, match="Not a Google ViT checkpoint"):
    formats.load_npz(path)
  np.savez(path, a=np.array([{"x": 1}], dtype=object))
  with pytest.raises(ValueError, match="without pickle"):
    formats.load_npz(path)
  with pytest.raises(FileNotFoundError, match="nope.npz"):
    formats.load_npz(str(tmp_path / "nope.npz"))
  _, variables = random_ours()
  arrays = formats.params_to_npz(variables, layout="big_vision")
  arrays["MAPHead_0/probe"] = np.zeros((1, 1, 192), np.float32)
  with pytest.raises(ValueError, match="'map' head"):
    formats.npz_to_params(arrays)
  np.savez(path, **formats.params_to_npz(variables))
  with pytest.raises(ValueError, match="not a vit_s_16"):
    formats.load_npz(path, "vit_s_16")


# ------------------------------------------------------------- safetensors ---


def test_safetensors_round_trip_is_exact_with_conv_stem_and_scan(tmp_path):
  stem = [models.ConvStemConfig(24, 3, 2), models.ConvStemConfig(48, 3, 2),
          models.ConvStemConfig(96, 3, 2), models.ConvStemConfig(96, 3, 2)]
  model, variables = random_ours(conv_stem=stem, representation_size=32)
  assert "batch_stats" in variables
  # The scanned layout of the same weights (stacked blocks).
  model = model.clone(scan_layers=True)
  variables = convert.stack_layers(variables)
  assert "encoderblock" in variables["params"]["Transformer"]
  path = str(tmp_path / "m.safetensors")
  formats_io.save_safetensors(variables, path, model=model, metadata={
      "label_names": ["a", "b"], "preprocessing": {"mean": [0.5] * 3}})
  model2, back, meta = formats_io.load_safetensors(path, scan_layers=True)
  assert model2.conv_stem == tuple(stem) and model2.representation_size == 32
  assert meta["label_names"] == ["a", "b"] and meta["format"] == "vit_jax"
  tree_equal(variables, back)  # bit for bit: the same function


def test_safetensors_keeps_bfloat16(tmp_path):
  model, variables = random_ours()
  bf = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.bfloat16), variables)
  path = str(tmp_path / "bf.safetensors")
  formats_io.save_safetensors(bf, path)
  _, back, _ = formats_io.load_safetensors(path)
  tree_equal(jax.tree_util.tree_map(np.asarray, bf), back)


@pytest.mark.parametrize("layout", ["timm", "torchvision"])
def test_safetensors_in_timm_and_torchvision_layouts(tmp_path, layout):
  from safetensors.torch import load_file  # pylint: disable=import-outside-toplevel
  import torchvision  # pylint: disable=import-outside-toplevel

  # torchvision's names map onto the registered (12-layer) variants only.
  model, variables = random_ours(num_layers=12)
  path = str(tmp_path / f"{layout}.safetensors")
  formats_io.save_safetensors(variables, path, layout=layout)
  if layout == "timm":
    ref = random_timm(seed=6, depth=12)
  else:
    ref = torchvision.models.VisionTransformer(
        image_size=SIZE, patch_size=16, num_layers=12, num_heads=3,
        hidden_dim=192, mlp_dim=768, num_classes=10).eval()
  ref.load_state_dict(load_file(path), strict=True)
  x = images()
  ours = apply(model, variables, x)
  assert_close_rel(ours, timm_logits(ref, x))
  model2, back, meta = formats_io.load_safetensors(path)
  assert meta["layout"] == layout
  np.testing.assert_array_equal(apply(model2, back, x), ours)


def test_state_dict_of_another_network_is_refused():
  import torchvision  # pylint: disable=import-outside-toplevel

  sd = torchvision.models.resnet18(num_classes=10).state_dict()
  with pytest.raises(ValueError, match="another architecture"):
    formats_io.from_state_dict(sd)
  tv = torchvision.models.VisionTransformer(
      image_size=SIZE, patch_size=16, num_layers=12, num_heads=3,
      hidden_dim=192, mlp_dim=768, num_classes=10).state_dict()
  model, _ = formats_io.from_state_dict(tv)  # size read from the shapes
  assert (model.hidden_size, model.num_heads, model.num_classes) == (192, 3, 10)
  with pytest.raises(ValueError, match="not a vit_b_16"):
    formats_io.from_state_dict(tv, "vit_b_16")
