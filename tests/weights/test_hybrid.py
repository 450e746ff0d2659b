"""The ViT paper's hybrids (R50+ViT): a ResNet stem before the patch
embedding, against Google's own module and timm's models.

* Google: ``models_vit.VisionTransformer(resnet=...)`` (vendored unchanged in
  ``tests/reference``) with random, perturbed parameters, saved as Google's
  ``.npz`` files are (flat ``'/'`` keys), loads through
  ``vit_jax.weights.load(path)`` alone and gives the module's logits within
  1e-5; our hybrid tree runs unchanged in Google's module; our ``.npz``
  goes back into it; the parameter counts of Google's hybrid configs.
* timm: the hybrid architectures (``vit_tiny_r_s16_p8_*``,
  ``vit_small_r26_s32_*``, ``vit_base_r50_s16_*``, ``vit_large_r50_s32_*``
  and the untrained ``vit_base_r26_s32_224``) with perturbed weights, both
  ways: ``formats.from_timm`` within 1e-5 of timm's logits and
  ``forward_features``, ``formats.to_timm`` loaded strictly, bit for bit.

Reduced models: 2 blocks of width 64 behind each architecture's full ResNet
stem, 64 px images. A name's 224 and 384 variants (and R26's S and B) are
one module at that size: it is built once (timm builds each name on the
meta device to show that), every name is converted through its own name.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import vit_jax
from compare import (apply, apply_with_features, images, perturb_torch,
                     torch_in, tree_equal)
from reference import models_vit
from vit_jax import formats, models, weights
from vit_jax.data import preprocessing as pp
from vit_jax.models import resnet
from vit_jax.weights import google_npz, trees
from vit_jax.weights.check import expected, shapes
from vit_jax.weights.pretrained import meta_device

timm = pytest.importorskip("timm")
torch = pytest.importorskip("torch")

TOL = 1e-5
SIZE = 64
DEPTH, WIDTH, HEADS = 2, 64, 2


def _rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  scale = np.abs(want).max()
  assert scale > 0
  return float(np.abs(got - want).max() / scale)


@pytest.fixture(autouse=True)
def _highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


# --------------------------------------------------------------------------- #
# Google's module.
# --------------------------------------------------------------------------- #

# (stage depths, Google's patches.size): a two-stage stem (/8, 1x1 patches)
# and the root alone (R+ViT-Ti/16's: /4, 8x8 patches).
GOOGLE_CASES = {"stages": ((2, 1), 1), "root": ((), 8)}


def google_module(num_layers, patches, classifier="token",
                  representation_size=None):
  return models_vit.VisionTransformer(
      num_classes=10, patches=ml_collections.ConfigDict(
          {"size": (patches, patches)}),
      hidden_size=WIDTH, transformer=dict(
          mlp_dim=128, num_heads=HEADS, num_layers=DEPTH,
          attention_dropout_rate=0.0, dropout_rate=0.0),
      resnet=ml_collections.ConfigDict(
          dict(num_layers=num_layers, width_factor=1)),
      classifier=classifier, representation_size=representation_size)


_STEM_CONV = re.compile(r"^(conv_root|block\d+/unit\d+/conv[^/]*)/kernel$")


def random_params(shapes, seed=0):
  """Random parameters for a tree of shapes (no init compiled): Google's
  initialisation in spirit (kernels of variance 1 / fan-in, norms' scales
  1, the bottlenecks' last GroupNorm scale 0 as Google's ``gn3``), every
  value then perturbed by 0.1 (so each one matters). The stem's
  convolutions get :func:`_spreads`."""
  rng = np.random.default_rng(seed)
  out = {}
  for k, s in trees.flatten(shapes).items():
    shape = tuple(s.shape)
    name, parent = k.split("/")[-1], (k.split("/")[-2:-1] or [""])[0]
    noise = lambda: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    if _STEM_CONV.match(k):
      mean = rng.standard_normal(shape[-1:]).astype(np.float32)
      out[k] = _spreads(rng, shape[-1]) * (noise() + mean)
      continue
    base = np.zeros(shape, np.float32)
    if name == "scale" and parent != "gn3":
      base += 1.0
    elif name == "kernel":
      fan_in = (shape[0] if parent in ("query", "key", "value")
                else int(np.prod(shape[:-1])))
      base += noise() / np.sqrt(fan_in)
    out[k] = base + 0.1 * noise()
  return trees.unflatten(out)


def _spreads(rng, channels):
  """Per output channel spreads of a stem kernel, 0.002 to 0.2 as in
  trained networks: the standardisation's epsilon then matters (Google's
  1e-5 beside the std is up to 5e-3 of it, and differs from channel to
  channel of a group, which GroupNorm does not undo)."""
  return (10.0 ** rng.uniform(-2.7, -0.7, channels)).astype(np.float32)


def _with(model, constants):
  """``model`` with the stem's constants of another library."""
  return model.clone(resnet=dataclasses.replace(model.resnet, **constants))


@functools.lru_cache(maxsize=None)
def google_case(case, seed=0):
  """Google's module, its parameters and its jitted forward."""
  layers, patches = GOOGLE_CASES[case]
  g = google_module(layers, patches)
  tree = jax.eval_shape(functools.partial(g.init, train=False),
                        jax.random.key(0), jnp.zeros((1, SIZE, SIZE, 3)))
  return (g, random_params(tree["params"], seed),
          jax.jit(functools.partial(g.apply, train=False)))


def save_as_google(params, path):
  """As Google's released files are: ``np.savez`` of the '/'-joined
  parameter names."""
  np.savez(path, **{k: np.asarray(v) for k, v in
                    trees.flatten(params).items()})


@pytest.mark.parametrize("case", list(GOOGLE_CASES))
def test_googles_npz_loads_with_googles_logits(case, tmp_path,
                                               record_property):
  _, params, forward = google_case(case)
  path = str(tmp_path / "R50+ViT.npz")
  save_as_google(params, path)
  loaded = weights.load(path, preprocessing=pp.google(SIZE))
  model = loaded.model
  layers, patches = GOOGLE_CASES[case]
  assert model.resnet == resnet.ResNetConfig(layers, **resnet.GOOGLE)
  assert model.act == "gelu_tanh"  # Google's module's GELU
  assert model.patch_size == model.resnet.stride * patches
  assert "ResNet" in loaded.description
  x = images(2, SIZE)
  want = forward({"params": params}, x)
  rel = _rel(model.apply(loaded.variables, x), want)
  # timm's constants on the same weights: clearly another function.
  other = _rel(_with(model, resnet.TIMM).apply(loaded.variables, x), want)
  record_property("rel_err", rel)
  print(f"\nGOOGLE npz {case}: logits rel err {rel:.2e} (timm's "
        f"constants: {other:.1e})")
  assert rel < TOL and other > 10 * TOL
  # The tree is Google's: the same arrays under the same names.
  have = trees.flatten(trees.params_of(loaded.variables))
  assert sorted(have) == sorted(trees.flatten(params))
  for k, v in trees.flatten(params).items():
    np.testing.assert_array_equal(have[k], v, err_msg=k)


def test_old_flax_groupnorm_shapes_and_our_npz_go_back(tmp_path):
  """Files written by flax < 0.3.6 keep GroupNorm's scale and bias as
  (1, 1, 1, C) (vision_transformer's checkpoint._fix_groupnorm squeezes
  them); the .npz we write loads into Google's module as its own
  ``checkpoint.load`` reads one (recover the tree, convert_pre_linen)."""
  _, params, forward = google_case("stages")
  flat = {k: (np.reshape(v, (1, 1, 1, -1)) if re.search(
      r"(^|/)gn[^/]*/(scale|bias)$", k) else v)
          for k, v in trees.flatten(params).items()}
  assert flat["gn_root/scale"].shape == (1, 1, 1, 64)
  path = str(tmp_path / "old.npz")
  np.savez(path, **flat)
  model, variables = formats.load_npz(path)
  x = images(2, SIZE, seed=1)
  want = forward({"params": params}, x)
  assert _rel(model.apply(variables, x), want) < TOL
  ours = str(tmp_path / "ours.npz")
  formats.save_npz(variables, ours)
  with np.load(ours, allow_pickle=False) as f:
    assert "block1/unit1/conv_proj/kernel" in f.files
    back = google_npz.convert_pre_linen(trees.unflatten(dict(f.items())))
  np.testing.assert_array_equal(forward({"params": back}, x), want)


def test_our_hybrid_tree_runs_unchanged_in_googles_module():
  layers, patches = GOOGLE_CASES["stages"]
  ours = models.get_model(dict(
      hidden_size=WIDTH, num_layers=DEPTH, num_heads=HEADS, mlp_dim=128,
      num_classes=10, patch_size=8 * patches, act="gelu_tanh",
      resnet=models.ResNetConfig(layers)))  # Google's constants: the default
  tree = jax.eval_shape(functools.partial(ours.init, train=False),
                        jax.random.key(0), jnp.zeros((1, SIZE, SIZE, 3)))
  variables = {"params": random_params(tree["params"], seed=3)}
  g, theirs, forward = google_case("stages")
  assert shapes(trees.flatten(theirs)) == shapes(
      trees.flatten(variables["params"]))
  x = images(2, SIZE, seed=2)
  rel = _rel(apply(ours, variables, x), forward(variables, x))
  print(f"\nGOOGLE module on our tree: logits rel err {rel:.2e}")
  assert rel < TOL


@pytest.mark.parametrize("base, resnet_layers, patch, count", [
    # vision_transformer's models_test.MODEL_SIZES (1000 classes, 224 px).
    ("vit_b_16", (3, 4, 9), 16, 98_659_112),  # R50+ViT-B_16
    ("vit_ti_16", (), 32, 6_337_704),  # R+ViT-Ti_16 (/4 root, 8x8 patches)
    ("vit_s_16", (2, 2, 2, 2), 32, 36_431_912),  # R26+ViT-S_32
    ("vit_l_16", (3, 4, 6, 3), 32, 328_994_856),  # R50+ViT-L_32
])
def test_parameter_counts_are_googles(base, resnet_layers, patch, count):
  model = models.get_model(base, num_classes=1000, patch_size=patch,
                           resnet=resnet_layers)
  assert sum(int(np.prod(s)) for s in expected(model, 224).values()) == count


def test_options_that_cannot_meet_a_resnet_stem_are_refused():
  x = jnp.zeros((1, 48, 48, 3))
  for kw, what in ((dict(patch_size=6), "reduces by 4, which does not divide"),
                   (dict(dynamic_img_pad=True), "dynamic_img_pad")):
    model = models.get_model("vit_ti_16", num_layers=1, resnet=(1,),
                             **{"patch_size": 16, **kw})
    with pytest.raises(ValueError, match=what):
      model.init(jax.random.key(0), x)
  assert models.get_model("vit_ti_16").resnet is None  # classic: unchanged
  classic = jax.eval_shape(models.get_model("vit_ti_16", num_layers=1).init,
                           jax.random.key(0), x[:, :32, :32])
  assert not any(k.startswith(("conv_root", "gn_root", "block"))
                 for k in classic["params"])


# --------------------------------------------------------------------------- #
# timm.
# --------------------------------------------------------------------------- #

NAMES = ["vit_tiny_r_s16_p8_224", "vit_tiny_r_s16_p8_384",
         "vit_small_r26_s32_224", "vit_small_r26_s32_384",
         "vit_base_r26_s32_224",
         "vit_base_r50_s16_224", "vit_base_r50_s16_384",
         "vit_large_r50_s32_224", "vit_large_r50_s32_384"]
# The module each name is at the test's size (width, depth and resolution
# given): the stem's stages decide it.
_MODULE = {"vit_tiny_r_s16_p8": "vit_tiny_r_s16_p8_224",
           "vit_small_r26_s32": "vit_small_r26_s32_224",
           "vit_base_r26_s32": "vit_small_r26_s32_224",
           "vit_base_r50_s16": "vit_base_r50_s16_224",
           "vit_large_r50_s32": "vit_large_r50_s32_224"}
_KW = dict(depth=DEPTH, embed_dim=WIDTH, num_heads=HEADS, num_classes=7,
           img_size=SIZE)


def _module_of(name):
  return _MODULE[name.rsplit("_", 1)[0]]


@functools.lru_cache(maxsize=None)
def timm_reference(module):
  """timm's model (perturbed) and its logits / forward_features."""
  torch.manual_seed(0)
  m = perturb_torch(timm.create_model(module, pretrained=False, **_KW), 0,
                    std=0.1)
  rng = np.random.default_rng(0)
  with torch.no_grad():  # the stem's kernels: a trained network's spreads
    for k, w in m.state_dict(keep_vars=True).items():
      if k.startswith("patch_embed.backbone.") and w.ndim == 4:
        w.mul_(torch.from_numpy(_spreads(rng, w.shape[0]))[:, None, None,
                                                           None])
  x = images(2, SIZE, seed=5)
  with torch.no_grad():
    t = torch_in(x)
    return m, x, m(t).numpy(), m.forward_features(t).numpy()


def test_the_hybrids_are_listed():
  assert set(NAMES) <= set(vit_jax.list_models("vit_*_r*"))
  tags = vit_jax.list_models("vit_*_r*", pretrained=True)
  assert "vit_base_r50_s16_384.orig_in21k_ft_in1k" in tags
  assert "vit_tiny_r_s16_p8_224.augreg_in21k_ft_in1k" in tags


@pytest.mark.parametrize("module", sorted(set(_MODULE.values())))
def test_timm_hybrid_both_ways(module, record_property):
  """Every name of ``module`` (at the test's width, depth and size), both
  ways. The names of one module load the same state dict; where two give
  the same model and the same variables, their numbers are one
  computation, compiled once (a ResNet stem's trace and compile are most of
  this test)."""
  m, x, want, want_features = timm_reference(module)
  sd = m.state_dict()
  computed = {}  # repr(model) -> (variables, (rel, rel_f, other))
  for name in [n for n in NAMES if _module_of(n) == module]:
    with meta_device():  # the name's own module is the shared one
      own = timm.create_model(name, pretrained=False, **_KW)
    assert {k: tuple(v.shape) for k, v in own.state_dict().items()} == {
        k: tuple(v.shape) for k, v in m.state_dict().items()}, name
    model, variables = formats.from_timm(sd, name, num_heads=HEADS)
    assert {k: getattr(model.resnet, k) for k in resnet.TIMM} == resnet.TIMM
    key = repr(model)
    if key in computed:
      tree_equal(variables, computed[key][0])
    else:
      logits, features = apply_with_features(model, variables, x)
      other = _rel(apply(_with(model, resnet.GOOGLE), variables, x), want)
      computed[key] = (variables, (_rel(logits, want),
                                   _rel(features, want_features), other))
    rel, rel_f, other = computed[key][1]
    record_property(f"rel_err {name}", max(rel, rel_f))
    print(f"\nTIMM {name}: logits {rel:.2e}, forward_features {rel_f:.2e} "
          f"(Google's constants: {other:.1e})")
    assert rel < TOL and rel_f < TOL and other > 10 * TOL, name
    back = formats.to_timm(variables)
    assert list(back) == list(sd)  # timm's own order
    for k, v in sd.items():
      assert torch.equal(back[k], v), (name, k)
    own = own.to_empty(device="cpu")
    own.load_state_dict(back, strict=True)


@pytest.mark.parametrize("name", ["vit_tiny_r_s16_p8_384",
                                  "vit_small_r26_s32_224",
                                  "vit_base_r50_s16_384",
                                  "vit_large_r50_s32_224"])
def test_get_model_builds_timms_hybrids(name):
  """The generated architecture of a name: timm's parameter count."""
  with meta_device():
    ref = timm.create_model(name, pretrained=False)
  model = models.get_model(name)
  assert model.resnet.std_eps_in_sqrt  # timm's constants
  got = sum(int(np.prod(s)) for s in expected(model).values())
  assert got == sum(p.numel() for p in ref.parameters())


@pytest.mark.parametrize("name, what", [
    ("vit_small_resnet26d_224", "CNN backbone other than BiT"),
    ("vit_base_mci_224", "CNN backbone other than BiT"),
])
def test_other_timm_backbones_are_refused_by_name(name, what):
  with meta_device():
    m = timm.create_model(name, pretrained=False)
  sd = {k: np.zeros(tuple(v.shape), np.float32)
        for k, v in m.state_dict().items()}
  with pytest.raises(ValueError, match=what):
    formats.from_timm(sd, name)


# --------------------------------------------------------------------------- #
# Everywhere weights go.
# --------------------------------------------------------------------------- #


def test_create_model_files_and_training_keep_the_stem(tmp_path):
  """create_model by timm's name; our safetensors (the stem's record
  beside the weights); train.py's --config.init_weights from Google's
  .npz: the architecture and its constants survive each."""
  loaded = vit_jax.create_model("vit_tiny_r_s16_p8_224", num_classes=3,
                                num_layers=1, image_size=SIZE)
  model, variables, pre = loaded
  assert model.resnet == resnet.ResNetConfig((), **resnet.TIMM)
  assert model.patch_size == 32 and pre.mean == (0.5, 0.5, 0.5)
  assert model.apply(variables, np.zeros((1, SIZE, SIZE, 3),
                                         np.float32)).shape == (1, 3)
  path = str(tmp_path / "hybrid.safetensors")
  formats.save_safetensors(variables, path, model=model)
  back, _, meta = formats.load_safetensors(path)
  assert back.resnet == model.resnet
  assert meta["arch"]["resnet"] == model.resnet.record()

  import train_helpers  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  from configs import r50_b16  # pylint: disable=import-outside-toplevel
  from vit_jax.train import init as train_init  # pylint: disable=import-outside-toplevel
  _, params, _ = google_case("stages")
  npz = str(tmp_path / "R50+ViT.npz")
  save_as_google(params, npz)
  cfg = r50_b16.get_config(f"digits,{SIZE}")  # the recipe, another file
  cfg.init_weights = npz
  init = train_init.load_initial_weights(cfg)
  kw = train_init.model_kwargs(cfg, 10, init)
  trained = train_init.build_model(cfg.model_name, kw)
  assert trained.resnet == resnet.ResNetConfig((2, 1), **resnet.GOOGLE)
  assert trained.act == "gelu_tanh"
  assert sorted(trees.flatten(init.variables["params"])) == sorted(
      trees.flatten(params))  # our tree: Google's names


def test_a_name_must_agree_about_the_stem(tmp_path):
  _, params, _ = google_case("root")
  path = str(tmp_path / "R_Ti.npz")
  save_as_google(params, path)
  for name in ("vit_tiny_patch16_224", "vit_ti_16"):
    with pytest.raises(ValueError, match="without a ResNet stem, but these "
                       "weights have one"):
      formats.load_npz(path, name)
  model, _ = formats.load_npz(path, "vit_tiny_r_s16_p8_224")
  assert model.resnet.num_layers == ()
  with meta_device():
    m = timm.create_model("vit_tiny_patch16_224", depth=1)
  sd = {k: np.zeros(tuple(v.shape), np.float32)
        for k, v in m.state_dict().items()}
  with pytest.raises(ValueError, match="is a hybrid, with a ResNet stem"):
    formats.from_timm(sd, "vit_tiny_r_s16_p8_224")
