"""Compute kernels of the encoder, separate from the linen modules.

* :func:`dense`: ``x @ kernel + bias`` with float32 accumulation (and
  float32 parameter gradients) for bfloat16/float16 inputs, as one
  custom-VJP op: XLA:CPU runs bf16 x bf16 -> f32 dots on its AVX512-BF16
  path, about twice as fast as bf16 -> bf16. :func:`choose_dense` says which
  form a backend gets (the CPU one lays its backward GEMMs out for XLA:CPU's
  bf16 library).
* :func:`matmul_cpu`: the float32 ``x @ kernel`` of every dense layer on
  CPU, with its backward written out so that the kernel gradient is a
  row-major GEMM for XLA:CPU's library (a transposed copy of the narrower
  operand) instead of the Eigen GEMM over rows that autodiff leaves.
* :func:`attention`: softmax(q k^T * scale) v on head-major operands with a
  hand-written backward pass and, for long sequences, a chunked loop
  (flash-attention style memory). The fastest attention on XLA:CPU.
  On a CPU without bf16 arithmetic (AVX2-only x86) the GEMMs run in
  float32 instead, XLA:CPU's fastest there (:func:`cpu_has_bf16`).
* :func:`choose_attention`: which attention implementation a backend gets,
  as one explicit function of (backend, dtype, shapes, dropout, sown
  weights), so that a CPU test can ask what a GPU would run.

Every function here computes the same numbers as the plain formula (tested
in ``tests/models/test_fast_paths.py``); bench/README.md measures why each exists.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

_LOW_PRECISION = (jnp.bfloat16, jnp.float16)


DENSE_IMPLS = ("plain", "plain_cpu", "low_cpu", "low", "f32_cpu")


@functools.lru_cache(maxsize=1)
def cpu_has_bf16() -> bool:
  """Whether this CPU multiplies bfloat16 in hardware (x86: AVX512-BF16 or
  AMX-BF16, from /proc/cpuinfo). Unknown elsewhere: assumed yes."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      text = f.read()
  except OSError:
    return True
  flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                if line.startswith("flags")), None)
  if flags is None:  # not x86 (e.g. aarch64 'Features')
    return True
  return "avx512_bf16" in flags or "amx_bf16" in flags


_WARNED = []


def _warn_no_bf16_hardware():
  if _WARNED:
    return
  _WARNED.append(True)
  import warnings  # pylint: disable=import-outside-toplevel
  warnings.warn(
      "bfloat16 on a CPU without bf16 arithmetic (no AVX512-BF16 or AMX): "
      "XLA:CPU's bf16 GEMMs run slower than its float32 ones here (an AVX2 "
      "Zen 3 measured 106-110 GFLOP/s against 182-187; ViT-B/16 inference "
      "2.90 img/s in bf16 against 4.70 in float32). vit_jax therefore runs "
      "the dense layers' GEMMs in float32 on the bf16 values (the same "
      "products, float32 accumulation), so bf16 gains nothing here: use "
      "dtype=float32 for full precision at the same speed.", UserWarning,
      stacklevel=3)


def choose_dense(backend: str, dtype, bf16_hardware: Optional[bool] = None
                 ) -> str:
  """The dense-layer implementation for compute dtype ``dtype`` on
  ``backend`` (``jax.default_backend()``: 'cpu', 'gpu', 'tpu', ...).

  Returns:
    ``'plain'`` for float32/float64 off the CPU (and float64 on it):
    ``x @ kernel + bias`` and autodiff.
    ``'plain_cpu'`` for float32 on CPU: the same product through
    :func:`matmul_cpu`, whose backward lays the kernel gradient out as a
    row-major GEMM (XLA:CPU's YNNPACK) from a transposed copy of the
    narrower of x and the output gradient. Autodiff leaves XLA:CPU
    ``x^T g``, which it runs as an Eigen GEMM contracting over rows after
    transposing the other operand, whichever is wider (the MLP's
    (tokens, 4D) activations). ViT-Ti/16's train step: 1.15x with AVX2
    emulated on a Zen 5, not slower on its AVX-512 (bench/README.md).
    ``'low_cpu'`` for bfloat16/float16 on CPU: :func:`_dense_low` with its
    backward GEMMs laid out for XLA:CPU's bf16 library (the input gradient
    as one NT dot, the kernel gradient from a materialised transpose), so
    that none is upcast to float32.
    ``'low'`` for bfloat16/float16 elsewhere: the same custom VJP with
    plain dot_generals (cuBLAS and the TPU take any operand layout; the
    transposes would only be copies). Plain autodiff of a
    ``preferred_element_type=float32`` dot is not enough there: its
    backward multiplies the float32 cotangent by the bf16 operand (a mixed
    GEMM that XLA runs in float32) and rounds the kernel gradient to bf16
    before casting it to the float32 parameter's dtype; the custom VJP
    keeps every GEMM bf16 x bf16 with float32 accumulation and the
    parameter gradients unrounded float32; the forward's output and the
    input gradient leave their GEMMs in the compute dtype (no float32
    copy of the activations).
    ``'f32_cpu'`` for bfloat16/float16 on a CPU without bf16 arithmetic
    (``bf16_hardware``, default :func:`cpu_has_bf16`): the kernel is
    rounded to the compute dtype, both operands are widened to float32 and
    every GEMM runs as a float32 one (the same products as the bf16 GEMMs:
    bf16 values are exact in float32), which is XLA:CPU's fastest GEMM
    there; the result is rounded to the compute dtype and the parameter
    gradients stay unrounded float32, as in ``'low_cpu'``.
  """
  if jnp.dtype(dtype) not in (jnp.dtype(t) for t in _LOW_PRECISION):
    return "plain_cpu" if (backend == "cpu" and jnp.dtype(dtype) ==
                           jnp.float32) else "plain"
  if backend != "cpu":
    return "low"
  if bf16_hardware is None:
    bf16_hardware = cpu_has_bf16()
  return "low_cpu" if bf16_hardware else "f32_cpu"


def dense(x, kernel, bias=None, out_dtype=None, backend=None):
  """x (..., K) @ kernel (K, N) + bias, computed in x's dtype, returned in
  ``out_dtype`` (default x's). Parameters may be float32 (their gradients
  then are too). ``bias=None``: no bias. ``backend`` (default
  ``jax.default_backend()``) picks the form through :func:`choose_dense`."""
  if bias is None:
    bias = jnp.zeros(kernel.shape[-1:], kernel.dtype)
  impl = choose_dense(backend or jax.default_backend(), x.dtype)
  if impl == "f32_cpu":
    _warn_no_bf16_hardware()
    f32 = jnp.float32
    y = matmul_cpu(x.astype(f32), _rounded_to(kernel, x.dtype)) + bias.astype(
        f32)
    return y.astype(out_dtype or x.dtype)
  if impl in ("low_cpu", "low"):
    return _dense_low(x, kernel, bias, jnp.dtype(out_dtype or x.dtype),
                      impl == "low_cpu")
  k = kernel.astype(x.dtype)
  y = (matmul_cpu(x, k) if impl == "plain_cpu" else x @ k) + bias.astype(
      x.dtype)
  return y if out_dtype is None else y.astype(out_dtype)


def _rounded_to(t, dtype):
  """``t``'s values rounded to ``dtype`` (what a ``dtype`` GEMM multiplies),
  held in float32, with the gradient passed through unrounded: the
  ``'f32_cpu'`` form computes the same products as the bf16 ones and keeps
  float32 parameter gradients, as :func:`_dense_low` does. ``t + (r - t)``
  is exactly ``r``: the difference of two floats this close is exact."""
  t32 = t.astype(jnp.float32)
  r = t.astype(dtype).astype(jnp.float32)
  return t32 + lax.stop_gradient(r - t32)


_SQRT1_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


def dense_gelu(x, kernel, bias, backend=None):
  """``gelu(x @ kernel + bias)`` (exact erf GELU, torch's formula) for an
  MLP's first layer in float32, or in bfloat16/float16 off the CPU
  (:func:`widened_bias_gelu`); otherwise None (the caller then uses
  :func:`dense` and ``layers.gelu``). ``bias`` None: no bias (float32:
  None).

  Left to autodiff, XLA:CPU computes the bias add and erf in one pass,
  writes erf out for the backward, and reads the GEMM's output again for
  GELU; the backward then reads three tensors of the hidden layer's size.
  Here the bias add and GELU are one op whose backward keeps only the
  GEMM's output (already in memory) and recomputes GELU's derivative from
  it: one pass over the hidden layer forward and one backward, where the
  memory traffic of the MLP's (tokens, mlp_dim) tensors is what costs on a
  2-channel CPU (bench/ops.py)."""
  impl = choose_dense(backend or jax.default_backend(), x.dtype)
  if impl == "low":
    # GPU / TPU, bfloat16: the GEMM writes bf16 without the bias, and the
    # bias add and GELU run in float32 in one op with its own backward
    # (:func:`widened_bias_gelu`).
    no_bias = jnp.zeros(kernel.shape[-1:], kernel.dtype)
    y = _dense_low(x, kernel, no_bias, x.dtype, False)
    return widened_bias_gelu(y, no_bias if bias is None else bias)
  if (impl not in ("plain", "plain_cpu") or x.dtype != jnp.float32
      or bias is None):
    return None
  k = kernel.astype(x.dtype)
  y = matmul_cpu(x, k) if impl == "plain_cpu" else x @ k
  return bias_gelu(y, bias.astype(x.dtype))


@jax.custom_vjp
def matmul_cpu(x, kernel):
  """``x (..., K) @ kernel (K, N)`` in float32 for XLA:CPU (see
  :func:`choose_dense`, ``'plain_cpu'``): the forward is the plain product;
  the backward computes ``dx = g kernel^T`` as one dot contracting both
  last axes and the kernel gradient ``x^T g`` with
  :func:`_kernel_grad_row_major`."""
  return x @ kernel


def _matmul_cpu_fwd(x, kernel):
  return x @ kernel, (x, kernel)


def _matmul_cpu_bwd(res, g):
  x, kernel = res
  dx = lax.dot_general(g, kernel, (((g.ndim - 1,), (1,)), ((), ())))
  dkernel = _kernel_grad_row_major(x.reshape(-1, x.shape[-1]),
                                   g.reshape(-1, g.shape[-1]), None)
  return dx, dkernel


matmul_cpu.defvjp(_matmul_cpu_fwd, _matmul_cpu_bwd)


def _kernel_grad_row_major(x2, g2, accumulate):
  """``x2^T @ g2`` ((M, K), (M, N) -> (K, N)) as a row-major GEMM: the
  narrower operand transposed into a copy (:func:`materialized_transpose`),
  and when that is ``g2``, the small (N, K) product transposed back.
  ``accumulate``: the dot's ``preferred_element_type`` (None: the
  operands')."""
  dot = lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                     preferred_element_type=accumulate)
  if x2.shape[1] <= g2.shape[1]:
    return dot(materialized_transpose(x2), g2)
  return materialized_transpose(dot(materialized_transpose(g2), x2))


@jax.custom_vjp
def bias_gelu(y, bias):
  """``gelu(y + bias)``, ``x/2 * (1 + erf(x/sqrt2))``; its backward keeps
  ``y`` and ``bias`` only."""
  h = y + bias
  return h * 0.5 * (1.0 + lax.erf(h * _SQRT1_2))


def _bias_gelu_fwd(y, bias):
  return bias_gelu(y, bias), (y, bias)


def _bias_gelu_bwd(res, g):
  y, bias = res
  # The barrier keeps XLA from merging this erf with the forward's (the same
  # expression of the same y): merged, the forward wrote erf out as a
  # residual in a pass of its own and read it again for GELU, one more
  # write and two more reads of the (tokens, mlp_dim) tensor per layer than
  # recomputing it here (ViT-Ti/16 train step 1-1.6% faster, AVX2;
  # bench/README.md).
  dy = g * _gelu_grad(lax.optimization_barrier(y) + bias)
  return dy, jnp.sum(dy.reshape(-1, dy.shape[-1]), axis=0)


def _gelu_grad(h):
  """d/dh [h/2 (1 + erf(h/sqrt2))] = (1 + erf(h/sqrt2))/2 + h * phi(h)."""
  return 0.5 * (1.0 + lax.erf(h * _SQRT1_2)) + h * (
      _INV_SQRT_2PI * jnp.exp(-0.5 * h * h))


bias_gelu.defvjp(_bias_gelu_fwd, _bias_gelu_bwd)


@jax.custom_vjp
def widened_bias_gelu(y, bias):
  """``gelu(y + bias)`` for a bfloat16/float16 ``y``: the add and GELU in
  float32, the result rounded to ``y``'s dtype (the hidden layer of a
  low-precision MLP off the CPU, as torch's autocast computes it).

  Its backward recomputes GELU's derivative in float32 from ``y`` and the
  bias and returns the input gradient in ``y``'s dtype, and the bias
  gradient as that gradient's float32 sum (as torch's autocast has it:
  the cotangent of a bf16 layer's output is bf16). On an H200 XLA still
  writes the float32 product and rounds it in the bias sum's pass, as it
  did for autodiff's form (the same speed; docs/accelerators.md)."""
  h = y.astype(jnp.float32) + bias.astype(jnp.float32)
  return (h * 0.5 * (1.0 + lax.erf(h * _SQRT1_2))).astype(y.dtype)


def _widened_bias_gelu_fwd(y, bias):
  return widened_bias_gelu(y, bias), (y, bias)


def _widened_bias_gelu_bwd(res, g):
  y, bias = res
  f32 = jnp.float32
  # The barrier, as in bias_gelu's backward: erf recomputed here, not
  # written out by the forward.
  h = lax.optimization_barrier(y).astype(f32) + bias.astype(f32)
  # The barrier on the rounded gradient: XLA materialises it (bf16) in the
  # elementwise pass and the bias sum reads it; left free, XLA:GPU wrote
  # the float32 product and rounded it inside the sum's pass (7 ms of
  # ViT-B/16's step on an H200 against about 4 expected this way;
  # docs/accelerators.md).
  dh = lax.optimization_barrier(
      (g.astype(f32) * _gelu_grad(h)).astype(y.dtype))
  dbias = jnp.sum(dh.reshape(-1, dh.shape[-1]).astype(f32), axis=0)
  return dh, dbias.astype(bias.dtype)


widened_bias_gelu.defvjp(_widened_bias_gelu_fwd, _widened_bias_gelu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def widened(fn, h):
  """``fn(h)`` (an elementwise activation) computed in float32 and
  returned in ``h``'s dtype; the backward recomputes ``fn``'s derivative
  from ``h`` in float32 and returns the input gradient in ``h``'s dtype
  (as :func:`widened_bias_gelu`)."""
  return fn(h.astype(jnp.float32)).astype(h.dtype)


def _widened_fwd(fn, h):
  return widened(fn, h), h


def _widened_bwd(fn, h, g):
  _, vjp = jax.vjp(fn, lax.optimization_barrier(h).astype(jnp.float32))
  return (vjp(g.astype(jnp.float32))[0].astype(h.dtype),)


widened.defvjp(_widened_fwd, _widened_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _dense_low(x, kernel, bias, out_dtype, cpu_layout):
  """``_dense`` for bfloat16/float16 x: every GEMM takes low-precision
  operands and accumulates into float32. On the CPU the bias is added in
  float32 and the result rounded once; on a GPU / TPU (``'low'``) a result
  in the compute dtype leaves the GEMM rounded, the bias added in that
  dtype (torch's autocast: cuBLAS's bias epilogue), and so does the input
  gradient.

  XLA:CPU runs a bf16 x bf16 -> bf16 dot at float32 speed, but a
  bf16 x bf16 -> f32 one (``preferred_element_type=float32``) with the
  AVX512-BF16 dot instructions, about twice as fast; and it reduces a bf16
  bias gradient over the batch far more slowly than a float32 one
  (bench/README.md). So here the forward and both backward GEMMs accumulate
  in float32, the kernel and bias gradients stay float32 (no bf16 rounding of
  parameter gradients), and the result is rounded once. ``cpu_layout``:
  the backward GEMMs in the layouts XLA:CPU's bf16 library takes (see
  :func:`choose_dense`)."""
  return _dense_low_fwd(x, kernel, bias, out_dtype, cpu_layout)[0]


def _dense_low_fwd(x, kernel, bias, out_dtype, cpu_layout):
  if not cpu_layout and out_dtype == x.dtype:
    # GPU / TPU: the GEMM writes the compute dtype itself (it accumulates in
    # float32 either way) and the bias joins its epilogue, as torch's
    # autocast runs it; a float32 result and a separate rounding pass cost
    # twice the writes of the layer's output plus a read (on an H200 the
    # MLP's were 7 of ViT-B/16's 83 ms, docs/accelerators.md).
    y = jnp.matmul(x, kernel.astype(x.dtype)) + bias.astype(x.dtype)
    return y, (x, kernel, bias)
  y = jnp.matmul(x, kernel.astype(x.dtype),
                 preferred_element_type=jnp.float32) + bias.astype(jnp.float32)
  return y.astype(out_dtype), (x, kernel, bias)


def _dense_low_bwd(out_dtype, cpu_layout, res, g):
  del out_dtype
  x, kernel, bias = res
  f32 = jnp.float32
  g_low = g.astype(x.dtype)
  # dx = g @ kernel^T as one dot_general contracting both last axes: the
  # form XLA:CPU's library (YNNPACK) takes in bf16. ``g @ kernel.T`` would put
  # a transpose op in front of the dot, and XLA:CPU then upcasts the GEMM to
  # float32 (about half the speed).
  dx = _dot(g_low, kernel.astype(x.dtype), ((g.ndim - 1,), (1,)),
           None if cpu_layout else x.dtype)  # GPU / TPU: as the forward
  x2, g2 = x.reshape(-1, x.shape[-1]), g_low.reshape(-1, g.shape[-1])
  # dkernel = x^T @ g contracts over the rows of both: a layout YNNPACK does
  # not take, so XLA:CPU would upcast it to a float32 Eigen GEMM. One copy of
  # the smaller operand, transposed, makes it a plain row-major GEMM in bf16
  # (2-3x faster, transpose included; bench/README.md).
  if cpu_layout:
    dkernel = _kernel_grad_row_major(x2, g2, f32)
  else:
    dkernel = _dot(x2, g2, ((0,), (0,)))
  dbias = jnp.sum(g.astype(f32).reshape(-1, g.shape[-1]), axis=0)
  return (dx.astype(x.dtype), dkernel.astype(kernel.dtype),
          dbias.astype(bias.dtype))


def _dot(a, b, contracting, out_dtype=None):
  """dot_general with float32 accumulation and no batch dimensions, its
  result in float32 (or ``out_dtype``: the GEMM rounds its float32
  accumulators once, into that)."""
  return lax.dot_general(a, b, (contracting, ((), ())),
                         preferred_element_type=out_dtype or jnp.float32)


def materialized_transpose(x):
  """(M, K) -> (K, M) as a copy in memory that XLA does not fold into the
  dot consuming it (a plain ``x.T`` is folded into the dot's dimension
  numbers, which on XLA:CPU turns a bf16 GEMM into a float32 one). Written
  as a rank-3 transpose between two reshapes, which the algebraic
  simplifier leaves as a transpose-copy."""
  m, k = x.shape
  return jnp.transpose(x.reshape(m, k, 1), (2, 1, 0)).reshape(k, m)


_dense_low.defvjp(_dense_low_fwd, _dense_low_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def layer_norm(x, scale, bias, eps, out_dtype):
  """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * scale
  + bias``, statistics in float32 (as flax's ``nn.LayerNorm``), returned in
  ``out_dtype``; ``scale`` / ``bias`` may be None.

  One custom-VJP op: the backward pass is the closed form
  ``dx = rstd * (g' - mean(g') - xhat * mean(g' * xhat))`` with
  ``g' = g * scale``, from the saved input and per-row statistics, instead
  of autodiff through the mean and variance (several more passes over the
  activations and broadcast temporaries on XLA:CPU; bench/README.md).
  """
  return _layer_norm_fwd(x, scale, bias, eps, out_dtype)[0]


def _layer_norm_fwd(x, scale, bias, eps, out_dtype):
  # One pass for both moments, var = E[x^2] - E[x]^2, as flax's LayerNorm
  # (use_fast_variance) computes it.
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.maximum(jnp.mean(xf * xf, axis=-1, keepdims=True) - mean * mean,
                    0.0)
  rstd = lax.rsqrt(var + eps)
  y = (xf - mean) * rstd
  if scale is not None:
    y = y * scale.astype(jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(out_dtype), (x, scale, bias, mean, rstd)


def _layer_norm_bwd(eps, out_dtype, res, g):
  del eps, out_dtype
  x, scale, bias, mean, rstd = res
  f32 = jnp.float32
  gf = g.astype(f32)
  xhat = (x.astype(f32) - mean) * rstd
  rows = tuple(range(x.ndim - 1))
  dscale = None if scale is None else jnp.sum(gf * xhat, axis=rows).astype(
      scale.dtype)
  dbias = None if bias is None else jnp.sum(gf, axis=rows).astype(bias.dtype)
  gs = gf if scale is None else gf * scale.astype(f32)
  dx = rstd * (gs - jnp.mean(gs, axis=-1, keepdims=True)
               - xhat * jnp.mean(gs * xhat, axis=-1, keepdims=True))
  return dx.astype(x.dtype), dscale, dbias


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def head_major(x):
  """(B, N, H, hd) -> (B, H, N, hd): batch and head lead, so every
  attention product is a plain batched row-major GEMM on XLA:CPU."""
  return jnp.transpose(x, (0, 2, 1, 3))


def attention_weights(qh, kh, scale, bias=None):
  """softmax(q k^T * scale + bias) in float32, as
  jax.nn.dot_product_attention's XLA path computes it (float32 logits,
  scale applied to the logits); ``bias`` as :func:`attention`'s."""
  logits = jnp.einsum("bhqd,bhkd->bhqk", qh, kh,
                      preferred_element_type=jnp.float32) * scale
  if bias is not None:
    logits = logits + bias
  return jax.nn.softmax(logits, axis=-1)


# XLA:CPU computes the whole attention (both products and the softmax) as
# one fused kernel that stays fast up to 256 keys; from 257 keys on it runs
# ~4x slower (bench/README.md). Longer sequences (384 px and up with 16 px
# patches) are processed in chunks of (batch, head) pairs, each chunk's
# (N, N) block about 2 MiB, in a loop.
FUSED_ATTENTION_MAX_KEYS = 256
_ATTENTION_CHUNK_ELEMENTS = 2 ** 19


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention(qh, kh, vh, scale, bias=None):
  """softmax(q k^T * scale + bias) v on head-major (B, H, N, hd) operands.

  ``bias``: None, or an additive float32 (B, 1, 1, S) key bias (a NaFlex
  batch's padding mask: 0 for a key that may be read, float32's lowest
  for padding); it gets no gradient.

  Written for XLA:CPU (each step measured in bench/README.md):
  * the scale multiplies q (N x hd) rather than the logits (N x N), and the
    softmax normalisation divides the output (N x hd) rather than the
    probabilities: ``o = (exp(s - max) @ v) / rowsum(exp(s - max))``. Same
    function, two fewer passes over the (N, N) matrix: ~30% faster forward.
  * the backward pass is written out, as flash-attention kernels do, instead
    of left to autodiff: ``ds = e * (dp - rowsum(do * o)) / l`` needs one
    elementwise pass over (N, N) and an (N, hd) reduction, where softmax's
    autodiff reduces over (N, N) and materialises more (N, N) temporaries.
  * the products e v (forward) and ds k (backward) each have a row sum of
    e in their own fusion: XLA:CPU's YNNPACK runs a batched product of
    (N, N) x (N, hd) blocks alone on one core, and with a reduction fused
    in on all of them (ViT-Ti/16's attention forward + backward: 1.13x).
    dv = p^T do and dk = ds^T q, which contract over rows (an Eigen dot on
    XLA:CPU), are row-major products of transposed copies of p and ds with
    a row sum in their fusions too (:func:`_rows_product`; the train step
    1.04-1.05x).
  * above ``FUSED_ATTENTION_MAX_KEYS`` keys, (batch, head) pairs go through
    a loop in cache-sized chunks, and the backward pass recomputes the
    exponentials from the saved row maxima instead of keeping every (N, N)
    block (as flash attention does: memory linear in N).
  Logits, exponentials and row sums are float32 whatever the input dtype,
  as in ``jax.nn.dot_product_attention``.
  """
  return _attention_fwd(qh, kh, vh, scale, bias)[0]


def _bdot(a, b, contracting):
  """dot_general over a leading batch axis, float32 accumulation."""
  return lax.dot_general(a, b, (contracting, ((0,), (0,))),
                         preferred_element_type=jnp.float32)


def _swap_last(x):
  """(G, A, B) -> (G, B, A), materialised in memory (see
  :func:`materialized_transpose`)."""
  g, a, b = x.shape
  return jnp.transpose(x.reshape(g, a, b, 1), (0, 3, 2, 1)).reshape(g, b, a)


def _attention_block_fwd(q, k, v, scale, bias=None):
  """(G, N, hd) blocks -> output, row max of the logits and the exponentials
  exp(logits - max). ``bias``: None or (G, 1, S) added to the logits."""
  s = _bdot(q * jnp.asarray(scale, q.dtype), k, ((2,), (2,)))
  if bias is not None:
    s = s + bias
  m = jnp.max(s, axis=-1, keepdims=True)
  e = jnp.exp(s - m)
  # The row sum is used here and nowhere else, so XLA:CPU puts it in the
  # same YNNPACK fusion as the product, which then runs on every core; a
  # product alone of (N, N) x (N, hd) blocks runs one block at a time on one
  # core (bench/README.md). The backward pass recomputes the sums it needs.
  o = _bdot(e.astype(v.dtype), v, ((2,), (1,))) / _row_sum(e)
  return o.astype(v.dtype), m, e


def _row_sum(e):
  return jnp.sum(e, axis=-1, keepdims=True)


def _recomputed_row_sum(e, *tie):
  """rowsum(e), computed again rather than shared with another rowsum(e):
  the optimization barrier (with ``tie``, so that two of them differ) keeps
  XLA from merging the reductions, so each stays in the fusion of the one
  product it scales (one (N, N) read each, ~0.1 ms for ViT-Ti/16's blocks,
  against ~1 ms saved per product)."""
  return _row_sum(lax.optimization_barrier((e,) + tie)[0])


def _attention_block_bwd(q, k, v, o, e, do, scale):
  f32 = jnp.float32
  # ds = p * (dp - delta) is not materialised: the (N, N) pass computes
  # e * (dp - delta), and 1/l (with the scale) is applied to the output of
  # dq = ds k, and in the transposed copies of e and ds that dv = p^T do and
  # dk = ds^T q read (_rows_product). The sum for dq is a fresh one in dq's
  # fusion (see _attention_block_fwd), so that dq runs on every core. Every
  # product takes operands in the input dtype and accumulates in float32
  # (the fast bf16 path on CPU).
  inv_l = 1.0 / _recomputed_row_sum(e)
  dp = _bdot(do, v, ((2,), (2,)))
  # rowsum(dp * p) == rowsum(do * o): softmax's Jacobian-vector product.
  delta = jnp.sum(do.astype(f32) * o.astype(f32), axis=-1, keepdims=True)
  ds = e * (dp - delta)
  dq = _bdot(ds.astype(q.dtype), k, ((2,), (1,))) * (
      scale / _recomputed_row_sum(e, ds))
  dv = _rows_product(e * inv_l, do)
  dk = _rows_product(ds * (inv_l * scale), q)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _rows_product(a, b):
  """``a^T b`` per block, (G, M, K) x (G, M, N) -> (G, K, N), ``a`` rounded
  to ``b``'s dtype, accumulated in float32, for XLA:CPU: ``a`` transposed
  into a copy (the barrier keeps XLA from folding the transpose into the
  product's fusion, where YNNPACK runs it slowly), then a row-major
  product whose fusion also holds a row sum of that copy, multiplied by
  zero: with a reduction in its fusion YNNPACK runs the batched product on
  every core, without one on one core (see _attention_block_fwd).
  Contracting over the rows directly is an Eigen dot in float32 (1.5-3 ms
  for ViT-Ti/16's (48, 197, 197) blocks on an AVX2 CPU against ~1.8 ms for
  this form, copy included) and a float32 upcast in bf16; transposing the
  small (N, hd) operand and the result instead leaves the product on one
  core. Train step 1.04-1.05x faster in float32, 1.02-1.05x in bf16
  (bench/README.md). ``x * (1 + 0 * sum)`` is ``x`` for every finite sum
  (sums of probabilities and of finite gradients)."""
  t = lax.optimization_barrier(_swap_last(a.astype(b.dtype)))
  keep = 1.0 + 0.0 * jnp.sum(t.astype(jnp.float32), axis=-1, keepdims=True)
  return _bdot(t, b, ((2,), (1,))) * keep


def attention_chunks(qh, kh):
  """None (one fused computation), or the number of (batch, head) pairs per
  chunk: the largest divisor of B*H whose (N, N) blocks fit the budget."""
  b, h, n, s = qh.shape[0], qh.shape[1], qh.shape[2], kh.shape[2]
  if s <= FUSED_ATTENTION_MAX_KEYS:
    return None
  pairs = b * h
  fit = max(1, _ATTENTION_CHUNK_ELEMENTS // (n * s))
  return max(g for g in range(1, min(pairs, fit) + 1) if pairs % g == 0)


def _flat(t):
  """(B, H, N, hd) -> (B*H, N, hd): one batch axis for every GEMM."""
  return t.reshape((-1,) + t.shape[2:])


def _flat_bias(bias, lead):
  """(B, 1, 1, S) key bias -> (B*H, 1, S), one row per (batch, head);
  ``lead``: (B, H)."""
  b, h = lead
  return jnp.broadcast_to(bias, (b, h, 1, bias.shape[-1])).reshape(
      b * h, 1, bias.shape[-1])


def _attention_fwd(qh, kh, vh, scale, bias=None):
  g = attention_chunks(qh, kh)
  q, k, v = _flat(qh), _flat(kh), _flat(vh)
  fb = None if bias is None else _flat_bias(bias, qh.shape[:2])
  if g is None:
    o, _, e = _attention_block_fwd(q, k, v, scale, fb)
    m = None
  else:
    split = lambda t: t.reshape(-1, g, *t.shape[1:])
    if fb is None:
      o, m = lax.map(
          lambda a: _attention_block_fwd(*a, scale)[:2],
          (split(q), split(k), split(v)))
    else:
      o, m = lax.map(
          lambda a: _attention_block_fwd(a[0], a[1], a[2], scale, a[3])[:2],
          (split(q), split(k), split(v), split(fb)))
    e = None
  # The residuals are the flat (B*H, N, hd) operands the products read, so
  # that XLA makes one head-major copy of each for the forward and the
  # backward (kept as (B, H, N, hd), it made two of q).
  o = o.reshape(q.shape[:2] + v.shape[2:])
  return o.reshape(qh.shape[:3] + vh.shape[3:]), (q, k, v, o, e, m, bias)


def _attention_bwd(scale, res, do):
  q, k, v, o, e, m, bias = res
  lead = do.shape[:2]  # (B, H)
  do = _flat(do)
  if e is not None:
    grads = _attention_block_bwd(q, k, v, o, e, do, scale)
  else:
    g = m.shape[1]
    split = lambda t: t.reshape(-1, g, *t.shape[1:])

    def chunk(args):
      q_c, k_c, v_c, o_c, m_c, do_c = args[:6]
      s = _bdot(q_c * jnp.asarray(scale, q_c.dtype), k_c, ((2,), (2,)))
      if len(args) > 6:
        s = s + args[6]
      e_c = jnp.exp(s - m_c)  # the forward's exponentials, recomputed
      return _attention_block_bwd(q_c, k_c, v_c, o_c, e_c, do_c, scale)

    xs = (split(q), split(k), split(v), split(o), m, split(do))
    if bias is not None:
      xs += (split(_flat_bias(bias, lead)),)
    grads = lax.map(chunk, xs)
  grads = tuple(d.reshape(lead + t.shape[1:]) for d, t in zip(grads, (q, k, v)))
  return grads + (None if bias is None else jnp.zeros_like(bias),)


attention.defvjp(_attention_fwd, _attention_bwd)


# --------------------------------------------------------------------------- #
# Which attention a backend runs.
# --------------------------------------------------------------------------- #

ATTENTION_IMPLS = ("matmul", "xla", "cudnn")
# What cuDNN's fused attention (through jax.nn.dot_product_attention) takes:
# half-precision operands and a head dimension that is a multiple of 8, at
# most 128 (cuDNN 9 frontend limits for the sm80+ kernels).
_CUDNN_DTYPES = ("bfloat16", "float16")
_CUDNN_MAX_HEAD_DIM = 128


def padded_attention(q, k, v, *, implementation: str = "cudnn",
                     key_value_seq_lengths=None):
  """``jax.nn.dot_product_attention`` of (B, N, H, hd) q and (B, S, H, hd)
  k/v for any N and S.

  cuDNN's fused training kernels refuse an odd sequence length (ViT-B/16's
  197 tokens: "Unsupported sequence length Q 197, KV 197", seen on an H200
  with jax 0.11.2). An odd sequence gets one zero token appended that the
  kernel masks out through its sequence lengths (cuDNN's padding mask, no
  bias), and the extra query row is dropped: the same function, and the
  same gradients, as the unpadded call. Even lengths call it as they are.

  ``key_value_seq_lengths`` (B,) int32: only the first so many keys of each
  row are read (a NaFlex batch's padding at the end; every query row is
  computed, as with a key mask).
  """
  n, s = q.shape[1], k.shape[1]
  if key_value_seq_lengths is None and n % 2 == 0 and s % 2 == 0:
    return jax.nn.dot_product_attention(q, k, v, implementation=implementation)

  def even(t):
    odd = t.shape[1] % 2
    return jnp.pad(t, ((0, 0), (0, odd), (0, 0), (0, 0))) if odd else t
  b = q.shape[0]
  if key_value_seq_lengths is None:
    key_value_seq_lengths = jnp.full((b,), s, jnp.int32)
  y = jax.nn.dot_product_attention(
      even(q), even(k), even(v),
      query_seq_lengths=jnp.full((b,), n, jnp.int32),
      key_value_seq_lengths=key_value_seq_lengths,
      implementation=implementation)
  return y[:, :n]


@jax.custom_vjp
def _take_keys(x, perm, inverse):
  """(B, S, ...) rows of each batch entry reordered by ``perm`` (B, S);
  ``inverse`` = argsort(perm) gives the backward pass as a gather too (no
  scatter-add)."""
  return jnp.take_along_axis(x, perm.reshape(perm.shape + (1,) * (x.ndim - 2)),
                             axis=1)


def _take_keys_fwd(x, perm, inverse):
  return _take_keys(x, perm, inverse), (perm, inverse)


def _take_keys_bwd(res, g):
  perm, inverse = res
  return _take_keys(g, inverse, perm), None, None


_take_keys.defvjp(_take_keys_fwd, _take_keys_bwd)


def masked_attention(q, k, v, mask, *, implementation: str = "cudnn"):
  """Attention of (B, N, H, hd) q to the keys ``mask`` (B, S) marks, as
  sequence lengths.

  cuDNN's training kernels refuse a mask given as a bias (what
  ``jax.nn.dot_product_attention(mask=...)`` makes of it) at odd lengths,
  but take sequence lengths at any length. Attention does not depend on the
  order of the keys (each query's softmax and weighted sum run over the set
  of them), so each row's valid keys are moved first, in order (k and v
  gathered alike: a NaFlex batch's padding is already last, and its
  permutation is the identity), and their count is the row's
  ``key_value_seq_lengths`` for :func:`padded_attention`. The same function
  as the mask for every mask with at least one valid key per row; a row with
  none (an all-padding example) reads its first key (the mask as a bias
  would average all of them: both meaningless, this one finite).
  """
  count = jnp.maximum(jnp.sum(mask, axis=-1, dtype=jnp.int32), 1)
  perm = jnp.argsort(jnp.logical_not(mask).astype(jnp.int32), axis=-1,
                     stable=True)
  inverse = jnp.argsort(perm, axis=-1)
  k, v = (_take_keys(t, perm, inverse) for t in (k, v))
  return padded_attention(q, k, v, implementation=implementation,
                          key_value_seq_lengths=count)


def choose_attention(backend: str, dtype, head_dim: int, *,
                     requested: Optional[str] = None, dropout: bool = False,
                     sow_weights: bool = False) -> str:
  """The attention implementation for one attention call.

  Args:
    backend: ``jax.default_backend()`` ('cpu', 'gpu', 'tpu', ...).
    dtype: the compute dtype of q/k/v.
    head_dim: the per-head width.
    requested: the model's ``attention_impl`` (None: choose).
    dropout: attention dropout is active (needs the probabilities).
    sow_weights: the probabilities are sown (needs them materialised).

  Returns:
    ``'weights'`` (probabilities materialised: needed for dropout and for
    sowing, whatever was requested), ``'matmul'`` (:func:`attention`, the
    fastest on CPU), ``'cudnn'`` (``jax.nn.dot_product_attention``'s fused
    cuDNN kernel through :func:`padded_attention` (a key mask through
    :func:`masked_attention`): GPU, bfloat16/float16,
    head_dim a multiple of 8 up to 128; where JAX refuses it (a shape, no
    cuDNN), a chosen (not requested) ``'cudnn'`` runs ``'xla'``) or ``'xla'``
    (``jax.nn.dot_product_attention`` lowered by XLA).
  """
  if dropout or sow_weights:
    return "weights"
  if requested is not None:
    if requested not in ATTENTION_IMPLS:
      raise ValueError(f"attention_impl={requested!r}: expected None or one "
                       f"of {ATTENTION_IMPLS}")
    return requested
  if backend == "cpu":
    return "matmul"
  if (backend in ("gpu", "cuda") and jnp.dtype(dtype).name in _CUDNN_DTYPES
      and head_dim % 8 == 0 and head_dim <= _CUDNN_MAX_HEAD_DIM):
    return "cudnn"
  return "xla"
