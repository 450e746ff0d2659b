"""Shared helpers of the parity tests: one tolerance check, random inputs
and random (perturbed) weights, tree comparison.

Parity is max |ours - ref| <= rel x max |ref| (the tolerance is relative to
the output's scale), with weights perturbed so that every parameter matters
(zero heads, unit LayerNorms and tiny LayerScales would hide a wrong map).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax import models
from vit_jax.weights import trees

REL = 1e-4


class Closeness(NamedTuple):
  err: float  # max |ours - ref|
  scale: float  # max |ref|

  @property
  def rel(self) -> float:
    return self.err / self.scale


def assert_close_rel(ours, ref, rel: float = REL, what: str = "logits"
                     ) -> Closeness:
  """max |ours - ref| <= rel * max |ref|; returns (err, scale)."""
  ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
  assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
  scale, err = float(np.abs(ref).max()), float(np.abs(ours - ref).max())
  assert scale > 0, f"{what}: reference is all zeros; the test would prove nothing"
  assert err <= rel * scale, (
      f"{what}: max abs diff {err:.3g} > {rel:g} x scale {scale:.3g}")
  return Closeness(err, scale)


def features_and_logits(model):
  """A jitted ``(variables, x) -> (forward_features, logits)``: one
  program, the logits by ``forward_head`` of the features."""
  def both(v, x):
    feats = model.apply(v, x, method=model.forward_features)
    return feats, model.apply(v, feats, method=model.forward_head)
  return jax.jit(both)


def assert_parity(got, want, rel: float, record_property, label: str):
  """(forward_features, logits) ``got`` within ``rel`` of ``want``'s; the
  logits' error recorded (``rel_err``) and printed with ``label``.
  Returns the logits' :class:`Closeness`."""
  f = assert_close_rel(got[0], want[0], rel, "forward_features")
  head = assert_close_rel(got[1], want[1], rel)
  record_property("rel_err", head.rel)
  print(f"\nPARITY {label}: logits rel {head.rel:.2g}, forward_features "
        f"rel {f.rel:.2g}")
  return head


def images(n=2, size=64, seed=0, height=None) -> np.ndarray:
  """NHWC float32 normalised-looking images (``height`` for non-square)."""
  return np.random.default_rng(seed).standard_normal(
      (n, height or size, size, 3)).astype(np.float32)


def torch_in(x):
  """NHWC numpy -> NCHW torch tensor."""
  import torch  # pylint: disable=import-outside-toplevel
  return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


def perturb_torch(module, seed=0, std=0.05, weights_only=True):
  """Adds noise to every parameter and persistent buffer of a torch module
  (in place): zero-initialised heads, unit LayerNorms, 1e-5 LayerScales,
  BatchNorm statistics all matter. The buffers a model computes and does not
  save (RoPE frequencies, Eva's fixed zero key bias; ``weights_only=False``
  perturbs those too) stay as the model defines them: no checkpoint can
  change them."""
  import torch  # pylint: disable=import-outside-toplevel
  g = torch.Generator().manual_seed(seed)
  if weights_only:
    tensors = [t for t in module.state_dict(keep_vars=True).values()
               if t.is_floating_point()]
  else:
    tensors = list(module.parameters()) + [
        b for b in module.buffers() if b.is_floating_point()]
  with torch.no_grad():
    for p in tensors:
      p.add_(torch.randn(p.shape, generator=g) * std)
  return module.eval()


def perturb(variables, seed=0, std=0.05):
  """Adds noise to every leaf of a variables tree (numpy float32)."""
  leaves, tdef = jax.tree_util.tree_flatten(variables)
  rng = np.random.default_rng(seed)
  leaves = [np.asarray(l, np.float32) +
            std * rng.standard_normal(np.shape(l)).astype(np.float32)
            for l in leaves]
  return jax.tree_util.tree_unflatten(tdef, leaves)


def random_ours(name="vit_ti_16", seed=0, size=64, **overrides):
  """Our model with every parameter random (no zero head / class token)."""
  model = models.get_model(name, **{"num_classes": 10, "num_layers": 3,
                                    **overrides})
  variables = init(model, size, seed)
  return model, perturb(variables, seed)


def init(model, size, seed=0, batch=1):
  """Random variables of ``model`` for ``size`` px: ``create_model``'s
  (:func:`vit_jax.weights.random_variables`: alike blocks drawn by the
  scanned model, compiled once for all of them; a 12-block model's
  ``jax.jit(model.init)`` compiles each block's initialisers again), else
  ``model.init`` on zeros, compiled (see :func:`apply`)."""
  if batch == 1 and models.pair(model.image_size or size) == models.pair(
      size):
    from vit_jax import weights  # pylint: disable=import-outside-toplevel
    return weights.random_variables(model, size, seed)
  x = jnp.zeros((batch, *models.pair(size), model.num_channels))
  return jax.jit(model.init)(jax.random.key(seed), x)


def apply(model, variables, x, **kw):
  """``model.apply(variables, x, train=False, **kw)`` as a numpy array,
  compiled: run eagerly, each op is an XLA program of its own, compiled
  for each new shape (tests/models/test_dynamic.py compiled 1015 programs,
  980 of them single ops from here; a 3-block model called at four sizes
  took 5.0-6.3 s of CPU eagerly, 2.1-2.3 s compiled, on an AMD Zen 1)."""
  fn = jax.jit(lambda v, x: model.apply(v, x, train=False, **kw))
  return np.asarray(fn(variables, jnp.asarray(x)))


def apply_with_features(model, variables, x):
  """(logits, ``forward_features``) of ``x`` as numpy arrays, from one
  compiled program: XLA computes their common trunk once, and one compile
  replaces two (the hybrids' ResNet stems: 12 % of their parity tests).
  The logits are ``forward_head`` of the features, as ``__call__``
  computes them: the model is traced once, not twice."""
  def both(module, x):  # __call__'s two halves, the model traced once
    features = module.forward_features(x, train=False)
    return module.forward_head(features, train=False), features
  fn = jax.jit(lambda v, x: model.apply(v, x, method=both))
  logits, features = fn(variables, jnp.asarray(x))
  return np.asarray(logits), np.asarray(features)


def tree_equal(a, b):
  fa, fb = trees.flatten(dict(a)), trees.flatten(dict(b))
  assert sorted(fa) == sorted(fb), (sorted(set(fa) ^ set(fb)))
  for k in fa:
    assert np.asarray(fa[k]).dtype == np.asarray(fb[k]).dtype, k
    np.testing.assert_array_equal(np.asarray(fa[k]), np.asarray(fb[k]),
                                  err_msg=k)


def random_timm(seed=0, num_classes=10, depth=3, name="vit_tiny_patch16_224",
                size=64, **kw):
  """timm's ``name`` (``depth`` blocks, ``size`` px) with random, perturbed
  weights."""
  import timm  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  torch.manual_seed(seed)
  m = timm.create_model(name, pretrained=False, num_classes=num_classes,
                        img_size=size, depth=depth, **kw)
  return perturb_torch(m, seed)


def parameter_counts(name: str):
  """(our model of timm's architecture ``name`` (scanned blocks), its
  parameter count (by ``eval_shape``: nothing allocated), timm's (its
  model on the meta device))."""
  import math  # pylint: disable=import-outside-toplevel
  from vit_jax.weights import verify  # pylint: disable=import-outside-toplevel
  m, _ = verify.timm_meta(name, depth=None)
  want = sum(p.numel() for p in m.parameters())
  model = models.get_model(name, scan_layers=True)
  size = models.pair(model.image_size)
  shapes = jax.eval_shape(lambda: model.init(
      jax.random.key(0), jnp.zeros((1, *size, 3)), train=False))
  got = sum(math.prod(s.shape) for s in jax.tree_util.tree_leaves(
      shapes["params"]))
  return model, got, want


def record_round_trip(model, variables, path: str):
  """Our architecture record of ``model`` builds the same model, and our
  safetensors file at ``path`` (no preprocessing in it: a GuessWarning on
  load) gives it back: returns (the record, the loaded model and
  variables)."""
  import pytest  # pylint: disable=import-outside-toplevel
  from vit_jax import formats, weights  # pylint: disable=import-outside-toplevel
  record = models.arch_record(model)
  assert models.arch_record(models.get_model(record)) == record
  formats.save_safetensors(variables, path, model=model)
  with pytest.warns(weights.GuessWarning, match="how images must be"):
    back = weights.load(path)  # our file without preprocessing
  assert models.arch_record(back.model) == record
  return record, back


def timm_reference(model, name: str, size, scale=None):
  """timm's ``model`` on random weights at the registry check's scales
  (:class:`vit_jax.weights.verify.RandomWeights`: LayerScale, biases,
  tokens far from timm's initial values), torch on one thread: (the model,
  its state dict, NHWC images, NCHW images of ``size``, timm's
  forward_features, timm's logits). ``scale``: ``{key: factor}`` applied
  to the random values (e.g. frequencies in turns of a radian)."""
  import torch  # pylint: disable=import-outside-toplevel
  from vit_jax.weights import verify  # pylint: disable=import-outside-toplevel
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    sd = verify.RandomWeights(size=1 << 20).state_dict(model.state_dict())
    for key, factor in (scale or {}).items():
      if key in sd:
        sd[key] = sd[key] * factor
    model.load_state_dict(sd, strict=True)
    x, xt = verify.inputs(name, model, size, batch=2)
    with torch.no_grad():
      feats = model.forward_features(xt).numpy()
      logits = model.forward_head(torch.from_numpy(feats)).numpy()
  finally:
    torch.set_num_threads(threads)
  return model, sd, x, xt, feats, logits


def timm_logits(m, x):
  import torch  # pylint: disable=import-outside-toplevel
  with torch.no_grad():
    return m(torch_in(x)).numpy()
