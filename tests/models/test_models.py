"""The Flax model on its own: variants, shapes, options, clear errors."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from vit_jax import convert, models

# torchvision's own counts at 224 with 1000 classes (torch is not needed).
TORCHVISION_PARAMS = {
    "vit_b_16": 86_567_656,
    "vit_b_32": 88_224_232,
    "vit_l_16": 304_326_632,
    "vit_l_32": 306_535_400,
    "vit_h_14": 632_045_800,
}
# Ti and S have no torchvision builder; torchvision's VisionTransformer class
# with these sizes has these counts (checked in test_convert.py with torch).
OTHER_PARAMS = {
    "vit_ti_16": 5_717_416,
    "vit_s_16": 22_050_664,
    "vit_s_32": 22_878_952,
}


def _shapes(model, size=224, **kw):
  x = jnp.zeros((1, size, size, 3))
  return jax.eval_shape(lambda: model.init(jax.random.key(0), x, **kw))


def test_registered_variants_cover_torchvision_and_ti_s():
  assert set(models.VARIANTS) == set(TORCHVISION_PARAMS) | set(OTHER_PARAMS)
  assert models.VARIANTS["vit_b_16"] == models.Variant(768, 12, 12, 3072, 16)
  assert models.VARIANTS["vit_h_14"] == models.Variant(1280, 32, 16, 5120, 14)
  assert models.decode_variant("B/16") == models.VARIANTS["vit_b_16"]
  assert models.decode_variant("vit_b_8").patch_size == 8


@pytest.mark.parametrize("name", sorted(models.VARIANTS))
def test_exact_parameter_count(name):
  want = {**TORCHVISION_PARAMS, **OTHER_PARAMS}[name]
  assert models.count_params(_shapes(models.get_model(name))) == want


def test_parameter_tree_is_vision_transformers():
  model = models.get_model("vit_ti_16", num_classes=10, representation_size=32)
  flat = {"/".join(k): v.shape for k, v in
          flatten_dict(_shapes(model)["params"]).items()}
  blk = "Transformer/encoderblock_0/"
  expected = {
      "cls": (1, 1, 192),
      "embedding/kernel": (16, 16, 3, 192),
      "embedding/bias": (192,),
      "Transformer/posembed_input/pos_embedding": (1, 197, 192),
      blk + "LayerNorm_0/scale": (192,),
      blk + "MultiHeadDotProductAttention_0/query/kernel": (192, 3, 64),
      blk + "MultiHeadDotProductAttention_0/key/bias": (3, 64),
      blk + "MultiHeadDotProductAttention_0/out/kernel": (3, 64, 192),
      blk + "LayerNorm_1/bias": (192,),
      blk + "MlpBlock_0/Dense_0/kernel": (192, 768),
      blk + "MlpBlock_0/Dense_1/kernel": (768, 192),
      "Transformer/encoder_norm/scale": (192,),
      "pre_logits/kernel": (192, 32),
      "head/kernel": (32, 10),
  }
  for k, shape in expected.items():
    assert flat.get(k) == shape, k
  assert "Transformer/encoderblock_11/LayerNorm_0/scale" in flat
  assert not any("encoderblock_12" in k for k in flat)


def _tiny(**kw):
  kw = {"num_classes": 5, "num_layers": 2, **kw}
  return models.get_model("vit_ti_16", **kw)


def _init(model, size=32, **kw):
  return jax.jit(functools.partial(model.init, **kw))(
      jax.random.key(0), jnp.zeros((1, size, size, 3)))


def test_forward_shapes_and_intermediates():
  model = _tiny(representation_size=16)
  variables = _init(model)
  x = jax.random.normal(jax.random.key(1), (3, 32, 32, 3))
  logits = model.apply(variables, x, train=False)
  assert logits.shape == (3, 5)
  out, state = model.apply(variables, x, mutable=["intermediates"])
  inter = {k: v[0].shape for k, v in state["intermediates"].items()}
  assert inter == {
      "stem": (3, 2, 2, 192), "block00": (3, 5, 192), "block01": (3, 5, 192),
      "encoded": (3, 5, 192), "pre_logits": (3, 16), "logits": (3, 5)}
  np.testing.assert_array_equal(out, logits)
  # timm-style split.
  feats = model.apply(variables, x, method=model.forward_features)
  head = model.apply(variables, feats, method=model.forward_head)
  np.testing.assert_allclose(head, logits, rtol=1e-6, atol=1e-6)


def test_gap_classifier_has_no_class_token():
  model = _tiny(classifier="gap")
  params = _init(model)["params"]
  assert "cls" not in params
  assert params["Transformer"]["posembed_input"]["pos_embedding"].shape[1] == 4
  assert model.apply(_init(model), jnp.ones((2, 32, 32, 3))).shape == (2, 5)


def test_dropout_and_drop_path_use_the_dropout_rng():
  model = _tiny(dropout_rate=0.1, drop_path_rate=0.2, attention_dropout_rate=0.1)
  variables = _init(model)
  # Give the head weights so the logits depend on the features: different
  # ones per entry (a constant added to every weight gave every logit the
  # same weight on each channel of a zero-mean LayerNorm output, so the
  # logits did not depend on the features; the check then passed or failed
  # by rounding, as on an AMD Zen 1).
  variables = jax.tree_util.tree_map(
      lambda a: a + 0.05 * jnp.cos(jnp.arange(a.size).reshape(a.shape)),
      variables)
  x = jax.random.normal(jax.random.key(1), (4, 32, 32, 3))
  ev = model.apply(variables, x)
  np.testing.assert_array_equal(ev, model.apply(variables, x, train=False))
  tr1 = model.apply(variables, x, train=True, rngs={"dropout": jax.random.key(1)})
  tr2 = model.apply(variables, x, train=True, rngs={"dropout": jax.random.key(2)})
  assert not np.allclose(tr1, tr2)
  with pytest.raises(Exception, match="dropout"):
    model.apply(variables, x, train=True)


def test_scan_and_remat_give_the_same_function():
  x = jax.random.normal(jax.random.key(3), (2, 32, 32, 3))
  plain = _tiny(num_layers=3)
  variables = jax.tree_util.tree_map(lambda a: a + 0.01, _init(plain))
  ref = plain.apply(variables, x)
  for kw in ({"scan_layers": True}, {"scan_layers": True, "remat_policy": "full"},
             {"remat_policy": "dots"}):
    model = _tiny(num_layers=3, **kw)
    v = convert.stack_layers(variables) if kw.get("scan_layers") else variables
    np.testing.assert_allclose(model.apply(v, x), ref, rtol=1e-5, atol=1e-5)
  back = convert.unstack_layers(convert.stack_layers(variables))
  jax.tree_util.tree_map(np.testing.assert_array_equal, back, variables)


def test_bfloat16_compute_float32_params():
  model = _tiny(dtype=jnp.bfloat16)
  variables = _init(model)
  assert all(a.dtype == jnp.float32 for a in jax.tree_util.tree_leaves(variables))
  assert model.apply(variables, jnp.ones((2, 32, 32, 3))).dtype == jnp.bfloat16


def test_any_divisible_resolution_after_resampling():
  model = _tiny()
  variables = _init(model, 32)
  x = jnp.ones((1, 48, 48, 3))
  with pytest.raises(ValueError, match=r"position embedding.*2x2.*3x3"):
    model.apply(variables, x)
  resized = convert.resize_posemb(variables, 48)
  assert model.apply(resized, x).shape == (1, 5)
  # Non-square works too once the grid matches.
  wide = convert.resize_posemb(variables, (32, 64))
  assert model.apply(wide, jnp.ones((1, 32, 64, 3))).shape == (1, 5)


@pytest.mark.parametrize("shape,match", [
    ((2, 3, 32, 32), r"NCHW.*transpose"),
    ((2, 30, 32, 3), r"30x32 is not divisible by the patch size 16"),
    ((2, 32, 32, 1), r"Expected 3 channels.*got shape \(2, 32, 32, 1\)"),
    ((32, 32, 3), r"Expected images of shape \(batch, height, width, 3\)"),
])
def test_bad_inputs_raise_clear_errors(shape, match):
  model = _tiny()
  variables = _init(model)
  with pytest.raises(ValueError, match=match):
    model.apply(variables, jnp.zeros(shape))


def test_fixed_image_size_and_bad_names():
  model = _tiny(image_size=32)
  variables = _init(model)
  with pytest.raises(ValueError, match="built for 32x32 images, got 64x64"):
    model.apply(variables, jnp.zeros((1, 64, 64, 3)))
  with pytest.raises(ValueError, match="Unknown ViT variant 'vit_x_16'"):
    models.get_model("vit_x_16")
  with pytest.raises(TypeError, match="unknown option"):
    models.get_model("vit_b_16", num_clases=10)
  with pytest.raises(ValueError, match="not divisible by num_heads"):
    _init(_tiny(num_heads=5))


def test_import_models_and_convert_without_torch():
  """`import vit_jax.models` (and convert) must not import torch."""
  code = (
      "import sys\n"
      "class Block:\n"
      "  def find_spec(self, name, *a, **k):\n"
      "    if name.split('.')[0] in ('torch', 'torchvision', 'tensorflow'):\n"
      "      raise ImportError('blocked ' + name)\n"
      "sys.meta_path.insert(0, Block())\n"
      "import vit_jax.models, vit_jax.convert\n"
      "m = vit_jax.models.get_model('vit_ti_16', num_classes=3, num_layers=1)\n"
      "import jax, jax.numpy as jnp\n"
      "v = m.init(jax.random.key(0), jnp.zeros((1, 32, 32, 3)))\n"
      "sd = vit_jax.convert.params_to_torchvision(v)\n"
      "assert 'torch' not in sys.modules\n"
      "print('ok', len(sd))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                       timeout=300)
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith("ok")
