"""Google .npz checkpoints (vision_transformer and big_vision layouts):
timm's own loader reads what we write, and we read both layouts back."""

import jax.numpy as jnp
import numpy as np
import pytest

from compare import (apply, assert_close_rel, images, random_ours, random_timm,
                     timm_logits, tree_equal)

timm = pytest.importorskip("timm")
from timm.models.vision_transformer import _load_weights as timm_load_npz  # noqa: E402

from vit_jax import formats  # noqa: E402

SIZE = 64




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
  record_property("rel_err", rel.rel)
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
  # A MAP head (supported, see test_big_vision_map_head) with parts missing:
  # every missing key is named.
  arrays["MAPHead_0/probe"] = np.zeros((1, 1, 192), np.float32)
  np.savez(path, **arrays)
  with pytest.raises(ValueError, match=r"(?s)missing keys.*MAPHead_0/LayerNorm_0"):
    formats.load_npz(path)
  np.savez(path, **formats.params_to_npz(variables))
  with pytest.raises(ValueError, match="not a vit_s_16"):
    formats.load_npz(path, "vit_s_16")


def test_big_vision_map_head(tmp_path):
  """big_vision's MAPHead_0 (SigLIP's image tower) is our classifier='map':
  the tree is big_vision's, and timm's attn_pool computes the same."""
  model, variables = random_ours(classifier="map")
  assert "MAPHead_0" in variables["params"] and "cls" not in variables["params"]
  path = str(tmp_path / "map.npz")
  formats.save_npz(variables, path, layout="big_vision")
  model2, back = formats.load_npz(path)
  assert model2.classifier == "map"
  tree_equal(variables, back)
  x = images()
  m = random_timm(seed=7, class_token=False, global_pool="map")
  m.load_state_dict(formats.to_timm(variables), strict=True)
  assert_close_rel(apply(model2, back, x), timm_logits(m, x))

