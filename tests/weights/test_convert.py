"""The converter: both directions, legacy names, clear errors, safe loading."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torchvision

from vit_jax import convert, models
from tv_utils import assert_close_rel, images, nhwc, torchvision_vit


def _small_tv(num_classes=6, **kw):
  # A real torchvision ViT with few layers keeps these tests fast.
  torch.manual_seed(0)
  m = torchvision.models.VisionTransformer(
      image_size=64, patch_size=16, num_layers=2, num_heads=3, hidden_dim=192,
      mlp_dim=768, num_classes=num_classes, **kw)
  with torch.no_grad():
    torch.nn.init.normal_(m.heads.head.weight)
  return m.eval()


# The small model above is ViT-Ti/16 with 2 layers; architecture overrides
# tell the converter about such custom sizes.
NAME = "vit_ti_16"
ARCH = {"num_layers": 2}


@pytest.mark.parametrize("name", ["vit_ti_16", "vit_s_16", "vit_s_32"])
def test_ti_s_counts_equal_torchvision_class(name):
  v = models.decode_variant(name)
  with torch.device("meta"):
    tv = torchvision.models.VisionTransformer(
        224, v.patch_size, v.num_layers, v.num_heads, v.hidden_size, v.mlp_dim)
  ours = models.get_model(name)
  shapes = jax.eval_shape(
      lambda: ours.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3))))
  assert models.count_params(shapes) == sum(p.numel() for p in tv.parameters())


def test_round_trip_is_exact_and_loads_strict():
  tv = _small_tv()
  sd = tv.state_dict()
  model, variables = convert.from_torchvision(sd, NAME, **ARCH)
  back = convert.to_torchvision(variables)
  assert list(back) == list(sd)  # same keys, same order
  for k in sd:
    assert back[k].dtype == sd[k].dtype
    assert torch.equal(back[k], sd[k]), k
  fresh = _small_tv()
  fresh.load_state_dict(back, strict=True)

  # Flax -> torch -> Flax is exact too, from our own random init.
  ours = models.get_model(NAME, num_classes=6, **ARCH).init(
      jax.random.key(1), jnp.zeros((1, 64, 64, 3)))
  _, again = convert.from_torchvision(convert.to_torchvision(ours), NAME, **ARCH)
  jax.tree_util.tree_map(np.testing.assert_array_equal, again,
                         jax.tree_util.tree_map(np.asarray, ours))


def test_to_torchvision_model_gives_same_logits():
  tv = _small_tv(num_classes=4, representation_size=32)
  model, variables = convert.from_torchvision(tv.state_dict(), NAME, **ARCH)
  x = images(2, 64)
  rebuilt = convert.to_torchvision_model(variables, NAME, **ARCH)
  with torch.inference_mode():
    ref = rebuilt(torch.from_numpy(x)).numpy()
  assert_close_rel(model.apply(variables, nhwc(x)), ref)


def test_scanned_tree_converts_both_ways():
  tv = _small_tv()
  model, variables = convert.from_torchvision(tv.state_dict(), NAME,
                                              scan_layers=True, **ARCH)
  assert "encoderblock" in variables["params"]["Transformer"]
  back = convert.to_torchvision(variables)
  for k, t in tv.state_dict().items():
    assert torch.equal(back[k], t), k
  x = images(2, 64, seed=1)
  with torch.inference_mode():
    ref = tv(torch.from_numpy(x)).numpy()
  assert_close_rel(model.apply(variables, nhwc(x)), ref)


@pytest.mark.parametrize("scan", [False, True])
def test_converted_weights_are_their_own_memory(scan):
  """The state dict's tensors are read in place, not copied first: what
  comes out shares no memory with them (a torch model trained on after the
  conversion leaves ours as they were), and they are left unchanged."""
  tv = _small_tv()
  sd = tv.state_dict()
  before = {k: v.clone() for k, v in sd.items()}
  _, variables = convert.from_torchvision(sd, NAME, scan_layers=scan, **ARCH)
  assert all(torch.equal(sd[k], v) for k, v in before.items())
  leaves = jax.tree_util.tree_leaves(variables)
  kept = [np.array(x) for x in leaves]
  tensors = [v.numpy() for v in sd.values()]
  for x in leaves:
    assert isinstance(x, np.ndarray) and x.flags.writeable
    assert not any(np.shares_memory(x, t) for t in tensors)
  with torch.no_grad():
    for v in tv.parameters():
      v.add_(1.0)
  assert all(np.array_equal(x, k) for x, k in zip(leaves, kept))


def test_numpy_inputs_legacy_mlp_names_and_ddp_prefix():
  tv = _small_tv()
  ref = {k: v.numpy() for k, v in tv.state_dict().items()}
  legacy = collections.OrderedDict()
  for k, v in ref.items():
    k = k.replace("mlp.0.", "mlp.linear_1.").replace("mlp.3.", "mlp.linear_2.")
    legacy["module." + k] = v
  _, a = convert.from_torchvision(ref, NAME, **ARCH)
  _, b = convert.from_torchvision(legacy, NAME, **ARCH)
  jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


def test_infers_num_classes_and_representation_size():
  model, variables = convert.from_torchvision(
      _small_tv(num_classes=13, representation_size=24).state_dict(), NAME,
      **ARCH)
  assert (model.num_classes, model.representation_size) == (13, 24)
  assert variables["params"]["head"]["kernel"].shape == (24, 13)


def test_bad_state_dict_reports_every_problem_by_name():
  sd = dict(_small_tv().state_dict())
  del sd["encoder.layers.encoder_layer_1.ln_2.bias"]
  del sd["class_token"]
  sd["encoder.extra_thing"] = torch.zeros(3)
  sd["encoder.ln.weight"] = torch.zeros(100)
  with pytest.raises(ValueError) as e:
    convert.from_torchvision(sd, NAME, **ARCH)
  msg = str(e.value)
  for s in ("missing keys (2)", "encoder.layers.encoder_layer_1.ln_2.bias",
            "class_token", "unexpected keys (1)", "encoder.extra_thing",
            "mis-shaped keys (1)", "encoder.ln.weight: expected (192,), got (100,)"):
    assert s in msg, (s, msg)
  # A checkpoint of another size: every layer is reported mis-shaped.
  with pytest.raises(ValueError, match=r"conv_proj.weight: expected \(384, 3, 16, 16\)"):
    convert.from_torchvision(_small_tv().state_dict(), "vit_s_16", **ARCH)
  with pytest.raises(TypeError, match="Expected a torchvision state_dict"):
    convert.from_torchvision([1, 2], NAME, **ARCH)


def test_load_torchvision_from_pth_path(tmp_path):
  tv = _small_tv(num_classes=5)
  path = tmp_path / "vit.pth"
  torch.save({"model": tv.state_dict(), "epoch": 3}, path)
  model, variables, pre, categories = convert.load_torchvision(NAME, str(path), **ARCH)
  assert categories is None
  assert (pre.crop_size, pre.resize_size) == (64, 73)
  assert pre.mean == (0.485, 0.456, 0.406)
  x = images(1, 64)
  with torch.inference_mode():
    assert_close_rel(model.apply(variables, nhwc(x)),
                     tv(torch.from_numpy(x)).numpy())
  # Resampled on load.
  model, variables, pre, _ = convert.load_torchvision(NAME, str(path),
                                                      image_size=96, **ARCH)
  assert pre.crop_size == 96
  assert model.apply(variables, jnp.zeros((1, 96, 96, 3))).shape == (1, 5)


class _Evil:
  def __reduce__(self):
    return (print, ("this would run code",))


def test_pickled_objects_are_refused(tmp_path):
  path = tmp_path / "evil.pth"
  torch.save({"class_token": _Evil()}, path)
  with pytest.raises(ValueError, match="weights_only=True"):
    convert.load_state_dict_file(str(path))
  with pytest.raises(FileNotFoundError, match="no_such.pth"):
    convert.load_state_dict_file(str(tmp_path / "no_such.pth"))


def test_load_torchvision_named_weights_use_their_preprocessing(monkeypatch):
  """Released weights: the image size and transforms come from torchvision's
  weights metadata (the download itself is replaced: no network here)."""
  seen = {}

  def fake_download(enum):
    seen["url"] = enum.url
    size = enum.transforms().crop_size[0]
    return torchvision_vit("vit_b_16", num_classes=1000,
                           image_size=size).state_dict()

  from vit_jax.weights import files  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(files, "download_torchvision", fake_download)
  model, variables, pre, cats = convert.load_torchvision(
      "vit_b_16", "IMAGENET1K_SWAG_E2E_V1")
  assert seen["url"].endswith(".pth")
  assert (pre.crop_size, pre.resize_size, pre.interpolation) == (384, 384, "bicubic")
  assert len(cats) == 1000
  pe = variables["params"]["Transformer"]["posembed_input"]["pos_embedding"]
  assert pe.shape == (1, 24 * 24 + 1, 768)
  _, _, pre, _ = convert.load_torchvision("vit_b_16", "IMAGENET1K_V1")
  assert (pre.crop_size, pre.resize_size, pre.interpolation) == (224, 256, "bilinear")
  with pytest.raises(ValueError, match="no weights 'NOPE' for vit_b_16"):
    convert.load_torchvision("vit_b_16", "NOPE")


def test_damaged_files_say_they_are_damaged(tmp_path, monkeypatch):
  """A truncated .pth is damaged, not refused for pickled code; a truncated
  safetensors file gives both sizes; no torch installed names pip."""
  from vit_jax import weights  # pylint: disable=import-outside-toplevel
  from vit_jax.weights import files  # pylint: disable=import-outside-toplevel
  sd = {"class_token": torch.randn(1, 1, 8), "w": torch.randn(64, 64)}
  path = tmp_path / "w.pth"
  torch.save(sd, path)
  data = path.read_bytes()
  for cut in (len(data) // 2, len(data) - 30):
    (tmp_path / "cut.pth").write_bytes(data[:cut])
    with pytest.raises(weights.CheckpointError,
                       match=rf"damaged or truncated \({cut:,} bytes\)") as e:
      weights.load(str(tmp_path / "cut.pth"))
    assert "pickled" not in str(e.value)
  # Legacy (non-zip) torch files too.
  torch.save(sd, tmp_path / "old.pth", _use_new_zipfile_serialization=False)
  legacy = (tmp_path / "old.pth").read_bytes()
  (tmp_path / "old_cut.pth").write_bytes(legacy[:len(legacy) // 2])
  with pytest.raises(ValueError, match="damaged or truncated"):
    files.read_torch(str(tmp_path / "old_cut.pth"))
  files.write_safetensors({"w": np.ones((64, 64), np.float32)},
                          str(tmp_path / "w.safetensors"))
  data = (tmp_path / "w.safetensors").read_bytes()
  (tmp_path / "cut.safetensors").write_bytes(data[:-1000])
  with pytest.raises(ValueError, match=rf"truncated \({len(data) - 1000:,} of "
                     rf"{len(data):,} bytes, as its header says\)"):
    files.read_safetensors(str(tmp_path / "cut.safetensors"))
  import builtins  # pylint: disable=import-outside-toplevel
  real = builtins.__import__

  def no_torch(name, *a, **k):
    if name == "torch":
      raise ModuleNotFoundError("No module named 'torch'")
    return real(name, *a, **k)

  monkeypatch.setattr(builtins, "__import__", no_torch)
  with pytest.raises(ValueError, match=r"needs PyTorch: pip install torch"):
    files.read_torch(str(path))
