"""CPU fast paths compute the same functions: the attention core ('matmul',
hand-written backward) as jax.nn.dot_product_attention, and the bfloat16
matmuls with float32 accumulation as plain ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import kernels, models


def _qkv(b=2, n=7, h=3, hd=8, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.normal(k, (b, n, h, hd), dtype) for k in ks]


def _core(q, k, v):
  scale = 1.0 / np.sqrt(q.shape[-1])
  oh = kernels.attention(
      *(kernels.head_major(t) for t in (q, k, v)), scale)
  return jnp.transpose(oh, (0, 2, 1, 3))


def test_core_equals_dot_product_attention_forward_and_backward():
  q, k, v = _qkv()
  ref = jax.nn.dot_product_attention(q, k, v, implementation="xla")
  np.testing.assert_allclose(_core(q, k, v), ref, rtol=1e-6, atol=1e-6)

  w = jax.random.normal(jax.random.key(9), ref.shape)
  loss = lambda f: lambda *a: jnp.sum(f(*a) * w)
  g_ref = jax.grad(loss(lambda *a: jax.nn.dot_product_attention(
      *a, implementation="xla")), argnums=(0, 1, 2))(q, k, v)
  g = jax.grad(loss(_core), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_core_bfloat16_stays_close_to_float32():
  q, k, v = _qkv(dtype=jnp.bfloat16)
  out = _core(q, k, v)
  assert out.dtype == jnp.bfloat16
  ref = _core(*(t.astype(jnp.float32) for t in (q, k, v)))
  np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=3e-2)
  g = jax.grad(lambda q: jnp.sum(_core(q, k, v).astype(jnp.float32)))(q)
  assert g.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(g)))


@pytest.mark.parametrize("impl", ["matmul", "xla"])
def test_model_logits_and_grads_do_not_depend_on_impl(impl):
  kw = dict(num_layers=2, num_classes=4)
  ref_model = models.get_model("vit_ti_16", attention_impl="xla", **kw)
  model = models.get_model("vit_ti_16", attention_impl=impl, **kw)
  variables = models.init_params(ref_model, 32)
  variables = jax.tree_util.tree_map(
      lambda a: a + 0.05 * jnp.cos(jnp.arange(a.size).reshape(a.shape)),
      variables)
  x = jax.random.normal(jax.random.key(1), (2, 32, 32, 3))
  np.testing.assert_allclose(model.apply(variables, x),
                             ref_model.apply(variables, x),
                             rtol=1e-5, atol=1e-5)
  loss = lambda m: lambda p: jnp.sum(m.apply({"params": p}, x) ** 2)
  g = jax.grad(loss(model))(variables["params"])
  g_ref = jax.grad(loss(ref_model))(variables["params"])
  for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_sown_weights_and_attention_dropout_still_work():
  model = models.get_model("vit_ti_16", num_layers=1, num_classes=3,
                           sow_attention_weights=True,
                           attention_dropout_rate=0.5)
  variables = jax.tree_util.tree_map(lambda a: a + 0.1,
                                     models.init_params(model, 32))
  x = jax.random.normal(jax.random.key(2), (2, 32, 32, 3))
  _, state = model.apply(variables, x, mutable=["intermediates"])
  leaves = jax.tree_util.tree_leaves_with_path(state)
  weights = [a for p, a in leaves if "attention_weights" in jax.tree_util.keystr(p)]
  assert weights and weights[0].shape == (2, 3, 5, 5)
  np.testing.assert_allclose(jnp.sum(weights[0], -1), 1.0, rtol=1e-5)
  a = model.apply(variables, x, train=True, rngs={"dropout": jax.random.key(0)})
  b = model.apply(variables, x, train=True, rngs={"dropout": jax.random.key(1)})
  assert not np.allclose(a, b)


def test_low_precision_dense_accumulates_in_float32_forward_and_backward():
  kx, kw, kb, kg = jax.random.split(jax.random.key(3), 4)
  x = jax.random.normal(kx, (2, 5, 64), jnp.bfloat16)
  w = jax.random.normal(kw, (64, 32), jnp.float32)   # float32 parameters
  b = jax.random.normal(kb, (32,), jnp.float32)
  g = jax.random.normal(kg, (2, 5, 32), jnp.bfloat16)
  f32 = lambda t: t.astype(jnp.float32)
  w16 = f32(w.astype(jnp.bfloat16))  # what the bf16 GEMM sees
  dense = kernels.dense
  y, vjp = jax.vjp(dense, x, w, b)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(f32(y), f32(x) @ w16 + b, rtol=1e-2, atol=3e-2)
  dx, dw, db = vjp(g)
  assert dx.dtype == jnp.bfloat16
  assert dw.dtype == db.dtype == jnp.float32  # no bf16 rounding of grads
  np.testing.assert_allclose(f32(dx), f32(g) @ w16.T, rtol=2e-2, atol=5e-2)
  np.testing.assert_allclose(
      dw, f32(x).reshape(-1, 64).T @ f32(g).reshape(-1, 32), rtol=1e-5,
      atol=1e-4)
  np.testing.assert_allclose(db, f32(g).reshape(-1, 32).sum(0), rtol=1e-6,
                             atol=1e-5)
  # A float32 hidden output (the MLP's, before GELU) keeps float32.
  assert dense(x, w, b, jnp.float32).dtype == jnp.float32
  # float32 inputs take the plain path.
  np.testing.assert_allclose(dense(f32(x), w, b), f32(x) @ w + b, rtol=1e-6)


def test_bfloat16_model_stays_close_to_float32():
  kw = dict(num_layers=2, num_classes=4)
  m32 = models.get_model("vit_ti_16", **kw)
  m16 = models.get_model("vit_ti_16", dtype=jnp.bfloat16, **kw)
  variables = jax.tree_util.tree_map(
      lambda a: a + 0.05 * jnp.cos(jnp.arange(a.size).reshape(a.shape)),
      models.init_params(m32, 32))
  x = jax.random.normal(jax.random.key(4), (2, 32, 32, 3))
  out = m16.apply(variables, x)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(out.astype(jnp.float32), m32.apply(variables, x),
                             atol=5e-2)
  loss = lambda m: lambda p: jnp.sum(
      m.apply({"params": p}, x).astype(jnp.float32) ** 2)
  g16 = jax.grad(loss(m16))(variables["params"])
  g32 = jax.grad(loss(m32))(variables["params"])
  scale = max(float(jnp.abs(b).max()) for b in jax.tree_util.tree_leaves(g32))
  for a, b in zip(jax.tree_util.tree_leaves(g16), jax.tree_util.tree_leaves(g32)):
    assert a.dtype == jnp.float32
    # bf16 noise relative to the leaf's size (the key bias's true gradient
    # is zero: softmax ignores it, so there only the noise floor is checked).
    tol = 0.05 * max(float(jnp.abs(b).max()), 1e-2 * scale)
    np.testing.assert_allclose(a, b, atol=tol)


def test_long_sequences_take_the_chunked_path_with_the_same_result():
  # 300 keys > _FUSED_ATTENTION_MAX_KEYS: chunks of (batch, head) pairs and
  # exponentials recomputed in the backward pass.
  q, k, v = _qkv(b=2, n=300, h=3, hd=8, seed=5)
  assert kernels.attention_chunks(
      kernels.head_major(q), kernels.head_major(k)) is not None
  ref = jax.nn.dot_product_attention(q, k, v, implementation="xla")
  np.testing.assert_allclose(_core(q, k, v), ref, rtol=1e-5, atol=1e-6)
  w = jax.random.normal(jax.random.key(6), ref.shape)
  g_ref = jax.grad(lambda *a: jnp.sum(jax.nn.dot_product_attention(
      *a, implementation="xla") * w), argnums=(0, 1, 2))(q, k, v)
  g = jax.grad(lambda *a: jnp.sum(_core(*a) * w), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend, dtype, head_dim, kw, want", [
    ("cpu", jnp.float32, 64, {}, "matmul"),
    ("cpu", jnp.bfloat16, 64, {}, "matmul"),
    ("gpu", jnp.bfloat16, 64, {}, "cudnn"),
    ("gpu", jnp.float16, 128, {}, "cudnn"),
    ("gpu", jnp.float32, 64, {}, "xla"),  # cuDNN's fused kernels: half only
    ("gpu", jnp.bfloat16, 72, {}, "cudnn"),  # so400m: 72 = 9 x 8
    ("gpu", jnp.bfloat16, 60, {}, "xla"),  # head_dim not a multiple of 8...
    ("gpu", jnp.bfloat16, 256, {}, "xla"),  # ...or above 128
    ("tpu", jnp.bfloat16, 64, {}, "xla"),
    ("gpu", jnp.bfloat16, 64, dict(dropout=True), "weights"),
    ("gpu", jnp.bfloat16, 64, dict(sow_weights=True), "weights"),
    ("cpu", jnp.float32, 64, dict(requested="xla"), "xla"),
    ("gpu", jnp.bfloat16, 64, dict(requested="matmul"), "matmul"),
])
def test_attention_choice_per_backend(backend, dtype, head_dim, kw, want):
  """What each backend would run, asked on a CPU machine."""
  assert kernels.choose_attention(backend, dtype, head_dim, **kw) == want


def test_unknown_attention_impl_is_named():
  with pytest.raises(ValueError, match="attention_impl='flash'"):
    kernels.choose_attention("gpu", jnp.bfloat16, 64, requested="flash")
