"""The NaFlex model (issue 22) on its own: the per-image resize of the
position grid against PyTorch's ``F.interpolate``, masked attention against
the plain formula (forward, gradient, the chunked path), padding that never
changes the valid tokens wherever it sits, a NaFlex dict against the NHWC
path on the same image, and jit / scan / remat / bfloat16 / the attention
implementations on masked batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compare import assert_close_rel, perturb
from vit_jax import models
from vit_jax.data import naflex as data_naflex
from vit_jax.models import interpolate, kernels, naflex

P = 8  # patch size of the test models
ARCH = dict(hidden_size=64, num_layers=2, num_heads=4, mlp_dim=128,
            patch_size=P, num_classes=5, classifier="map", act="gelu_tanh",
            naflex="bilinear_aa", naflex_grid=(6, 6))


@pytest.fixture(scope="module")
def siglip():
  """A small NaFlex SigLIP-like model (MAP head), every weight random."""
  model = models.get_model(ARCH)
  v = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 6 * P, 6 * P, 3)))
  return model, perturb(v, 0, std=0.1)


def _images(shapes, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((h * P, w * P, 3)).astype(np.float32)
          for h, w in shapes]


def _batch(imgs, seq):
  return data_naflex.collate([dict(zip(data_naflex.KEYS,
                                       data_naflex.patchify(x, P)))
                              for x in imgs], seq)


def _apply(model, v, x, **kw):
  """``model.apply`` jitted (cheaper than eager for a whole model)."""
  with jax.default_matmul_precision("highest"):
    return jax.jit(lambda v, x: model.apply(v, x, train=False, **kw))(
        v, jax.tree_util.tree_map(jnp.asarray, x))


# ---------------------------------------------------------------- resizes --

@pytest.mark.parametrize("kind, mode, aa, ac", [
    ("bilinear_aa", "bilinear", True, False),
    ("bicubic_aa", "bicubic", True, False),
    ("bilinear", "bilinear", False, False),
    ("bilinear", "bilinear", False, True)])
def test_resize_rows_equal_torch_interpolate(kind, mode, aa, ac):
  """The rows of every resize, computed for a traced output size inside
  jit, are PyTorch's (float32 arithmetic: within a few ulp)."""
  torch = pytest.importorskip("torch")
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel

  rows = jax.jit(lambda size, pos: interpolate.resize_weights(
      kind, 16, size, pos, ac, xp=jnp))
  for n_out in (1, 3, 7, 16, 23, 40):
    eye = torch.eye(16).reshape(16, 1, 1, 16)
    ref = F.interpolate(eye, size=(1, n_out), mode=mode, antialias=aa,
                        align_corners=ac)[:, 0, 0].numpy().T
    got = np.asarray(rows(jnp.int32(n_out), jnp.arange(n_out)))
    np.testing.assert_allclose(got, ref, rtol=0, atol=4e-6)
    np.testing.assert_allclose(
        interpolate.resize_weights(kind, 16, n_out, np.arange(n_out), ac),
        got, rtol=0, atol=1e-6)  # XLA may fuse (FMA): an ulp or two


def test_per_image_positions_equal_the_grid_resized():
  """Each patch's position row (traced sizes) is the row of the grid
  resized to its image's size (static matrices), square-cropped too."""
  grid = np.random.default_rng(0).standard_normal((16, 16, 8)).astype(
      np.float32)
  for kind, square, ac in (("bilinear_aa", False, False),
                           ("bicubic_aa", True, False),
                           ("bilinear", True, True)):
    for h, w in ((3, 5), (16, 16), (20, 2)):
      ys, xs = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
      coord = np.stack([ys, xs], -1).reshape(1, -1, 2)
      got = jax.jit(naflex.positions, static_argnums=(3, 4, 5))(
          jnp.asarray(grid), jnp.asarray(coord), jnp.asarray([[h, w]]), kind,
          square, ac)[0]
      want = naflex.grid_positions(jnp.asarray(grid), (h, w), kind, square,
                                   ac)
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


# ------------------------------------------------------ masked attention --

def _reference(q, k, v, mask, scale):
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale
  s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
  return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v)


@pytest.mark.parametrize("n", [12, 300])  # fused; chunked (> 256 keys)
def test_masked_attention_kernel_equals_the_formula(n):
  rng = np.random.default_rng(n)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 2, n, 8)), jnp.float32)
             for _ in range(3))
  mask = jnp.asarray(rng.random((2, n)) < 0.7)
  bias = naflex.attention_bias(mask)
  with jax.default_matmul_precision("highest"):
    got = kernels.attention(q, k, v, 0.3, bias)
    ref = _reference(q, k, v, mask, 0.3)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
    g = jax.grad(lambda *a: jnp.sum(kernels.attention(*a, 0.3, bias) ** 2),
                 argnums=(0, 1, 2))(q, k, v)
    r = jax.grad(lambda *a: jnp.sum(_reference(*a, mask, 0.3) ** 2),
                 argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g, r):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


@pytest.mark.parametrize("case", ["prefix", "holes", "empty row"])
def test_masked_attention_by_lengths_equals_the_mask(case):
  """kernels.masked_attention (cuDNN's path for a key mask: each row's valid
  keys moved first, their count as the key sequence length, odd lengths
  padded) computes what the mask computes, forward and q/k/v gradients
  (asked of XLA here), wherever the padding sits; a row without a valid
  key stays finite."""
  q = jax.random.normal(jax.random.key(0), (3, 12, 2, 8))  # 12 queries
  k, v = (jax.random.normal(jax.random.key(i), (3, 13, 2, 8))
          for i in (1, 2))  # 13 keys: odd
  w = jax.random.normal(jax.random.key(3), q.shape)
  counts = {"prefix": (13, 6, 1), "holes": (13, 13, 13),
            "empty row": (13, 0, 4)}[case]
  mask = np.arange(13)[None] < np.asarray(counts)[:, None]
  if case == "holes":
    rng = np.random.default_rng(0)
    mask = rng.random((3, 13)) < 0.5
    mask[:, 3] = True  # at least one each
  mask = jnp.asarray(mask)
  keep = np.asarray(jnp.any(mask, axis=-1))  # rows compared with the mask

  def plain(q, k, v):
    m = jnp.broadcast_to(mask[:, None, None, :], (3, 1, 12, 13))
    return jax.nn.dot_product_attention(q, k, v, mask=m, implementation="xla")
  lengths = lambda q, k, v: kernels.masked_attention(  # noqa: E731
      q, k, v, mask, implementation="xla")
  loss = lambda f: lambda *a: jnp.sum((f(*a) * w)[keep])  # noqa: E731
  with jax.default_matmul_precision("highest"):
    got = lengths(q, k, v)
    np.testing.assert_allclose(got[keep], plain(q, k, v)[keep], rtol=0,
                               atol=1e-6)
    assert np.isfinite(np.asarray(got)).all()
    for a, b in zip(jax.grad(loss(lengths), argnums=(0, 1, 2))(q, k, v),
                    jax.grad(loss(plain), argnums=(0, 1, 2))(q, k, v)):
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_cudnn_reads_a_naflex_mask_as_sequence_lengths(siglip, monkeypatch):
  """With cuDNN attention a NaFlex batch runs cuDNN with key sequence
  lengths (which its training kernels take at odd lengths; a mask as a
  bias, they refuse), its padding last or first alike. Here 'cuDNN' is
  XLA's attention scaled by 1.001, so the logits tell that it ran."""
  model, v = siglip
  real = jax.nn.dot_product_attention
  calls = []

  def dpa(*args, implementation=None, **kw):
    calls.append((implementation, kw.get("key_value_seq_lengths") is not None,
                  kw.get("mask") is not None))
    if implementation == "cudnn":
      return real(*args, implementation="xla", **kw) * 1.001
    return real(*args, implementation=implementation, **kw)
  monkeypatch.setattr(jax.nn, "dot_product_attention", dpa)
  cudnn, xla = (model.clone(attention_impl=a) for a in ("cudnn", "xla"))
  last = _batch(_images([(3, 5), (6, 2)]), 21)  # 21 tokens: odd
  first = {k: np.roll(x, 6, axis=1) for k, x in last.items()}  # padding first
  for batch in (last, first):
    calls.clear()
    got, want = _apply(cudnn, v, batch), _apply(xla, v, batch)
    assert not np.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert_close_rel(got, want, rel=2e-2, what="cuDNN by lengths")
    assert set(c for c in calls if c[0] == "cudnn") == {("cudnn", True, False)}
  x = jax.tree_util.tree_map(jnp.asarray, last)
  g = jax.jit(jax.grad(lambda p: jnp.sum(cudnn.apply(
      {"params": p}, x, train=True) ** 2)))(v["params"])
  assert all(np.isfinite(np.asarray(t)).all()
             for t in jax.tree_util.tree_leaves(g))


# ------------------------------------------------------------ the model --

def test_padding_never_changes_the_valid_tokens(siglip):
  """The same two images laid out three ways: valid patches first padded
  to 20 (timm's collator); padded to 32 with the padding first, its patches
  and coordinates garbage; every token shuffled. Valid tokens and pooled
  outputs are the same."""
  model, v = siglip
  imgs = _images([(3, 5), (6, 2)])
  a = _batch(imgs, 20)
  rng = np.random.default_rng(1)
  b = {k: np.zeros((2, 32) + x.shape[2:], x.dtype) for k, x in a.items()}
  for i in range(2):
    n = int(a["patch_valid"][i].sum())
    b["patches"][i] = rng.standard_normal(b["patches"][i].shape) * 50
    b["patch_coord"][i] = rng.integers(0, 40, (32, 2))
    for key in data_naflex.KEYS:
      b[key][i, 32 - n:] = a[key][i, :n]
  perm = rng.permutation(20)
  c = {k: x[:, perm] for k, x in a.items()}
  fa = _apply(model, v, a, method=model.forward_features)
  out = [_apply(model, v, x) for x in (a, b, c)]
  assert_close_rel(out[1], out[0], rel=1e-5, what="logits, padding first")
  assert_close_rel(out[2], out[0], rel=1e-5, what="logits, shuffled")
  for x in (b, c):
    f = _apply(model, v, x, method=model.forward_features)
    for i in range(2):
      mine = np.asarray(f["patches"][i])[x["patch_valid"][i]]
      ref = np.asarray(fa["patches"][i])[a["patch_valid"][i]]
      # Put both in (row, column) order.
      key = lambda d, j: np.lexsort(d["patch_coord"][j][d["patch_valid"][j]].T[::-1])  # noqa: E731
      assert_close_rel(mine[key(x, i)], ref[key(a, i)], rel=1e-5,
                       what="valid tokens")


def test_a_naflex_dict_equals_the_image(siglip):
  """One image as a NaFlex dict (padded) and as an NHWC batch: the same
  features and logits (the grid resized by traced rows vs static
  matrices)."""
  model, v = siglip
  (img,) = _images([(4, 7)])
  d = _batch([img], 40)
  feats = _apply(model, v, d, method=model.forward_features)
  ref = _apply(model, v, img[None], method=model.forward_features)
  assert_close_rel(np.asarray(feats["patches"])[0, :28], ref[0], rel=1e-5)
  assert_close_rel(_apply(model, v, d), _apply(model, v, img[None]),
                   rel=1e-5)


def test_jit_compiles_once_per_sequence_length(siglip):
  model, v = siglip
  fn = jax.jit(lambda v, x: model.apply(v, x, train=False))
  fn(v, _batch(_images([(3, 5), (6, 2)]), 24))
  fn(v, _batch(_images([(1, 9), (4, 4)], seed=2), 24))  # other shapes
  assert fn._cache_size() == 1  # pylint: disable=protected-access
  fn(v, _batch(_images([(5, 5)]), 24))  # another batch size
  fn(v, _batch(_images([(3, 5), (6, 2)]), 32))  # another length
  assert fn._cache_size() == 3  # pylint: disable=protected-access


def test_scan_remat_bfloat16_and_every_attention(siglip):
  """Masked batches through scan + remat (gradients too), the XLA and
  materialised-weights attention, and bfloat16: the same function."""
  model, v = siglip
  batch = _batch(_images([(3, 5), (6, 2)]), 20)
  ref = _apply(model, v, batch)
  from vit_jax.weights import trees  # pylint: disable=import-outside-toplevel
  scanned = model.clone(scan_layers=True, remat_policy="full")
  sv = trees.stack_layers(v)
  assert_close_rel(_apply(scanned, sv, batch), ref, rel=1e-5, what="scan")
  # (On CPU the default is the 'matmul' kernel.)
  assert_close_rel(_apply(model.clone(attention_impl="xla"), v, batch), ref,
                   rel=1e-5, what="xla")
  sown, state = _apply(model.clone(sow_attention_weights=True), v, batch,
                       mutable=["intermediates"])
  assert_close_rel(sown, ref, rel=1e-5, what="weights")
  w = state["intermediates"]["Transformer"]["encoderblock_0"][
      "MultiHeadDotProductAttention_0"]["attention_weights"][0]
  assert float(jnp.max(w[0, :, :, 15:])) == 0.0  # image 0: 15 valid patches
  bf = _apply(model.clone(dtype=jnp.bfloat16), v, batch)
  assert_close_rel(np.asarray(bf, np.float32), ref, rel=5e-2, what="bf16")

  def loss(params, m, x):
    return jnp.sum(m.apply({"params": params}, x, train=True,
                           rngs={"dropout": jax.random.key(0)}) ** 2)

  x = jax.tree_util.tree_map(jnp.asarray, batch)
  g = jax.jit(jax.grad(loss), static_argnums=1)(v["params"], model, x)
  gs = jax.jit(jax.grad(loss), static_argnums=1)(sv["params"], scanned, x)
  pos = ("Transformer", "posembed_input", "pos_grid")
  a, b = g, gs
  for k in pos:
    a, b = a[k], b[k]
  assert float(jnp.abs(a).max()) > 0  # the grid learns
  assert_close_rel(b, a, rel=1e-4, what="grid gradient (scan + remat)")


def test_intermediates_and_errors(siglip):
  model, v = siglip
  batch = _batch(_images([(3, 5), (6, 2)]), 20)
  final, inter = _apply(model, v, batch, method=model.forward_intermediates,
                        indices=1, output_fmt="NLC", norm=True)
  feats = _apply(model, v, batch, method=model.forward_features)
  np.testing.assert_allclose(final["patches"], feats["patches"], atol=1e-6)
  np.testing.assert_array_equal(final["patch_valid"], batch["patch_valid"])
  np.testing.assert_allclose(inter[0], feats["patches"], atol=1e-5)
  # The errors (raised while tracing: shapes only, nothing compiled).
  def trace(m, x, **kw):
    init = lambda: m.init(jax.random.key(0), jnp.zeros((1, 6 * P, 6 * P, 3)))  # noqa: E731
    return jax.eval_shape(lambda x: m.apply(init(), x, train=False, **kw), x)

  with pytest.raises(ValueError, match="output_fmt='NLC'"):
    trace(model, batch, method=model.forward_intermediates)
  with pytest.raises(ValueError, match="needs a NaFlex model"):
    trace(models.get_model(dict(ARCH, naflex=None)), batch)
  bad = dict(batch, patches=batch["patches"][..., :-3])
  with pytest.raises(ValueError, match=r"'patches' must be \(batch, "
                     r"sequence, 192\)"):
    trace(model, bad)
  with pytest.raises(ValueError, match="keys"):
    trace(model, {"patches": batch["patches"]})
  with pytest.raises(ValueError, match="naflex='nearest'"):
    trace(models.get_model(dict(ARCH, naflex="nearest")), batch)
