"""Deployment artifacts (vit_jax.export), each run by its own runtime.

StableHLO by ``jax.export.deserialize``, SavedModel by
``tf.saved_model.load``, ONNX by ``onnxruntime.InferenceSession``: every
artifact has one dynamic batch dimension and must give ``model.apply``'s
logits to 1e-5 (relative to the largest logit) at batch 1 and 7, with and
without the in-graph preprocessing. Small random models with every parameter
perturbed, so each weight matters.
"""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import convert, export, formats, inference, models
from vit_jax.export import __main__ as export_cli
from vit_jax.export import preprocessing as export_preprocessing
from vit_jax.export import savedmodel as export_tf

# One entry per model family: get_model() overrides on top of _SMALL. A new
# family (registers, MAP head, ...) is one more line here.
FAMILIES = {
    "classic": dict(classifier="token"),
    "gap": dict(classifier="gap"),
    # DINOv2 with registers and SigLIP's MAP head (tanh GELU).
    "dinov2_reg": dict(num_registers=4, layer_scale_init=1e-5,
                       no_embed_class=True),
    "siglip": dict(classifier="map", act="gelu_tanh"),
}
_SMALL = dict(num_classes=10, num_layers=2, hidden_size=64, num_heads=4,
              mlp_dim=128, patch_size=8, image_size=32)
PRE = convert.Preprocessing(crop_size=32, resize_size=37,
                            interpolation="bilinear")
SUFFIX = {"stablehlo": ".shlo", "savedmodel": "", "onnx": ".onnx"}
TOL = 1e-5


def _perturbed(variables, seed=0, scale=0.05):
  leaves, treedef = jax.tree_util.tree_flatten(variables)
  rs = np.random.RandomState(seed)
  return jax.tree_util.tree_unflatten(treedef, [
      np.asarray(x) + scale * rs.standard_normal(np.shape(x)).astype(np.float32)
      for x in leaves])


@functools.lru_cache(maxsize=None)
def _model(family, **extra):
  model = models.get_model("vit_ti_16", **{**_SMALL, **FAMILIES[family],
                                           **extra})
  return model, _perturbed(models.init_params(model))


@functools.lru_cache(maxsize=None)
def _reference(family, with_pre):
  model, variables = _model(family)

  @jax.jit
  def fn(images):
    x = export_preprocessing.preprocess(images, PRE) if with_pre else images
    return model.apply(variables, x, train=False)

  return fn


def _inputs(with_pre, seed=1):
  """Batch 1 and 7; uint8 inputs of two sizes (one upscaled, one shrunk)."""
  rs = np.random.RandomState(seed)
  if with_pre:
    return [rs.randint(0, 256, (1, 45, 38, 3), dtype=np.uint8),
            rs.randint(0, 256, (7, 29, 61, 3), dtype=np.uint8)]
  return [rs.standard_normal((b, 32, 32, 3)).astype(np.float32)
          for b in (1, 7)]


def _runtime(fmt, path):
  """The artifact loaded by its own runtime: images -> logits (numpy)."""
  if fmt == "stablehlo":
    with open(path, "rb") as f:
      exp = jax.export.deserialize(bytearray(f.read()))
    return lambda x: np.asarray(exp.call(x))
  if fmt == "savedmodel":
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    serve = tf.saved_model.load(path).signatures["serving_default"]
    return lambda x: serve(images=tf.constant(x))["logits"].numpy()
  import onnxruntime as ort  # pylint: disable=import-outside-toplevel
  sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
  return lambda x: sess.run(["logits"], {"images": x})[0]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
  """artifact(fmt, family, with_pre) -> path (exported once per module)."""
  made = {}
  root = tmp_path_factory.mktemp("artifacts")

  def get(fmt, family, with_pre=False):
    key = (fmt, family, with_pre)
    if key not in made:
      model, variables = _model(family)
      path = os.path.join(root, f"{fmt}_{family}_{int(with_pre)}{SUFFIX[fmt]}")
      made[key] = export.export((model, variables, PRE), fmt, path,
                                with_preprocessing=with_pre)
    return made[key]

  return get


def _rel(got, want):
  return float(np.abs(np.asarray(got, np.float64) - want).max() /
               np.abs(want).max())


@pytest.mark.parametrize("with_pre", [False, True], ids=["float", "uint8"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("fmt", export.FORMATS)
def test_artifact_gives_model_apply_logits(fmt, family, with_pre, artifact,
                                           record_property):
  run = _runtime(fmt, artifact(fmt, family, with_pre))
  ref = _reference(family, with_pre)
  errs = []
  for images in _inputs(with_pre):
    want = np.asarray(ref(images), np.float64)
    got = run(images)
    assert got.shape == (len(images), _SMALL["num_classes"])
    assert got.dtype == np.float32
    errs.append(_rel(got, want))
  record_property("max_rel_err", max(errs))
  assert max(errs) < TOL, errs


# --------------------------------------------------------------------------- #
# Wrong inputs get clear errors from every runtime.
# --------------------------------------------------------------------------- #

_NCHW = np.zeros((2, 3, 32, 32), np.float32)
_F64 = np.zeros((2, 32, 32, 3), np.float64)
_U8 = np.zeros((2, 32, 32, 3), np.uint8)


def test_stablehlo_wrong_inputs(artifact):
  path = artifact("stablehlo", "classic")
  art = export.load_stablehlo(path)
  with pytest.raises(export.ExportError, match=r"float32 \(batch, 32, 32, 3\)"
                     r".*NCHW"):
    art(_NCHW)
  with pytest.raises(export.ExportError, match="got float64"):
    art(_F64)
  with pytest.raises(export.ExportError, match="got uint8"):
    art(_U8)
  # The raw runtime names the mismatch too.
  with open(path, "rb") as f:
    exp = jax.export.deserialize(bytearray(f.read()))
  with pytest.raises(ValueError, match="Shape mismatch"):
    exp.call(_NCHW)
  with pytest.raises(ValueError, match="Dtype mismatch"):
    exp.call(_U8)
  pre = export.load_stablehlo(artifact("stablehlo", "classic", True))
  with pytest.raises(export.ExportError, match=r"uint8 \(batch, height, "
                     r"width, 3\)"):
    pre(np.zeros((1, 40, 40, 3), np.float32))


def test_savedmodel_wrong_inputs(artifact):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  serve = tf.saved_model.load(artifact("savedmodel", "classic")).signatures[
      "serving_default"]
  with pytest.raises(tf.errors.InvalidArgumentError, match=(
      r"not compatible with expected shape \[\?,32,32,3\]")):
    serve(images=tf.constant(_NCHW))
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match="expected to be a float tensor but is a double"):
    serve(images=tf.constant(_F64))


def test_onnx_wrong_inputs(artifact):
  import onnxruntime as ort  # pylint: disable=import-outside-toplevel
  sess = ort.InferenceSession(artifact("onnx", "classic"),
                              providers=["CPUExecutionProvider"])
  with pytest.raises(Exception, match="invalid dimensions for input: images"):
    sess.run(None, {"images": _NCHW})
  with pytest.raises(Exception, match=r"Unexpected input data type.*double"):
    sess.run(None, {"images": _F64})
  inp = sess.get_inputs()[0]
  assert (inp.name, inp.type) == ("images", "tensor(float)")
  assert inp.shape[1:] == [32, 32, 3] and isinstance(inp.shape[0], str)


# --------------------------------------------------------------------------- #
# Options.
# --------------------------------------------------------------------------- #


def test_fixed_batch(tmp_path):
  model, variables = _model("classic")
  x = _inputs(False)[1][:3]
  want = np.asarray(_reference("classic", False)(x), np.float64)
  for fmt in ("stablehlo", "onnx"):
    path = export.export((model, variables), fmt,
                         str(tmp_path / f"a{SUFFIX[fmt]}"), batch=3)
    assert _rel(_runtime(fmt, path)(x), want) < TOL
  art = export.load_stablehlo(str(tmp_path / "a.shlo"))
  assert art.spec.shape == (3, 32, 32, 3)
  with pytest.raises(export.ExportError, match=r"float32 \(3, 32, 32, 3\)"):
    art(x[:2])


@pytest.mark.parametrize("fmt", ["stablehlo", "savedmodel"])
def test_bfloat16(fmt, tmp_path):
  model, variables = _model("classic")
  path = export.export((model, variables), fmt,
                       str(tmp_path / f"a{SUFFIX[fmt]}"), dtype="bfloat16")
  x = _inputs(False)[1]
  got = _runtime(fmt, path)(x)
  assert got.dtype == np.float32
  bf16 = jax.tree_util.tree_map(lambda v: jnp.asarray(v, jnp.bfloat16),
                                variables)
  want = jax.jit(functools.partial(model.clone(dtype=jnp.bfloat16).apply,
                                   train=False))(bf16, x)
  want32 = np.asarray(_reference("classic", False)(x), np.float64)
  assert _rel(got, np.asarray(want, np.float64)) < 1e-2
  assert 1e-5 < _rel(got, want32) < 5e-2  # really bfloat16, still the model
  if fmt == "stablehlo":
    assert "bf16" in export.load_stablehlo(path).exported.mlir_module()


def test_onnx_bfloat16_is_a_clear_error(tmp_path):
  with pytest.raises(export.ExportError, match="onnxruntime.*bfloat16"):
    export.export(_model("classic"), "onnx", str(tmp_path / "a.onnx"),
                  dtype="bfloat16")


def test_dynamic_batch_over_256_tokens(tmp_path):
  # 17 x 17 patches + class token: the CPU attention path chunks by batch,
  # so a dynamic-batch artifact uses XLA's attention (the same function).
  model, variables = _model("classic", image_size=136)
  path = export.export((model, variables), "stablehlo", str(tmp_path / "a"))
  run = _runtime("stablehlo", path)
  for b in (2, 3):
    x = np.random.RandomState(b).standard_normal((b, 136, 136, 3)).astype(
        np.float32)
    want = np.asarray(model.apply(variables, x, train=False), np.float64)
    assert _rel(run(x), want) < TOL


def test_savedmodel_module_has_no_composites_for_tensorflow():
  from jax.extend.mlir import ir  # pylint: disable=import-outside-toplevel
  from jax.extend.mlir.dialects import stablehlo  # pylint: disable=import-outside-toplevel
  s = export.servable(_model("classic"))
  exp = export.exported(s)
  ctx = ir.Context()
  assert "stablehlo.composite" in str(stablehlo.deserialize_portable_artifact(
      ctx, exp.mlir_module_serialized))  # JAX wraps erf (GELU) in one
  tf_exp = export_tf.for_tensorflow(exp)
  text = str(stablehlo.deserialize_portable_artifact(
      ctx, tf_exp.mlir_module_serialized))
  assert "stablehlo.composite" not in text
  assert "call @chlo.erf" in text  # the decomposition, called
  x = _inputs(False)[1]
  assert _rel(tf_exp.call(x), np.asarray(exp.call(x), np.float64)) < 1e-6


# --------------------------------------------------------------------------- #
# The exported preprocessing.
# --------------------------------------------------------------------------- #


def _photo(h, w, seed):
  """A smooth image with some noise (uint8)."""
  rs = np.random.RandomState(seed)
  base = rs.randint(0, 256, (h // 8 + 2, w // 8 + 2, 3)).astype(np.float32)
  img = np.asarray(jax.image.resize(base, (h, w, 3), "linear"))
  img = img + rs.randint(-20, 21, img.shape)
  return np.clip(np.round(img), 0, 255).astype(np.uint8)


def test_crop_geometry_is_torchvisions():
  pre = convert.Preprocessing(crop_size=224, resize_size=256)
  for h in range(200, 700, 7):
    for w in range(150, 900, 11):
      # torchvision's Resize(256) + CenterCrop(224), as predict.py does it.
      new = (256, int(256 * h / w)) if w <= h else (int(256 * w / h), 256)
      want = (new[1], new[0], int(round((new[1] - 224) / 2.0)),
              int(round((new[0] - 224) / 2.0)))
      assert tuple(int(v) for v in export_preprocessing.crop_geometry(h, w, pre)) == want


_METHOD = {"bilinear": "linear", "bicubic": "cubic", "lanczos": "lanczos3"}
_SIZES = [(375, 500), (500, 375), (224, 224), (1000, 667), (180, 260)]


@pytest.mark.parametrize("interp", list(_METHOD))
def test_preprocess_is_jax_image_resample(interp):
  pre = convert.Preprocessing(crop_size=224, resize_size=256,
                              interpolation=interp)
  f = jax.jit(export_preprocessing.preprocess, static_argnums=1)
  for i, (h, w) in enumerate(_SIZES):
    img = _photo(h, w, i)
    got = np.asarray(f(img[None], pre))[0] * np.asarray(pre.std) * 255
    nh, nw, top, left = export_preprocessing.crop_geometry(h, w, pre)
    with jax.enable_x64(True):
      want = jax.image.scale_and_translate(
          jnp.asarray(img, jnp.float64)[None], (1, 224, 224, 3), (1, 2),
          jnp.array([nh / h, nw / w]), -jnp.array([top, left], jnp.float64),
          _METHOD[interp], antialias=True)
      want = np.clip(np.asarray(want)[0], 0, 255) - np.asarray(pre.mean) * 255
    assert np.abs(got - want).max() < 3e-4  # 0-255 units: float32 rounding


@pytest.mark.parametrize("interp", list(_METHOD))
def test_preprocess_against_pil(interp, record_property):
  """predict.py's PIL path rounds to uint8 after each of its two passes (and
  clips between them); the exported preprocessing does one float pass."""
  pre = convert.Preprocessing(crop_size=224, resize_size=256,
                              interpolation=interp)
  f = jax.jit(export_preprocessing.preprocess, static_argnums=1)
  means, maxes = [], []
  for i, (h, w) in enumerate(_SIZES + [(256, 300)]):
    img = _photo(h, w, i)
    d = np.abs(np.asarray(f(img[None], pre))[0] -
               inference.preprocess_pil(img, pre)) * np.asarray(pre.std) * 255
    if min(h, w) == 256:  # no resize: PIL only crops
      assert d.max() < 1e-3
      continue
    means.append(d.mean())
    maxes.append(d.max())
    assert d.mean() < 0.35
    assert d.max() <= (1.0 + 1e-3 if interp == "bilinear" else 8.0)
  record_property("mean_abs_diff_255", float(np.mean(means)))
  record_property("max_abs_diff_255", float(np.max(maxes)))


@pytest.mark.parametrize("interp", list(_METHOD))
def test_torch_preprocessing_is_the_same_function(interp):
  import torch  # pylint: disable=import-outside-toplevel
  from vit_jax.export import onnx as export_onnx  # pylint: disable=import-outside-toplevel
  pre = convert.Preprocessing(crop_size=32, resize_size=37,
                              interpolation=interp, mean=(0.5,) * 3,
                              std=(0.5,) * 3)
  module = export_onnx._torch_preprocessing(pre)  # pylint: disable=protected-access
  for i, (h, w) in enumerate([(45, 38), (29, 61), (37, 37)]):
    img = _photo(h, w, i)[None]
    got = module(torch.from_numpy(img)).numpy()
    want = np.asarray(jax.jit(export_preprocessing.preprocess, static_argnums=1)(img, pre))
    assert np.abs(got - want).max() < 1e-5


def test_unsupported_interpolation(tmp_path):
  model, variables = _model("classic")
  pre = convert.Preprocessing(crop_size=32, resize_size=37,
                              interpolation="nearest")
  with pytest.raises(export.ExportError, match="not 'nearest'"):
    export.export((model, variables, pre), "stablehlo", str(tmp_path / "a"),
                  with_preprocessing=True)


# --------------------------------------------------------------------------- #
# What can be exported; the CLI.
# --------------------------------------------------------------------------- #


def test_servable_errors(tmp_path):
  model, variables = _model("classic")
  with pytest.raises(export.ExportError, match="crops 48x48.*32x32"):
    export.servable((model, variables, convert.Preprocessing(crop_size=48)))
  headless = model.clone(num_classes=0)
  with pytest.raises(export.ExportError, match="no classification head.*"
                     "output='features'"):
    export.servable((headless, variables), output="logits")
  assert export.servable((headless, variables)).output == "features"
  with pytest.raises(export.ExportError, match="output 'tokens'"):
    export.servable((model, variables), output="tokens")
  with pytest.raises(export.ExportError, match="expected a checkpoint path"):
    export.servable(42)
  with pytest.raises(export.ExportError, match="needs the weights' "
                     "preprocessing"):
    export.export((model, variables), "stablehlo", str(tmp_path / "a"),
                  with_preprocessing=True)
  with pytest.raises(export.ExportError, match="format 'tflite'"):
    export.export((model, variables), "tflite", str(tmp_path / "a"))


def test_cli(tmp_path, capsys):
  model, variables = _model("classic")
  ckpt = str(tmp_path / "tiny.safetensors")
  formats.save_safetensors(variables, ckpt, model=model, metadata={
      "preprocessing": {"crop_size": 32, "resize_size": 37,
                        "interpolation": "bicubic", "mean": [0.5] * 3,
                        "std": [0.5] * 3}})
  out = str(tmp_path / "tiny.onnx")
  rc = export_cli.main(["--checkpoint", ckpt, "--format", "onnx", "--out", out,
                    "--with-preprocessing", "--verify"])
  text = capsys.readouterr().out
  assert rc == 0, text
  assert "images: uint8 (batch, height, width, 3)" in text
  assert "bicubic" in text
  err = float(text.split("max relative error against JAX")[1].split()[0])
  assert err < TOL
  rc = export_cli.main(["--checkpoint", ckpt, "--format", "onnx", "--out", out,
                    "--dtype", "bfloat16"])
  assert rc == 1 and "float32 only" in capsys.readouterr().err
  rc = export_cli.main(["--checkpoint", str(tmp_path / "missing.pth"),
                    "--format", "stablehlo", "--out", str(tmp_path / "x")])
  assert rc == 1 and "no such file" in capsys.readouterr().err


def test_onnx_checks_its_torch_twin():
  """The torch twin is compared with JAX before the ONNX export, so a layout
  the converters map only in part is an error, not a wrong artifact."""
  import torch  # pylint: disable=import-outside-toplevel
  from vit_jax.export import onnx as export_onnx  # pylint: disable=import-outside-toplevel
  s = export.servable(_model("classic"))
  net = export_onnx.torch_model(s)
  export_onnx.check_twin(s, net)  # the exact twin passes
  with torch.no_grad():
    # As if the twin had no place for some parameter of the model:
    net.blocks[0].mlp.fc1.weight.mul_(0.5)
  with pytest.raises(export.ExportError, match="does not compute it"):
    export_onnx.check_twin(s, net)


def test_exported_preprocessing_says_what_it_takes():
  pre = PRE
  for bad, hint in ((np.zeros((2, 3, 40, 40), np.uint8), "NCHW"),
                    (np.zeros((40, 40, 3), np.uint8), r"images\[None\]"),
                    (np.zeros((2, 40, 40, 3), np.float32), "")):
    with pytest.raises(export.ExportError, match=r"uint8 \(batch, height, "
                       r"width, 3\), values 0-255; got .*" + hint):
      export_preprocessing.preprocess(jnp.asarray(bad), pre)


def test_verify_cannot_pass_for_want_of_a_signal(tmp_path, capsys):
  """A fresh (all-zero) head gives every image the same logits: --verify
  then checks a copy with a random head, exported the same way, and says
  so."""
  model, variables = _model("classic")
  params = dict(variables["params"])
  params["head"] = {"kernel": np.zeros_like(params["head"]["kernel"]),
                    "bias": np.asarray(params["head"]["bias"])}
  zero = dict(variables, params=params)
  ckpt = str(tmp_path / "fresh_head.safetensors")
  formats.save_safetensors(zero, ckpt, model=model)
  out = str(tmp_path / "fresh.shlo")
  assert export_cli.main(["--checkpoint", ckpt, "--format", "stablehlo",
                          "--out", out, "--verify"]) == 0
  text = capsys.readouterr().out
  assert "head is all zero" in text and "a copy with a random head" in text
  s = export.servable((model, zero))
  got = export.verify(s, "stablehlo", out)
  assert got.note and float(got) == 0.0  # StableHLO: the same program
  # A real head: verified as it is, no note.
  out2 = str(tmp_path / "real.shlo")
  export.export((model, variables), "stablehlo", out2)
  got = export.verify(export.servable((model, variables)), "stablehlo", out2)
  assert got.note == "" and float(got) == 0.0


# --------------------------------------------------------------------------- #
# The 2026 families (issue 21): RoPE, gated MLPs, RMSNorm, distillation.
# --------------------------------------------------------------------------- #

# DINOv3 as timm's loader decodes it, at the size of _SMALL.
NEW_FAMILIES = {
    "dinov3": dict(classifier="gap", class_token=True, num_registers=4,
                   layer_scale_init=1e-5, abs_pos_embed=False, rope="dinov3",
                   rope_temperature=100.0, key_bias=False,
                   layer_norm_eps=1e-5),
}


def _new_family(family):
  model = models.get_model("vit_ti_16", **{**_SMALL, **NEW_FAMILIES[family]})
  x = jnp.zeros((1, 32, 32, 3))
  variables = _perturbed(model.init(jax.random.key(0), x), scale=0.2)
  return export.servable((model, variables, PRE))


def test_2026_families_export_and_verify(tmp_path):
  """DINOv3 (RoPE) in every runtime; the other families' ONNX twins are
  timm's own models (tests/weights/test_families_2026.py builds each from our
  fields and compares it with the timm model it came from)."""
  family = "dinov3"
  s = _new_family(family)
  for fmt in export.FORMATS:
    path = export.export(s, fmt, str(tmp_path / f"{family}{SUFFIX[fmt]}"))
    err = float(export.verify(s, fmt, path))
    print(f"\nEXPORT {family} {fmt}: max relative error {err:.1e}")
    assert err < TOL, (fmt, err)


def test_hybrid_exports_and_verifies(tmp_path):
  """An R50+ViT-style hybrid (a one-stage ResNet stem of width 32 with
  Google's constants, a 2x2 patch embedding of its /4 features) in every
  runtime; its ONNX twin is timm's HybridEmbed, whose standardisation
  (eps inside the root) gets kernels rescaled to Google's (eps outside)."""
  model = models.get_model("vit_ti_16", **{
      **_SMALL, "resnet": models.ResNetConfig((1,), width_factor=0.5)})
  x = jnp.zeros((1, 32, 32, 3))
  variables = _perturbed(model.init(jax.random.key(0), x), scale=0.2)
  s = export.servable((model, variables, PRE))
  for fmt in export.FORMATS:
    path = export.export(s, fmt, str(tmp_path / f"hybrid{SUFFIX[fmt]}"))
    err = float(export.verify(s, fmt, path))
    print(f"\nEXPORT hybrid {fmt}: max relative error {err:.1e}")
    assert err < TOL, (fmt, err)


@pytest.fixture(scope="module")
def dinov3_file(tmp_path_factory):
  """timm's DINOv3 S/16 (rotary positions only, no position embedding) at
  depth 2 and width 192, perturbed, with a 5-class head: the module and
  its state dict as a safetensors file."""
  import timm  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
  from compare import perturb_torch  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  m = perturb_torch(timm.create_model(
      "vit_small_patch16_dinov3", pretrained=False, depth=2, embed_dim=192,
      num_heads=3, num_classes=5), 0, std=0.1)
  path = tmp_path_factory.mktemp("dinov3") / "dinov3.safetensors"
  save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(path))
  return m, str(path)


def test_a_rotary_only_model_exports_at_the_size_given(tmp_path, dinov3_file):
  """DINOv3 has no position embedding to tell its input size: the size
  given to export() (or weights.load, or --image-size) is honoured; without
  one the error names what to pass. Each artifact in its runtime gives
  timm's logits."""
  import torch  # pylint: disable=import-outside-toplevel
  from compare import torch_in  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  from vit_jax import weights  # pylint: disable=import-outside-toplevel
  m, path = dinov3_file
  model, variables = formats.from_timm(load_file(path),
                                       "vit_small_patch16_dinov3")
  assert model.image_size is None and not model.abs_pos_embed
  with pytest.raises(export.ExportError, match=r"rotary positions only.*pass "
                     r"image_size \(--image-size\)"):
    export.servable((model, variables))
  x = np.random.default_rng(0).standard_normal((2, 64, 64, 3)).astype(
      np.float32)
  with torch.no_grad():
    ref = m(torch_in(x)).numpy()
  for fmt in ("stablehlo", "onnx"):
    out = export.export((model, variables), fmt,
                        str(tmp_path / f"d3{SUFFIX[fmt]}"), image_size=64)
    got = export.load(fmt, out)(x)
    assert np.abs(got - ref).max() / np.abs(ref).max() < TOL, fmt
  # The name's pretrained record gives a size too (DINOv3's: 256).
  assert export.servable((model, variables),
                         model_name="vit_small_patch16_dinov3").image_size == 256
  loaded = weights.load(path, model_name="vit_small_patch16_dinov3",
                        image_size=48)
  assert loaded.preprocessing.crop_size == 48
  assert export.servable(loaded).image_size == 48
  out = str(tmp_path / "d3_cli.shlo")
  assert export_cli.main(["--checkpoint", path, "--model",
                          "vit_small_patch16_dinov3", "--image-size", "48",
                          "--format", "stablehlo", "--out", out]) == 0
  x48 = x[:, :48, :48]
  with torch.no_grad():
    ref = m(torch_in(x48)).numpy()
  got = export.load("stablehlo", out)(x48)
  assert np.abs(got - ref).max() / np.abs(ref).max() < TOL


# --------------------------------------------------------------------------- #
# The timm-only families (BEiT, CaiT, the relpos ViTs, SAM's encoder), and
# feature extractors: artifacts that return forward_features.
# --------------------------------------------------------------------------- #

# Each family's options at the size of _SMALL; their ONNX twins are timm's
# Beit, Cait, VisionTransformerRelPos and VisionTransformerSAM.
TIMM_FAMILIES = {
    "beit": dict(rel_pos_bias="block", abs_pos_embed=False, key_bias=False,
                 layer_scale_init=0.1, fc_norm=True, classifier="gap",
                 class_token=True),
    "cait": dict(talking_heads=True, class_attn_layers=2,
                 no_embed_class=True, layer_scale_init=0.1),
    "relpos": dict(rel_pos_bias="block", rel_pos_mlp="cr",
                   rel_pos_mlp_dim=32, abs_pos_embed=False, classifier="gap",
                   class_token=False, fc_norm=True),
    "sam": dict(window_size=2, global_attn_indexes=(1,), rel_pos=True,
                neck_chans=32, classifier="gap", final_norm=False,
                class_token=False),
}


def _timm_family(family, **overrides):
  model = models.get_model("vit_ti_16", **{**_SMALL, **TIMM_FAMILIES[family],
                                           **overrides})
  variables = _perturbed(model.init(jax.random.key(0),
                                    jnp.zeros((1, 32, 32, 3))), scale=0.2)
  return model, variables


@pytest.mark.parametrize("family", sorted(TIMM_FAMILIES))
def test_timm_families_export_to_onnx(tmp_path, family):
  """ONNX goes through each family's torch twin (SAM's windows attend
  through torch's explicit path: the exporter takes no 3-D fused
  attention); StableHLO and SavedModel export the same JAX function for
  every family (SAM's below)."""
  s = export.servable(_timm_family(family))
  path = export.export(s, "onnx", str(tmp_path / f"{family}.onnx"))
  err = float(export.verify(s, "onnx", path))
  print(f"\nEXPORT {family} onnx: max relative error {err:.1e}")
  assert err < TOL, (family, err)


@pytest.mark.parametrize("fmt", export.FORMATS)
def test_sams_encoder_exports_its_neck_map(tmp_path, fmt, capsys):
  """SAM's released encoders have no head: the artifact is a feature
  extractor returning forward_features, the neck's (B, h, w, C) map, and
  --verify checks it against JAX (batch 1 and 7)."""
  model, variables = _timm_family("sam", num_classes=0)
  ckpt = str(tmp_path / "sam.safetensors")
  formats.save_safetensors(variables, ckpt, model=model)
  out = str(tmp_path / f"sam{SUFFIX[fmt]}")
  with pytest.warns(UserWarning):  # our file records no preprocessing
    rc = export_cli.main(["--checkpoint", ckpt, "--format", fmt, "--out",
                          out, "--verify"])
  text = capsys.readouterr().out
  assert rc == 0, text
  assert "-> features: float32 (batch, 4, 4, 32)" in text, text
  err = float(re.search(r"max relative error against JAX (\S+)",
                        text).group(1))
  assert err < TOL, text
  x = np.random.RandomState(1).standard_normal((3, 32, 32, 3)).astype(
      np.float32)
  want = jax.jit(lambda v, x: model.apply(
      v, x, method=model.forward_features))(variables, x)
  got = export.load(fmt, out)(x)
  assert got.shape == (3, 4, 4, 32)
  np.testing.assert_allclose(got, want, rtol=0,
                             atol=TOL * np.abs(want).max())


def test_features_of_a_model_with_a_head(tmp_path):
  """--output features on a classifier: the tokens after the final norm,
  from timm's twin and from torchvision's (a conv stem, a representation
  layer: the twin torchvision's, whose encoder gives them)."""
  stem = [models.ConvStemConfig(16, 3, 2), models.ConvStemConfig(32, 3, 2),
          models.ConvStemConfig(32, 3, 2)]  # /8: the patch size
  for name, (family, extra) in {
      "gap": ("gap", {}), "conv_stem": ("classic", dict(conv_stem=tuple(stem))),
      "pre_logits": ("classic", dict(representation_size=32))}.items():
    model, variables = _model(family, **extra)
    s = export.servable((model, variables), output="features")
    assert export.output_shape(s) == (None, 16 + model.num_prefix_tokens, 64)
    path = export.export(s, "onnx", str(tmp_path / f"{name}.onnx"))
    err = float(export.verify(s, "onnx", path))
    print(f"\nEXPORT features {name} onnx: max relative error {err:.1e}")
    assert err < TOL, (name, err)
