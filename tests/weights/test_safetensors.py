"""safetensors in every layout (ours bit for bit, timm's, torchvision's) and
state dicts whose layout is read from their keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compare import (apply, assert_close_rel, images, random_ours, random_timm,
                     timm_logits, tree_equal)

timm = pytest.importorskip("timm")

from vit_jax import convert, formats, models  # noqa: E402

SIZE = 64




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
  formats.save_safetensors(variables, path, model=model, metadata={
      "label_names": ["a", "b"], "preprocessing": {"mean": [0.5] * 3}})
  model2, back, meta = formats.load_safetensors(path, scan_layers=True)
  assert model2.conv_stem == tuple(stem) and model2.representation_size == 32
  assert meta["label_names"] == ["a", "b"] and meta["format"] == "vit_jax"
  tree_equal(variables, back)  # bit for bit: the same function


def test_safetensors_keeps_bfloat16(tmp_path):
  model, variables = random_ours()
  bf = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.bfloat16), variables)
  path = str(tmp_path / "bf.safetensors")
  formats.save_safetensors(bf, path)
  _, back, _ = formats.load_safetensors(path)
  tree_equal(jax.tree_util.tree_map(np.asarray, bf), back)


@pytest.mark.parametrize("layout", ["timm", "torchvision"])
def test_safetensors_in_timm_and_torchvision_layouts(tmp_path, layout):
  from safetensors.torch import load_file  # pylint: disable=import-outside-toplevel
  import torchvision  # pylint: disable=import-outside-toplevel

  # torchvision's names map onto the registered (12-layer) variants only.
  model, variables = random_ours(num_layers=12)
  path = str(tmp_path / f"{layout}.safetensors")
  formats.save_safetensors(variables, path, layout=layout)
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
  model2, back, meta = formats.load_safetensors(path)
  assert meta["layout"] == layout
  np.testing.assert_array_equal(apply(model2, back, x), ours)


def test_state_dict_of_another_network_is_refused():
  import torchvision  # pylint: disable=import-outside-toplevel

  sd = torchvision.models.resnet18(num_classes=10).state_dict()
  with pytest.raises(ValueError, match="another architecture"):
    formats.from_state_dict(sd)
  tv = torchvision.models.VisionTransformer(
      image_size=SIZE, patch_size=16, num_layers=12, num_heads=3,
      hidden_dim=192, mlp_dim=768, num_classes=10).state_dict()
  model, _ = formats.from_state_dict(tv)  # size read from the shapes
  assert (model.hidden_size, model.num_heads, model.num_classes) == (192, 3, 10)
  with pytest.raises(ValueError, match="not a vit_b_16"):
    formats.from_state_dict(tv, "vit_b_16")
