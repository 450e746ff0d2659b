"""CPU fast paths compute the same functions: the attention core ('matmul',
hand-written backward) as jax.nn.dot_product_attention, and the bfloat16
matmuls with float32 accumulation as plain ones."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax.models import kernels, layers
from vit_jax import models

import compare


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
  np.testing.assert_allclose(jax.jit(model.apply)(variables, x),
                             jax.jit(ref_model.apply)(variables, x),
                             rtol=1e-5, atol=1e-5)
  loss = lambda m: lambda p: jnp.sum(m.apply({"params": p}, x) ** 2)
  g = jax.jit(jax.grad(loss(model)))(variables["params"])
  g_ref = jax.jit(jax.grad(loss(ref_model)))(variables["params"])
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


# The kernel gradient transposes the narrower of x and g on CPU: both
# branches; 'gpu' takes the plain-dot backward (it runs on any backend).
# A CPU without bf16 arithmetic (AVX2: Zen 3) takes the 'f32_cpu' form:
# tested on every CPU by telling the kernels the CPU has none.
@pytest.mark.parametrize("backend, bf16_hardware", [
    ("cpu", True), ("cpu", False), ("gpu", None)])
@pytest.mark.parametrize("k_in, n_out", [(64, 32), (32, 64)])
def test_low_precision_dense_accumulates_in_float32_forward_and_backward(
    k_in, n_out, backend, bf16_hardware, monkeypatch):
  if bf16_hardware is not None:
    monkeypatch.setattr(kernels, "cpu_has_bf16", lambda: bf16_hardware)
  assert kernels.choose_dense(backend, jnp.bfloat16) == {
      True: "low_cpu", False: "f32_cpu", None: "low"}[bf16_hardware]
  kx, kw, kb, kg = jax.random.split(jax.random.key(3), 4)
  x = jax.random.normal(kx, (2, 5, k_in), jnp.bfloat16)
  w = jax.random.normal(kw, (k_in, n_out), jnp.float32)  # float32 parameters
  b = jax.random.normal(kb, (n_out,), jnp.float32)
  g = jax.random.normal(kg, (2, 5, n_out), jnp.bfloat16)
  f32 = lambda t: t.astype(jnp.float32)
  w16 = f32(w.astype(jnp.bfloat16))  # what the bf16 GEMM sees
  dense = functools.partial(kernels.dense, backend=backend)
  y, vjp = jax.vjp(dense, x, w, b)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_allclose(f32(y), f32(x) @ w16 + b, rtol=1e-2, atol=3e-2)
  dx, dw, db = vjp(g)
  assert dx.dtype == jnp.bfloat16
  assert dw.dtype == db.dtype == jnp.float32  # no bf16 rounding of grads
  np.testing.assert_allclose(f32(dx), f32(g) @ w16.T, rtol=2e-2, atol=5e-2)
  np.testing.assert_allclose(
      dw, f32(x).reshape(-1, k_in).T @ f32(g).reshape(-1, n_out), rtol=1e-5,
      atol=1e-4)
  np.testing.assert_allclose(db, f32(g).reshape(-1, n_out).sum(0), rtol=1e-6,
                             atol=1e-5)
  # A float32 hidden output (the MLP's, before GELU) keeps float32.
  assert dense(x, w, b, jnp.float32).dtype == jnp.float32
  # float32 inputs take the plain path.
  np.testing.assert_allclose(dense(f32(x), w, b), f32(x) @ w + b, rtol=1e-6)


@pytest.mark.parametrize("bf16_hardware", [True, False])
def test_bfloat16_model_stays_close_to_float32(bf16_hardware, monkeypatch):
  monkeypatch.setattr(kernels, "cpu_has_bf16", lambda: bf16_hardware)
  kw = dict(num_layers=2, num_classes=4)
  m32 = models.get_model("vit_ti_16", **kw)
  m16 = models.get_model("vit_ti_16", dtype=jnp.bfloat16, **kw)
  variables = jax.tree_util.tree_map(
      lambda a: a + 0.05 * jnp.cos(jnp.arange(a.size).reshape(a.shape)),
      models.init_params(m32, 32))
  x = jax.random.normal(jax.random.key(4), (2, 32, 32, 3))
  out = jax.jit(m16.apply)(variables, x)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(out.astype(jnp.float32),
                             jax.jit(m32.apply)(variables, x), atol=5e-2)
  loss = lambda m: lambda p: jnp.sum(
      m.apply({"params": p}, x).astype(jnp.float32) ** 2)
  g16 = jax.jit(jax.grad(loss(m16)))(variables["params"])
  g32 = jax.jit(jax.grad(loss(m32)))(variables["params"])
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


def _fused_computations(hlo: str) -> dict:
  """name -> body of each computation in an HLO module's text."""
  out, name = {}, None
  for line in hlo.splitlines():
    m = re.match(r"^%?([\w.\-]+) .*\{$", line)
    if m and not line.startswith(" "):
      name, out[m.group(1)] = m.group(1), []
    elif name is not None and line.startswith("  "):
      out[name].append(line)
  return {k: "\n".join(v) for k, v in out.items()}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU layout")
def test_cpu_attention_products_share_a_fusion_with_a_row_sum():
  """XLA:CPU's YNNPACK runs a batched (N, N) x (N, hd) product alone on one
  core and, with a reduction in its fusion, on all of them: e v (forward)
  and ds k (backward) each carry a row sum of e that nothing else uses,
  and p^T do and ds^T q (dv, dk; every dtype) are row-major products of
  transposed copies, each with a row sum of its copy (times zero).
  (XLA fuses the reduction from about 24 (batch, head) blocks of ViT-Ti's
  197 x 64 on, 12 not: checked here at ViT-Ti/16's batch 16, 48.)"""
  q, k, v, g = (kernels.head_major(t) for t in _qkv(b=16, n=197, h=3, hd=64)
                + _qkv(b=16, n=197, h=3, hd=64, seed=1)[:1])

  def fwd_bwd(q, k, v, g):
    o, vjp = jax.vjp(lambda *a: kernels.attention(*a, 0.125), q, k, v)
    return o, vjp(g)

  hlo = jax.jit(fwd_bwd).lower(q, k, v, g).compile().as_text()
  comps = _fused_computations(hlo)
  ynn = re.findall(r"kind=kCustom, calls=%([\w.\-]+).*__ynn_fusion", hlo)
  if not ynn:
    pytest.skip("this XLA:CPU does not use YNNPACK")
  # the (G, N, hd) outputs of products contracting over the N keys
  products = [c for c in ynn if re.search(
      r"f32\[48,197,64\]\S* dot\(.*lhs_contracting_dims=\{2\}", comps[c])]
  assert len(products) == 4, (ynn, products)  # e v, ds k, p^T do, ds^T q
  for c in products:
    assert " reduce(" in comps[c], comps[c]
  # and no product contracts over rows (the Eigen dot it replaced)
  assert not re.search(r"dot\(.*lhs_contracting_dims=\{1\}", hlo), hlo


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


@pytest.mark.parametrize("backend, dtype, bf16_hardware, want", [
    ("cpu", jnp.float32, True, "plain_cpu"),
    ("cpu", jnp.float32, False, "plain_cpu"),
    ("cpu", jnp.bfloat16, True, "low_cpu"),
    ("cpu", jnp.float16, True, "low_cpu"),
    ("cpu", jnp.bfloat16, False, "f32_cpu"),
    ("cpu", jnp.float16, False, "f32_cpu"),
    ("gpu", jnp.bfloat16, False, "low"),
    ("cuda", jnp.float16, True, "low"),
    ("tpu", jnp.bfloat16, True, "low"),
    ("gpu", jnp.float32, True, "plain"),
    ("tpu", jnp.float32, True, "plain"),
])
def test_dense_choice_per_backend_and_cpu(backend, dtype, bf16_hardware,
                                          want):
  """Which dense form each backend (and a CPU with or without bf16
  arithmetic) would run, asked on whatever machine runs the test."""
  assert kernels.choose_dense(backend, dtype, bf16_hardware) == want


def test_bf16_without_bf16_hardware_runs_float32_gemms(monkeypatch):
  """On an AVX2-only CPU the bf16 dense layer computes its GEMMs in float32
  on the bf16 values: the same products as the bf16 path (to bf16
  rounding), float32 parameter gradients, and one warning that says so."""
  import warnings  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 7, 48)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((48, 40)) * 0.1, jnp.float32)
  b = jnp.asarray(rng.standard_normal((40,)), jnp.float32)

  def run():
    f = lambda x, w, b: kernels.dense(x, w, b, backend="cpu").astype(  # noqa: E731
        jnp.float32).sum()
    return kernels.dense(x, w, b, backend="cpu"), jax.grad(f, (0, 1, 2))(
        x, w, b)

  monkeypatch.setattr(kernels, "cpu_has_bf16", lambda: True)
  y_low, g_low = run()
  monkeypatch.setattr(kernels, "cpu_has_bf16", lambda: False)
  monkeypatch.setattr(kernels, "_WARNED", [])
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    y32, g32 = run()
    run()
  said = [w for w in seen if "without bf16 arithmetic" in str(w.message)]
  assert len(said) == 1 and "dtype=float32" in str(said[0].message)
  assert y32.dtype == jnp.bfloat16 and g32[1].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(y32, np.float32),
                             np.asarray(y_low, np.float32), rtol=1e-2,
                             atol=1e-2)
  for a, c in zip(g32, g_low):
    np.testing.assert_allclose(np.asarray(a, np.float32),
                               np.asarray(c, np.float32), rtol=2e-2, atol=2e-2)
  jaxpr = str(jax.make_jaxpr(lambda x: kernels.dense(x, w, b, backend="cpu"))(
      x))
  assert "bf16" not in jaxpr.split("dot_general")[1].split("\n")[0]


def test_dense_backward_layout_per_backend(monkeypatch):
  """The CPU form materialises a transpose for the kernel gradient (XLA:CPU's
  bf16 library takes only row-major GEMMs); the form for other backends
  hands the transposed contraction to the dot and copies nothing. Both keep
  every GEMM's operands bf16 (a CPU with bf16 arithmetic)."""
  monkeypatch.setattr(kernels, "cpu_has_bf16", lambda: True)
  x = jnp.zeros((2, 5, 32), jnp.bfloat16)
  w, b = jnp.zeros((32, 64)), jnp.zeros((64,))

  def grad_jaxpr(backend):
    loss = lambda x, w, b: kernels.dense(x, w, b, backend=backend).astype(
        jnp.float32).sum()
    return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, w, b)

  def eqns(jaxpr):
    for e in jaxpr.eqns:
      yield e
      for sub in jax.extend.core.jaxprs_in_params(e.params):
        yield from eqns(sub)

  for backend, transposes in (("cpu", 1), ("gpu", 0)):
    found = list(eqns(grad_jaxpr(backend).jaxpr))
    dots = [e for e in found if e.primitive.name == "dot_general"]
    assert len(dots) == 3
    assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    assert sum(e.primitive.name == "transpose" for e in found) == transposes


@pytest.mark.parametrize("k_in, n_out", [(24, 40), (40, 24), (16, 16)])
def test_float32_cpu_dense_gradients_are_row_major_gemms(k_in, n_out):
  """float32 on CPU ('plain_cpu'): the same value bit for bit as
  ``x @ kernel + bias``, the gradients of autodiff's, and a backward whose
  GEMMs all contract the last axis of their left operand (the kernel
  gradient from one transposed copy of the narrower of x and g), where
  autodiff contracts the (tokens, K) activations over their rows."""
  x = jax.random.normal(jax.random.key(30), (3, 7, k_in))
  w = jax.random.normal(jax.random.key(31), (k_in, n_out))
  b = jax.random.normal(jax.random.key(32), (n_out,))
  c = jax.random.normal(jax.random.key(33), (3, 7, n_out))
  assert kernels.choose_dense("cpu", jnp.float32) == "plain_cpu"
  ours = lambda x, w, b: kernels.dense(x, w, b, backend="cpu")
  auto = lambda x, w, b: x @ w + b
  np.testing.assert_array_equal(ours(x, w, b), auto(x, w, b))
  loss = lambda f: lambda *a: jnp.sum(f(*a) * c)
  g_ours = jax.grad(loss(ours), argnums=(0, 1, 2))(x, w, b)
  g_auto = jax.grad(loss(auto), argnums=(0, 1, 2))(x, w, b)
  x64 = np.asarray(x, np.float64).reshape(-1, k_in)
  want_dw = x64.T @ np.asarray(c, np.float64).reshape(-1, n_out)
  np.testing.assert_allclose(g_ours[1], want_dw, rtol=1e-5, atol=1e-5)
  for a, r in zip(g_ours, g_auto):
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5)

  def dots(f):
    jaxpr = jax.make_jaxpr(jax.grad(loss(f), argnums=(0, 1)))(x, w, b)

    def walk(j):
      for e in j.eqns:
        yield e
        for sub in jax.extend.core.jaxprs_in_params(e.params):
          yield from walk(sub)
    return [e for e in walk(jaxpr.jaxpr) if e.primitive.name == "dot_general"]

  def contracts_last(e):
    (lhs_c, _), _ = e.params["dimension_numbers"]
    return tuple(lhs_c) == (e.invars[0].aval.ndim - 1,)

  assert len(dots(ours)) == 3 and all(contracts_last(e) for e in dots(ours))
  assert not all(contracts_last(e) for e in dots(auto))


def test_unknown_attention_impl_is_named():
  with pytest.raises(ValueError, match="attention_impl='flash'"):
    kernels.choose_attention("gpu", jnp.bfloat16, 64, requested="flash")


@pytest.mark.parametrize("n", [7, 300])  # one fused block; chunked
def test_bfloat16_attention_gradients_match_float32(n):
  """The bf16 backward pass (transposed dv / dk products from copies) is
  the float32 one up to bf16 rounding, on both the fused and the chunked
  path."""
  q, k, v = _qkv(b=2, n=n, h=3, hd=8, seed=7)
  w = jax.random.normal(jax.random.key(8), q.shape)
  grad = lambda *a: jax.grad(lambda *t: jnp.sum(
      _core(*t).astype(jnp.float32) * w), argnums=(0, 1, 2))(*a)
  g32 = grad(q, k, v)
  g16 = grad(*(t.astype(jnp.bfloat16) for t in (q, k, v)))
  for a, b in zip(g16, g32):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_allclose(a.astype(jnp.float32), b,
                               atol=0.03 * float(jnp.abs(b).max()))


@pytest.mark.parametrize("use_scale, use_bias", [(True, True), (False, True),
                                                 (True, False)])
def test_layer_norm_equals_flax_forward_and_backward(use_scale, use_bias):
  kw = dict(epsilon=1e-6, use_scale=use_scale, use_bias=use_bias)
  x = 3.0 * jax.random.normal(jax.random.key(10), (2, 7, 48)) + 1.5
  w = jax.random.normal(jax.random.key(11), x.shape)
  ref, ours = nn.LayerNorm(**kw), layers.LayerNorm(**kw)
  params = ref.init(jax.random.key(12), x)
  assert (jax.tree_util.tree_structure(params) ==
          jax.tree_util.tree_structure(ours.init(jax.random.key(12), x)))
  params = jax.tree_util.tree_map(
      lambda a: a + 0.3 * jnp.sin(jnp.arange(a.size)).reshape(a.shape),
      params)
  np.testing.assert_allclose(ours.apply(params, x), ref.apply(params, x),
                             rtol=1e-5, atol=1e-5)
  grad = lambda m: jax.grad(lambda p, x: jnp.sum(m.apply(p, x) * w),
                            argnums=(0, 1))(params, x)
  for a, b in zip(jax.tree_util.tree_leaves(grad(ours)),
                  jax.tree_util.tree_leaves(grad(ref))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  # bfloat16 activations, float32 statistics and parameter gradients.
  ln16 = layers.LayerNorm(dtype=jnp.bfloat16, **kw)
  y16 = ln16.apply(params, x.astype(jnp.bfloat16))
  assert y16.dtype == jnp.bfloat16
  np.testing.assert_allclose(y16.astype(jnp.float32), ref.apply(params, x),
                             atol=0.05)
  gp = jax.grad(lambda p: jnp.sum(ln16.apply(p, x.astype(jnp.bfloat16))
                                  .astype(jnp.float32) * w))(params)
  assert all(a.dtype == jnp.float32 for a in jax.tree_util.tree_leaves(gp))


def test_dense_gelu_equals_the_autodiff_form_forward_and_backward():
  """The MLP's first layer in float32: gelu(x @ kernel + bias) as one op
  with its own backward; the same value bit for bit, the same gradients
  as autodiff through layers.gelu; the parameter tree is unchanged."""
  x = 2.0 * jax.random.normal(jax.random.key(20), (3, 11, 24))
  w = jax.random.normal(jax.random.key(21), (3, 11, 40))
  mlp = layers.MlpBlock(layers.BlockConfig(mlp_dim=40))
  params = mlp.init(jax.random.key(22), x)
  params = jax.tree_util.tree_map(
      lambda a: a + 0.3 * jnp.cos(jnp.arange(a.size)).reshape(a.shape),
      params)
  dense0 = lambda p, x, fused: layers.Dense(40).apply(
      {"params": p["params"]["Dense_0"]}, x, with_gelu=fused)
  auto = lambda p, x: layers.gelu(layers.Dense(40).apply(
      {"params": p["params"]["Dense_0"]}, x))
  with jax.default_matmul_precision("highest"):
    np.testing.assert_array_equal(dense0(params, x, True), auto(params, x))
    g_fused = jax.grad(lambda p, x: jnp.sum(dense0(p, x, True) * w),
                       argnums=(0, 1))(params, x)
    g_auto = jax.grad(lambda p, x: jnp.sum(auto(p, x) * w),
                      argnums=(0, 1))(params, x)
  for a, b in zip(jax.tree_util.tree_leaves(g_fused),
                  jax.tree_util.tree_leaves(g_auto)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  # The MLP takes it (its gradient is the fused op's) and only for exact
  # GELU in float32.
  jaxpr = str(jax.make_jaxpr(jax.grad(
      lambda p: jnp.sum(mlp.apply(p, x))))(params))
  assert "custom_vjp_call" in jaxpr and "bias_gelu" in jaxpr
  assert kernels.dense_gelu(x.astype(jnp.bfloat16), params["params"][
      "Dense_0"]["kernel"], params["params"]["Dense_0"]["bias"]) is None


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU fusion")
def test_bias_gelu_backward_recomputes_erf_rather_than_keeping_it():
  """Forward and backward in one program (a train step): the forward is one
  pass, y -> gelu(y + bias), with no erf written out for the backward,
  which computes its own from y (merged, erf was a residual of the
  hidden layer's size, written in a pass of its own)."""
  y = jax.random.normal(jax.random.key(30), (197, 96))
  bias = jax.random.normal(jax.random.key(31), (96,))
  g = jax.random.normal(jax.random.key(32), (197, 96))

  def fwd_bwd(y, bias, g):
    out, vjp = jax.vjp(kernels.bias_gelu, y, bias)
    return out, vjp(g)

  hlo = jax.jit(fwd_bwd).lower(y, bias, g).compile().as_text()
  comps = _fused_computations(hlo)
  with_erf = [c for c, body in comps.items() if " erf(" in body]
  assert len(with_erf) == 2, with_erf  # one forward, one backward
  # neither fusion's result is erf itself (no erf residual)
  for c in with_erf:
    root = [l for l in comps[c].splitlines() if "ROOT" in l][0]
    assert " erf(" not in root, root
  out, (dy, db) = jax.jit(fwd_bwd)(y, bias, g)
  h = y + bias
  ref_dy = jax.grad(lambda h: jnp.sum(jax.nn.gelu(h, approximate=False) * g))(h)
  np.testing.assert_allclose(out, jax.nn.gelu(h, approximate=False),
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(dy, ref_dy, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(db, ref_dy.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size, patch, bias", [(32, 16, True), (37, 16, True),
                                               (12, 4, False), (8, 1, True)])
def test_patch_embed_equals_the_strided_convolution(size, patch, bias):
  """Same parameters, initialisers and function as nn.Conv with stride =
  kernel = patch, VALID padding (rows past the last patch dropped)."""
  conv = nn.Conv(24, (patch, patch), strides=(patch, patch), padding="VALID",
                 use_bias=bias)
  ours = layers.PatchEmbed(24, patch, use_bias=bias)
  x = jax.random.normal(jax.random.key(13), (2, size, size, 3))
  params = conv.init(jax.random.key(14), x)
  jax.tree_util.tree_map(np.testing.assert_array_equal, params,
                         ours.init(jax.random.key(14), x))  # same init
  params = jax.tree_util.tree_map(lambda a: a + 0.1, params)
  np.testing.assert_allclose(ours.apply(params, x), conv.apply(params, x),
                             rtol=1e-5, atol=1e-5)
  w = jax.random.normal(jax.random.key(15), conv.apply(params, x).shape)
  grad = lambda m: jax.grad(lambda p: jnp.sum(m.apply(p, x) * w))(params)
  for a, b in zip(jax.tree_util.tree_leaves(grad(ours)),
                  jax.tree_util.tree_leaves(grad(conv))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def _dot_flops_by_operand_dtype(hlo: str):
  """FLOPs of the compiled module's dots, by operand element type."""
  shapes = dict(re.findall(r"%([\w.\-]+) = (\w+\[[\d,]*\])", hlo))
  dims = lambda s: [int(d) for d in re.findall(r"\d+", s.split("[")[1])]
  out = {}
  for m in re.finditer(r"= (\w+\[[\d,]*\])\S* dot\(%([\w.\-]+), %([\w.\-]+)\)"
                       r".*?lhs_contracting_dims=\{([\d,]*)\}", hlo):
    res, lhs, _, contracting = m.groups()
    k = np.prod([dims(shapes[lhs])[int(i)] for i in contracting.split(",")])
    dtype = shapes[lhs].split("[")[0]
    out[dtype] = out.get(dtype, 0) + 2 * np.prod(dims(res)) * k
  return out


@pytest.mark.parametrize("bf16_hardware", [True, False])
def test_bfloat16_train_step_runs_its_gemms_in_bfloat16_on_cpu(
    bf16_hardware, monkeypatch):
  """XLA:CPU upcasts a bf16 GEMM to float32 (about half the speed) when the
  dot has a layout its bf16 library does not take; the kernels are written
  so that none does. On a CPU with bf16 arithmetic, nearly all GEMM FLOPs of
  a bf16 train step must keep bf16 operands (the float32 rest: the tiny
  classifier head). On one without (AVX2), the dense layers' GEMMs run in
  float32 by choice ('f32_cpu': faster there) and only the attention core's
  products stay bf16."""
  if jax.default_backend() != "cpu":
    pytest.skip("XLA:CPU's dot lowering")
  monkeypatch.setattr(kernels, "cpu_has_bf16", lambda: bf16_hardware)
  import optax  # pylint: disable=import-outside-toplevel
  model = models.get_model("vit_ti_16", num_layers=2, num_classes=10,
                           dtype=jnp.bfloat16)
  params = jax.eval_shape(lambda: models.init_params(model, 64))["params"]
  tx = optax.adamw(1e-3)

  def step(p, s, x, y):
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(
        model.apply({"params": p}, x, train=True).astype(jnp.float32),
        y).mean()
    g = jax.grad(loss)(p)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  hlo = jax.jit(step).lower(
      params, jax.eval_shape(tx.init, params),
      jax.ShapeDtypeStruct((8, 64, 64, 3), jnp.float32),
      jax.ShapeDtypeStruct((8,), jnp.int32)).compile().as_text()
  flops = _dot_flops_by_operand_dtype(hlo)
  if bf16_hardware:
    assert flops.get("bf16", 0) > 0.97 * sum(flops.values()), flops
  else:  # bf16: the attention core (~1 % of FLOPs with 17 tokens)
    assert flops.get("f32", 0) > 0.9 * sum(flops.values()), flops
    assert flops.get("bf16", 0) > 0, flops


@pytest.mark.parametrize("n, s", [(197, 197), (7, 5), (6, 9), (8, 5)])
def test_padded_attention_is_the_same_function(n, s):
  """cuDNN's training kernels refuse odd sequence lengths: the padded call
  (one masked zero token, the extra query row dropped) computes the same
  outputs and q/k/v gradients as the unpadded one (asked of XLA here)."""
  q, = _qkv(n=n, seed=1)[:1]
  k, v = _qkv(n=s, seed=2)[:2]
  w = jax.random.normal(jax.random.key(3), q.shape)

  def loss(f):
    return lambda q, k, v: jnp.sum(f(q, k, v) * w)
  plain = functools.partial(jax.nn.dot_product_attention, implementation="xla")
  padded = functools.partial(kernels.padded_attention, implementation="xla")
  np.testing.assert_allclose(jax.jit(padded)(q, k, v),
                             jax.jit(plain)(q, k, v), rtol=1e-6, atol=1e-6)
  grad = lambda f: jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))  # noqa: E731
  for a, b in zip(grad(padded)(q, k, v), grad(plain)(q, k, v)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _fake_gpu_without_cudnn(monkeypatch, calls, error):
  """The default backend reads 'gpu'; a cuDNN call is refused the way JAX
  refuses an unsupported shape (or a GPU without cuDNN), an XLA call
  runs."""
  real = jax.nn.dot_product_attention

  def dpa(*args, implementation=None, **kw):
    calls.append(implementation)
    if implementation == "cudnn":
      raise error
    return real(*args, implementation=implementation, **kw)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax.nn, "dot_product_attention", dpa)


@pytest.mark.parametrize("error", [
    NotImplementedError("Unsupported sequence length Q 198, KV 198."),
    RuntimeError("cuDNN is not detected.")])  # a ROCm GPU
def test_chosen_cudnn_that_jax_refuses_runs_xla(monkeypatch, error):
  """attention_impl=None on a GPU in bfloat16 chooses cuDNN; where JAX
  refuses it for the shapes, the model runs XLA's attention (same logits,
  gradients trace); a requested 'cudnn' keeps JAX's error."""
  x = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
  kw = dict(num_classes=5, image_size=32, dtype=jnp.bfloat16, num_layers=2)
  # Compiled (the choice is made while tracing, as it is eagerly): a new
  # function each time, so each call traces under the backend it is given.
  apply = lambda m: jax.jit(  # noqa: E731
      lambda p, x: m.apply(p, x, train=False))
  params = models.init_params(models.get_model("vit_ti_16", **kw), 32,
                              seed=1)
  want = apply(models.get_model("vit_ti_16", attention_impl="xla", **kw))(
      params, x)
  calls = []
  _fake_gpu_without_cudnn(monkeypatch, calls, error)
  model = models.get_model("vit_ti_16", **kw)
  got = apply(model)(params, x)
  assert calls[:2] == ["cudnn", "xla"], calls
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(want, np.float32))
  grads = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(
      p, x, train=True).astype(jnp.float32))))(params)
  assert all(np.isfinite(np.asarray(g, np.float32)).all()
             for g in jax.tree_util.tree_leaves(grads))
  with pytest.raises(type(error), match=str(error).split()[0]):
    apply(models.get_model("vit_ti_16", attention_impl="cudnn", **kw))(
        params, x)


@pytest.mark.parametrize("image_size", [32, 48])  # 5 tokens (padded), 10
def test_cudnn_self_attention_folds_the_key_and_value_biases(monkeypatch,
                                                             image_size):
  """Where cuDNN runs self-attention without a mask, the key bias is
  dropped (the softmax cancels it) and the value bias joins the out
  projection's (b_v @ W_out): the same function and the same gradients as
  XLA's attention with every bias applied, on weights where every bias
  matters. A stand-in computes cuDNN's call with XLA's attention (the
  rows of weights each sum to one either way)."""
  real = jax.nn.dot_product_attention
  calls = []

  def dpa(*args, implementation=None, **kw):
    calls.append(implementation)
    return real(*args, implementation="xla" if implementation == "cudnn"
                else implementation, **kw)
  monkeypatch.setattr(jax.nn, "dot_product_attention", dpa)
  kw = dict(num_classes=5, image_size=image_size, num_layers=2)
  params = compare.perturb(models.init_params(
      models.get_model("vit_ti_16", **kw), image_size, seed=1), seed=2,
      std=0.3)
  x = jax.random.normal(jax.random.key(0), (2, image_size, image_size, 3))

  def run(impl):
    model = models.get_model("vit_ti_16", attention_impl=impl, **kw)
    def loss(p):
      logits = model.apply(p, x, train=True)
      return jnp.sum(jnp.sin(logits)), logits
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  (_, want), want_g = run("xla")
  (_, got), got_g = run("cudnn")
  assert "cudnn" in calls, calls
  np.testing.assert_allclose(got, want, rtol=1e-5,
                             atol=1e-5 * np.abs(want).max())
  for path, g in jax.tree_util.tree_leaves_with_path(got_g):
    name = jax.tree_util.keystr(path)
    w = _leaf(want_g, path)
    if "key" in name and "bias" in name:  # not read: its gradient is 0
      assert not np.any(np.asarray(g)), name
      # XLA's, with the bias applied: zero up to rounding, against the
      # value bias's beside it.
      v = _leaf(want_g, path[:-2] + (jax.tree_util.DictKey("value"),
                                    path[-1]))
      assert np.abs(w).max() < 1e-4 * np.abs(v).max(), name
    else:
      np.testing.assert_allclose(g, w, rtol=2e-4,
                                 atol=2e-5 * np.abs(w).max(), err_msg=name)


def _leaf(tree, path):
  for p in path:
    tree = tree[p.key]
  return tree


def test_a_failed_run_of_chosen_cudnn_is_not_retried_with_xla(monkeypatch):
  """Only a refusal while tracing falls back; an error of the run itself
  (out of memory, a failed kernel: JaxRuntimeError) is the user's to see."""
  calls = []
  _fake_gpu_without_cudnn(monkeypatch, calls,
                          jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED"))
  x = jnp.zeros((1, 32, 32, 3))
  model = models.get_model("vit_ti_16", num_classes=5, image_size=32,
                           dtype=jnp.bfloat16)
  with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE"):
    model.init(jax.random.key(0), x, train=False)
  assert "xla" not in calls, calls


def test_odd_cudnn_self_attention_pads_the_tokens_once(monkeypatch):
  """cuDNN (chosen) at an odd length: the block pads its input by one
  token before the q/k/v projections, masks that key out through the
  sequence lengths and drops its row after the out projection; the same
  logits and gradients as unpadded attention (float32 here, so the
  comparison is tight: cuDNN is refused on a CPU and XLA runs the same
  padded call)."""
  calls = []
  real = jax.nn.dot_product_attention

  def dpa(q, k, v, *args, implementation=None, **kw):
    calls.append((implementation, q.shape[1],
                  None if kw.get("key_value_seq_lengths") is None else
                  int(kw["key_value_seq_lengths"][0])))
    if implementation == "cudnn":
      raise NotImplementedError("no cuDNN on a CPU")
    return real(q, k, v, *args, implementation=implementation, **kw)
  x = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
  model = models.get_model("vit_ti_16", num_layers=2, num_classes=5)
  variables = jax.tree_util.tree_map(
      lambda a: a + 0.05 * jnp.cos(jnp.arange(a.size).reshape(a.shape)),
      models.init_params(model, 32))
  loss = lambda v: jnp.sum(model.apply(v, x) ** 2)  # noqa: E731
  want, g_want = jax.value_and_grad(loss)(variables)
  monkeypatch.setattr(jax.nn, "dot_product_attention", dpa)
  monkeypatch.setattr(kernels, "choose_attention", lambda *a, **k: "cudnn")
  got, g_got = jax.value_and_grad(loss)(variables)
  # 5 tokens (4 patches + class) padded to 6, 5 keys read; per block.
  assert calls[:2] == [("cudnn", 6, 5), ("xla", 6, 5)], calls
  np.testing.assert_allclose(got, want, rtol=1e-6)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree_util.tree_leaves(
      g_want))
  for a, b in zip(jax.tree_util.tree_leaves(g_got),
                  jax.tree_util.tree_leaves(g_want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_mlp_hidden_layer_dtype_per_backend(backend, monkeypatch):
  """bfloat16 MLP: on the CPU its GEMMs leave float32 (the hidden layer
  stays so through GELU; the output is rounded after the bias); on a GPU /
  TPU every GEMM writes bfloat16 (the activation widens inside its
  elementwise op), as under torch's autocast. Close to float32 either
  way."""
  monkeypatch.setattr(kernels, "cpu_has_bf16", lambda: True)
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  cfg = layers.BlockConfig(mlp_dim=64, dtype=jnp.bfloat16)
  mlp = layers.MlpBlock(config=cfg)
  x = jax.random.normal(jax.random.key(0), (2, 5, 16))
  params = mlp.init(jax.random.key(1), x)
  params = jax.tree_util.tree_map(lambda a: a + 0.1, params)
  jaxpr = jax.make_jaxpr(lambda p: mlp.apply(p, x))(params)

  def dots(j):
    for e in j.eqns:
      if e.primitive.name == "dot_general":
        yield e
      for sub in jax.extend.core.jaxprs_in_params(e.params):
        yield from dots(sub)
  out_dtypes = [e.outvars[0].aval.dtype for e in dots(jaxpr.jaxpr)]
  assert len(out_dtypes) == 2
  want = jnp.float32 if backend == "cpu" else jnp.bfloat16
  assert out_dtypes == [want, want], out_dtypes
  ref = layers.MlpBlock(config=layers.BlockConfig(mlp_dim=64)).apply(params, x)
  got = mlp.apply(params, x)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), ref,
                             atol=0.02 * float(jnp.abs(ref).max()))


def test_widened_activations_are_autodiff_of_float32_with_one_rounding():
  """Off the CPU a bfloat16 MLP's activation is one op each way:
  ``widened_bias_gelu(y, bias)`` and ``widened(fn, h)`` compute in float32
  and round once; their gradients are float32 autodiff's rounded to
  bfloat16 (the bias gradient the float32 sum of the rounded one)."""
  f32, bf16 = jnp.float32, jnp.bfloat16
  y = (2.0 * jax.random.normal(jax.random.key(0), (3, 5, 64))).astype(bf16)
  bias = 0.5 * jax.random.normal(jax.random.key(1), (64,))
  w = jax.random.normal(jax.random.key(2), y.shape)

  def ref(y, bias):
    return layers.gelu(y.astype(f32) + bias)
  got = kernels.widened_bias_gelu(y, bias)
  assert got.dtype == bf16
  np.testing.assert_array_equal(got, ref(y, bias).astype(bf16))
  dy, db = jax.grad(lambda y, b: jnp.sum(
      kernels.widened_bias_gelu(y, b).astype(f32) * w), argnums=(0, 1))(
          y, bias)
  # The reference's cotangent enters as bfloat16 too (the op's output is).
  w16 = w.astype(bf16).astype(f32)
  dy_want, db_want = jax.grad(lambda y, b: jnp.sum(ref(y, b) * w16),
                              argnums=(0, 1))(y.astype(f32), bias)
  assert dy.dtype == bf16 and db.dtype == f32
  np.testing.assert_allclose(dy.astype(f32), dy_want, rtol=2 ** -7,
                             atol=1e-6)
  np.testing.assert_allclose(db, jnp.sum(dy.astype(f32), axis=(0, 1)),
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(db, db_want, rtol=0.01,
                             atol=0.002 * float(jnp.abs(dy_want).sum(
                                 axis=(0, 1)).max()))
  for name, fn in layers.ACTIVATIONS.items():
    h = y[..., :32]
    out = kernels.widened(fn, h)
    np.testing.assert_array_equal(out, fn(h.astype(f32)).astype(bf16),
                                  err_msg=name)
    g = jax.grad(lambda h: jnp.sum(kernels.widened(fn, h).astype(f32) *
                                   w[..., :32]))(h)
    g_want = jax.grad(lambda h: jnp.sum(fn(h) * w16[..., :32]))(
        h.astype(f32))
    assert g.dtype == bf16, name
    np.testing.assert_allclose(g.astype(f32), g_want, rtol=2 ** -7,
                               atol=1e-6, err_msg=name)


@pytest.mark.parametrize("act, gated", [("gelu", None), ("quick_gelu", None),
                                        ("gelu", "split")])
def test_bfloat16_mlp_off_the_cpu_trains_as_float32(act, gated, monkeypatch):
  """A bfloat16 MLP with a GPU's forms (GEMMs writing bfloat16, the
  activation one float32 op each way): its value and parameter gradients
  close to the float32 MLP's, the parameter gradients float32."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  f32 = jnp.float32
  cfg = dict(mlp_dim=64, act=act, gated_mlp=gated)
  mlp16 = layers.MlpBlock(config=layers.BlockConfig(dtype=jnp.bfloat16,
                                                    **cfg))
  mlp32 = layers.MlpBlock(config=layers.BlockConfig(**cfg))
  x = jax.random.normal(jax.random.key(0), (2, 5, 16))
  w = jax.random.normal(jax.random.key(3), x.shape)
  params = mlp32.init(jax.random.key(1), x)
  params = jax.tree_util.tree_map(
      lambda a: a + 0.1 * jnp.cos(jnp.arange(a.size).reshape(a.shape)),
      params)
  loss = lambda m: lambda p: jnp.sum(m.apply(p, x).astype(f32) * w)  # noqa
  y16, y32 = mlp16.apply(params, x), mlp32.apply(params, x)
  assert y16.dtype == jnp.bfloat16
  np.testing.assert_allclose(y16.astype(f32), y32,
                             atol=0.02 * float(jnp.abs(y32).max()))
  g16, g32 = jax.grad(loss(mlp16))(params), jax.grad(loss(mlp32))(params)
  for a, b in zip(jax.tree_util.tree_leaves(g16),
                  jax.tree_util.tree_leaves(g32)):
    assert a.dtype == f32
    np.testing.assert_allclose(a, b, atol=0.02 * float(jnp.abs(b).max()))


def test_layer_norm_off_the_cpu_on_rows_is_the_same_function(monkeypatch):
  """Off the CPU LayerNorm runs on the (tokens, D) rows of a (B, N, D)
  tensor: the same values and gradients as the CPU's form, and the same
  shape; its program holds no 3-D reduction."""
  ln = layers.LayerNorm()
  x = 3.0 * jax.random.normal(jax.random.key(10), (2, 7, 48)) + 1.5
  w = jax.random.normal(jax.random.key(11), x.shape)
  params = jax.tree_util.tree_map(
      lambda a: a + 0.3 * jnp.sin(jnp.arange(a.size)).reshape(a.shape),
      ln.init(jax.random.key(12), x))
  loss = lambda p, x: jnp.sum(ln.apply(p, x) * w)  # noqa: E731
  grad = jax.grad(loss, argnums=(0, 1))
  y_want, want = ln.apply(params, x), grad(params, x)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  y_got, got = ln.apply(params, x), grad(params, x)
  assert y_got.shape == x.shape
  np.testing.assert_allclose(y_got, y_want, rtol=1e-6, atol=1e-6)
  for a, b in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  jaxpr = str(jax.make_jaxpr(grad)(params, x))
  assert not re.search(r"reduce_sum\[[^\]]*axes=\(0, 1\)", jaxpr), jaxpr
