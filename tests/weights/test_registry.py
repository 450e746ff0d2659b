"""A name is listed only when verified: every timm architecture
``vit_jax.list_models()`` returns is built by timm (2 blocks where its
constructor takes ``depth``; the real widths, heads and heads' classes) on
random weights where every parameter matters, loaded through
``formats.from_timm(state_dict, name)``, and must give timm's logits within
1e-5 relative (float32, highest matmul precision); ``formats.to_timm`` of
ours must load into timm with ``strict=True`` and give them too
(:func:`vit_jax.weights.verify.verify_timm`, the check the table generator
runs before it lists a name).

Of the names whose architecture records differ only in their image size,
one runs at timm's input size, as does every name whose size is not a
multiple of its patch; the others on a 4x4 grid of patches (the same model
as the group's other small ones). NaFlex names take two images' patch dicts.
Models that resize their positions in forward (SAM, LingBot) and differ
from a narrower one only in widths and depths are built at timm's size and
fed 16x16 patches (``verify.plan``).
Our own variants (``vit_b_16`` ...) are torchvision's: test_parity.py.

Names timm has that vit_jax does not build are refused by name, saying
which feature is missing, wherever a name goes.
"""

import re

import pytest

import vit_jax
from vit_jax import formats, weights
from vit_jax.models import _timm_archs
from vit_jax.weights import layouts, pretrained, verify

timm = pytest.importorskip("timm")

PLAN = verify.plan(_timm_archs.ARCHS)


_WEIGHTS = {}  # once per process, whatever tests pytest-xdist sends it
_PLANNED = {c.name: c for c in PLAN}


@pytest.fixture
def random_weights():
  if "weights" not in _WEIGHTS:
    _WEIGHTS["weights"] = verify.RandomWeights()
  return _WEIGHTS["weights"]


def test_every_listed_name_is_planned():
  listed = vit_jax.list_models()
  timm_names = [n for n in listed if n in _timm_archs.ARCHS]
  ours = sorted(set(listed) - set(timm_names))
  assert ours == sorted(vit_jax.models.VARIANTS)  # torchvision's: test_parity
  assert sorted(c.name for c in PLAN) == sorted(timm_names)
  assert len(PLAN) > 150
  tagged = {n.split(".", 1)[0] for n in vit_jax.list_models(pretrained=True)}
  assert tagged <= set(listed)
  # The planned sizes: one name per record at timm's input size.
  native = {c.name for c in PLAN if not c.small}
  assert {"deit_base_patch16_224", "vit_so400m_patch14_siglip_384",
          "vit_7b_patch16_dinov3"} <= native
  assert "vit_base_patch16_384" not in native
  # Models that resize their positions in forward: the narrowest of a kind
  # at timm's size, the others built at it and fed 16x16 patches.
  resized = {c.name: c.grid for c in PLAN if c.grid}
  assert resized == {"samvit_large_patch16": 16, "samvit_huge_patch16": 16,
                     "vit_base_patch16_lingbot": 16,
                     "vit_large_patch16_lingbot": 16}
  assert {"samvit_base_patch16", "vit_small_patch16_lingbot",
          "vit_giant_patch16_lingbot"} <= native - set(resized)


# Slow as a whole (every listed name at its real width, one per record at
# timm's input size: the heaviest test of the suite), cheap per name.
# Each name its own check (pytest-xdist spreads them over its workers);
# a process's checks share their random weights.
@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in PLAN])
def test_listed_name_equals_timm(name, random_weights, record_property):
  check = _PLANNED[name]
  result = verify.verify_timm(name, small=check.small, grid=check.grid,
                              weights=random_weights)
  # Within 1e-5 of timm's float32 logits, or (deep ResNet stems, whose
  # float32 logits timm itself gets 2-4e-5 from its float64 ones) within
  # twice timm's own rounding error of the float64 logits.
  assert result.ok, result
  record_property("rel_err", result.rel)
  record_property("cpu_seconds", round(result.seconds, 2))


def test_the_check_fails_a_wrong_architecture(random_weights):
  """The check is not vacuous: a name that maps but computes something
  else (timm's post-norm blocks) is caught at the logits, and so is an
  epsilon off by a factor of 10 in every norm."""
  with pytest.raises(verify.NotVerified, match="logits.*differ"):
    verify.verify_timm(  # the weights without the name: pre-norm blocks
        "vit_base_patch16_rpn_224", small=True, weights=random_weights,
        load=lambda sd, name: formats.from_timm(sd))
  with pytest.raises(verify.NotVerified, match="logits.*differ"):
    verify.verify_timm(
        "vit_tiny_patch16_224", small=True, weights=random_weights,
        load=lambda sd, name: formats.from_timm(sd, name,
                                                layer_norm_eps=1e-5))


def test_computed_buffers_are_timms():
  """The meta-device build computes RoPE's buffers as timm's own build."""
  import torch  # pylint: disable=import-outside-toplevel
  for name in ("vit_small_patch16_dinov3", "eva02_tiny_patch14_224",
               "vit_pe_core_tiny_patch16_384",
               "vit_medium_patch16_rope_reg1_gap_256",
               "vit_small_patch16_rope_224"):
    m, _, kwargs = verify.random_timm(name, small=True)
    ref = timm.create_model(name, pretrained=False, **kwargs)
    own = dict(ref.named_buffers())
    for k, v in m.named_buffers():
      assert torch.equal(v, own[k]), (name, k)


# timm names of the families vit_jax maps that it refuses, and the feature
# the refusal must name.
REFUSED = {
    "vit_small_resnet26d_224": "CNN backbone other than BiT",
    "samvit_base_patch16_224": "without its conv neck",
    "vit_base_patch16_sapiens2": "a number per block (num_kv_heads)",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unverified_names_are_refused_by_name(name):
  feature = REFUSED[name]
  assert name in timm.list_models()
  assert name not in vit_jax.list_models()
  assert not vit_jax.list_models(f"{name}*", pretrained=True)
  with pytest.raises(ValueError, match=re.escape(feature)):
    vit_jax.create_model(name)
  with pytest.raises(weights.CheckpointError, match=re.escape(feature)):
    weights.load(name)
  with pytest.raises(ValueError, match=re.escape(feature)):
    pretrained.lookup(name + ".some_tag")
  with pytest.raises(ValueError, match=re.escape(feature)):
    layouts.refuse_unsupported_timm(name)
  import torch  # pylint: disable=import-outside-toplevel
  m, _ = verify.timm_meta(name, small=True)
  sd = {k: torch.zeros(v.shape, dtype=v.dtype)
        for k, v in m.state_dict().items()}
  with pytest.raises(ValueError, match=re.escape(feature)):
    formats.from_timm(sd, name)
