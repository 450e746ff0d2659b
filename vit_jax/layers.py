"""Building blocks of the Vision Transformer encoder (Flax linen).

Parameter names follow google-research/vision_transformer's linen modules
(``LayerNorm_0``, ``MultiHeadDotProductAttention_0/{query,key,value,out}``,
``LayerNorm_1``, ``MlpBlock_0/{Dense_0,Dense_1}``, ``posembed_input``,
``encoder_norm``); :mod:`vit_jax.models` assembles them into the model.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

Dtype = Any

_KERNEL_INIT = nn.initializers.xavier_uniform()
_BIAS_INIT = nn.initializers.normal(stddev=1e-6)
_LN_EPS = 1e-6
_SQRT1_2 = 1.0 / math.sqrt(2.0)


def _gelu(x):
  """Exact (erf) GELU, written as torch computes it: x/2 * (1 + erf(x/sqrt2)).

  The same function as ``nn.gelu(x, approximate=False)``, which goes through
  ``erfc`` (an exp plus polynomials per element on XLA:CPU); ``erf`` is one
  rational polynomial, which makes the MLP block ~10% faster on CPU, forward
  and backward (bench/README.md), and follows torchvision's formula.
  """
  return x * 0.5 * (1.0 + lax.erf(x * _SQRT1_2))


def _drop_path(module: nn.Module, x, rate, deterministic: bool):
  """Stochastic depth: drops the whole residual branch per example."""
  if deterministic:
    return x
  keep = 1.0 - rate
  rng = module.make_rng("dropout")
  mask = jax.random.bernoulli(rng, keep, (x.shape[0],) + (1,) * (x.ndim - 1))
  # Where keep == 0 the branch is dropped for every example.
  scale = jnp.where(keep > 0, 1.0 / jnp.maximum(keep, 1e-12), 0.0)
  return x * (mask * scale).astype(x.dtype)


class _Projection(nn.Module):
  """Holds a DenseGeneral-shaped kernel and bias (names as linen's)."""

  kernel_shape: Tuple[int, ...]
  bias_shape: Tuple[int, ...]
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self):
    fan_in_axes = len(self.kernel_shape) - len(self.bias_shape)
    # Initialise like a (fan_in, fan_out) matrix, as linen's DenseGeneral does.
    def kernel_init(key, shape, dtype):
      fan_in = int(np.prod(shape[:fan_in_axes]))
      fan_out = int(np.prod(shape[fan_in_axes:]))
      return _KERNEL_INIT(key, (fan_in, fan_out), dtype).reshape(shape)

    kernel = self.param("kernel", kernel_init, self.kernel_shape,
                        self.param_dtype)
    bias = self.param("bias", nn.initializers.zeros, self.bias_shape,
                      self.param_dtype)
    return kernel, bias


_LOW_PRECISION = (jnp.bfloat16, jnp.float16)


def _dense(x, kernel, bias, out_dtype=None):
  """x (..., K) @ kernel (K, N) + bias, computed in x's dtype, returned in
  ``out_dtype`` (default x's). Parameters may be float32 (their gradients
  then are too). The float32 path is the plain one; see ``_dense_low``."""
  if x.dtype in _LOW_PRECISION:
    return _dense_low(x, kernel, bias, jnp.dtype(out_dtype or x.dtype))
  y = x @ kernel.astype(x.dtype) + bias.astype(x.dtype)
  return y if out_dtype is None else y.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dense_low(x, kernel, bias, out_dtype):
  """``_dense`` for bfloat16/float16 x: every GEMM takes low-precision
  operands and accumulates into float32, bias added in float32.

  XLA:CPU runs a bf16 x bf16 -> bf16 dot at float32 speed, but a
  bf16 x bf16 -> f32 one (``preferred_element_type=float32``) with the
  AVX512-BF16 dot instructions, about twice as fast; and it reduces a bf16
  bias gradient over the batch far more slowly than a float32 one
  (bench/README.md). So here the forward and both backward GEMMs accumulate
  in float32, the kernel and bias gradients stay float32 (no bf16 rounding of
  parameter gradients), and the result is rounded once."""
  return _dense_low_fwd(x, kernel, bias, out_dtype)[0]


def _dense_low_fwd(x, kernel, bias, out_dtype):
  y = jnp.matmul(x, kernel.astype(x.dtype),
                 preferred_element_type=jnp.float32) + bias.astype(jnp.float32)
  return y.astype(out_dtype), (x, kernel, bias)


def _dense_low_bwd(out_dtype, res, g):
  del out_dtype
  x, kernel, bias = res
  f32 = jnp.float32
  g_low = g.astype(x.dtype)
  dx = jnp.matmul(g_low, kernel.astype(x.dtype).T, preferred_element_type=f32)
  x2, g2 = x.reshape(-1, x.shape[-1]), g_low.reshape(-1, g.shape[-1])
  dkernel = jnp.matmul(x2.T, g2, preferred_element_type=f32)
  dbias = jnp.sum(g.astype(f32).reshape(-1, g.shape[-1]), axis=0)
  return (dx.astype(x.dtype), dkernel.astype(kernel.dtype),
          dbias.astype(bias.dtype))


_dense_low.defvjp(_dense_low_fwd, _dense_low_bwd)


class Dense(nn.Module):
  """``nn.Dense``'s parameters (``kernel`` (in, out), ``bias``) and init,
  computed with ``_dense`` (the fast low-precision path on CPU)."""

  features: int
  param_dtype: Dtype = jnp.float32
  kernel_init: Any = _KERNEL_INIT
  bias_init: Any = _BIAS_INIT

  @nn.compact
  def __call__(self, x, out_dtype=None):
    kernel = self.param("kernel", self.kernel_init,
                        (x.shape[-1], self.features), self.param_dtype)
    bias = self.param("bias", self.bias_init, (self.features,),
                      self.param_dtype)
    return _dense(x, kernel, bias, out_dtype)


def _project(x2d, kernel, bias):
  """(M, K) @ DenseGeneral kernel (K as one or more leading axes, ...) +
  bias -> (M, prod(...)): one plain 2-D GEMM, no transposes around it."""
  return _dense(x2d, kernel.reshape(x2d.shape[-1], -1), bias.reshape(-1))


def _head_major(x):
  """(B, N, H, hd) -> (B, H, N, hd): batch and head lead, so every
  attention product is a plain batched row-major GEMM on XLA:CPU."""
  return jnp.transpose(x, (0, 2, 1, 3))


def _attention_weights(qh, kh, scale):
  """softmax(q k^T * scale) in float32, as jax.nn.dot_product_attention's
  XLA path computes it (float32 logits, scale applied to the logits)."""
  logits = jnp.einsum("bhqd,bhkd->bhqk", qh, kh,
                      preferred_element_type=jnp.float32) * scale
  return jax.nn.softmax(logits, axis=-1)


# XLA:CPU computes the whole attention (both products and the softmax) as
# one fused kernel that stays fast up to 256 keys; from 257 keys on it runs
# ~4x slower (bench/README.md). Longer sequences (384 px and up with 16 px
# patches) are processed in chunks of (batch, head) pairs, each chunk's
# (N, N) block about 2 MiB, in a loop.
_FUSED_ATTENTION_MAX_KEYS = 256
_ATTENTION_CHUNK_ELEMENTS = 2 ** 19


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention_core(qh, kh, vh, scale):
  """softmax(q k^T * scale) v on head-major (B, H, N, hd) operands.

  Written for XLA:CPU (each step measured in bench/README.md):
  * the scale multiplies q (N x hd) rather than the logits (N x N), and the
    softmax normalisation divides the output (N x hd) rather than the
    probabilities: ``o = (exp(s - max) @ v) / rowsum(exp(s - max))``. Same
    function, two fewer passes over the (N, N) matrix: ~30% faster forward.
  * the backward pass is written out, as flash-attention kernels do, instead
    of left to autodiff: ``ds = e * (dp - rowsum(do * o)) / l`` needs one
    elementwise pass over (N, N) and an (N, hd) reduction, where softmax's
    autodiff reduces over (N, N) and materialises more (N, N) temporaries.
  * above ``_FUSED_ATTENTION_MAX_KEYS`` keys, (batch, head) pairs go through
    a loop in cache-sized chunks, and the backward pass recomputes the
    exponentials from the saved row maxima instead of keeping every (N, N)
    block (as flash attention does: memory linear in N).
  Logits, exponentials and row sums are float32 whatever the input dtype,
  as in ``jax.nn.dot_product_attention``.
  """
  return _attention_core_fwd(qh, kh, vh, scale)[0]


def _attention_block_fwd(q, k, v, scale):
  """(..., N, hd) blocks -> output, row max of the logits, 1 / row sum of
  exp(logits - max), and those exponentials."""
  f32 = jnp.float32
  s = jnp.einsum("...qd,...kd->...qk", q * jnp.asarray(scale, q.dtype), k,
                 preferred_element_type=f32)
  m = jnp.max(s, axis=-1, keepdims=True)
  e = jnp.exp(s - m)
  inv_l = 1.0 / jnp.sum(e, axis=-1, keepdims=True)
  o = jnp.einsum("...qk,...kd->...qd", e.astype(v.dtype), v,
                 preferred_element_type=f32)
  return (o * inv_l).astype(v.dtype), m, inv_l, e


def _attention_block_bwd(q, k, v, o, e, inv_l, do, scale):
  f32 = jnp.float32
  # p = e * inv_l is never materialised: 1/l is folded into (N, hd) terms.
  # Every product accumulates in float32 (the fast bf16 path on CPU).
  dv = jnp.einsum("...qk,...qd->...kd", e.astype(do.dtype),
                  (do * inv_l).astype(do.dtype), preferred_element_type=f32)
  dp = jnp.einsum("...qd,...kd->...qk", do, v, preferred_element_type=f32)
  # rowsum(dp * p) == rowsum(do * o): softmax's Jacobian-vector product.
  delta = jnp.sum(do.astype(f32) * o.astype(f32), axis=-1, keepdims=True)
  ds = (e * ((dp - delta) * (inv_l * scale))).astype(q.dtype)
  dq = jnp.einsum("...qk,...kd->...qd", ds, k, preferred_element_type=f32)
  dk = jnp.einsum("...qk,...qd->...kd", ds, q, preferred_element_type=f32)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _attention_chunks(qh, kh):
  """None (one fused computation), or the number of (batch, head) pairs per
  chunk: the largest divisor of B*H whose (N, N) blocks fit the budget."""
  b, h, n, s = qh.shape[0], qh.shape[1], qh.shape[2], kh.shape[2]
  if s <= _FUSED_ATTENTION_MAX_KEYS:
    return None
  pairs = b * h
  fit = max(1, _ATTENTION_CHUNK_ELEMENTS // (n * s))
  return max(g for g in range(1, min(pairs, fit) + 1) if pairs % g == 0)


def _attention_core_fwd(qh, kh, vh, scale):
  g = _attention_chunks(qh, kh)
  if g is None:
    o, _, inv_l, e = _attention_block_fwd(qh, kh, vh, scale)
    return o, (qh, kh, vh, o, e, None, inv_l)
  split = lambda t: t.reshape(-1, g, *t.shape[2:])
  o, m, inv_l = lax.map(
      lambda a: _attention_block_fwd(*a, scale)[:3],
      (split(qh), split(kh), split(vh)))
  o = o.reshape(qh.shape)
  return o, (qh, kh, vh, o, None, m, inv_l)


def _attention_core_bwd(scale, res, do):
  qh, kh, vh, o, e, m, inv_l = res
  if e is not None:
    return _attention_block_bwd(qh, kh, vh, o, e, inv_l, do, scale)
  g = _attention_chunks(qh, kh)
  split = lambda t: t.reshape(-1, g, *t.shape[2:])

  def chunk(args):
    q, k, v, o_c, m_c, inv_l_c, do_c = args
    s = jnp.einsum("...qd,...kd->...qk", q * jnp.asarray(scale, q.dtype), k,
                   preferred_element_type=jnp.float32)
    e_c = jnp.exp(s - m_c)  # the forward's exponentials, recomputed
    return _attention_block_bwd(q, k, v, o_c, e_c, inv_l_c, do_c, scale)

  grads = lax.map(chunk, (split(qh), split(kh), split(vh), split(o), m, inv_l,
                          split(do)))
  return tuple(d.reshape(t.shape) for d, t in zip(grads, (qh, kh, vh)))


_attention_core.defvjp(_attention_core_fwd, _attention_core_bwd)


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head self-attention with linen's parameter layout.

  Parameters are exactly those of ``flax.linen.MultiHeadDotProductAttention``
  (``query``/``key``/``value`` kernels (D, H, D/H), ``out`` kernel
  (H, D/H, D)). Every projection runs as one plain 2-D GEMM on the
  (batch * tokens, D) activations. The attention itself is
  ``jax.nn.dot_product_attention`` when ``attention_impl`` is ``'xla'`` or
  ``'cudnn'`` (or ``None`` on GPU/TPU); with ``'matmul'`` (the default on
  CPU, where it is measurably faster: see ``bench/``), it is the same
  computation written as head-major batched GEMMs. Attention weights are
  sown with ``sow_weights`` and dropped out with an active dropout rate.
  """

  num_heads: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  dropout_rate: float = 0.0
  deterministic: bool = True
  sow_weights: bool = False
  attention_impl: Optional[str] = None  # None | 'matmul' | 'xla' | 'cudnn'

  @nn.compact
  def __call__(self, x):
    b, n, d = x.shape
    if d % self.num_heads:
      raise ValueError(
          f"hidden size {d} is not divisible by num_heads={self.num_heads}")
    h, hd = self.num_heads, d // self.num_heads
    projs = [
        _Projection((d, h, hd), (h, hd), self.param_dtype, name=n)()
        for n in ("query", "key", "value")
    ]
    out_kernel, out_bias = _Projection((h, hd, d), (d,), self.param_dtype,
                                       name="out")()
    x = x.astype(self.dtype)  # kernels are cast inside _dense
    qkv = projs
    # Three (B*N, D) x (D, D) GEMMs. One fused (D, 3D) GEMM would need the
    # three kernels concatenated on every call (a copy of 3*D*D weights
    # that costs more on CPU than it saves; measured in bench/README.md).
    x2d = x.reshape(b * n, d)
    q, k, v = (_project(x2d, kk, bb).reshape(b, n, h, hd) for kk, bb in qkv)

    impl = self.attention_impl
    if impl is None:
      impl = "matmul" if jax.default_backend() == "cpu" else None
    use_dropout = self.dropout_rate > 0.0 and not self.deterministic
    if impl == "matmul" or self.sow_weights or use_dropout:
      qh, kh, vh = _head_major(q), _head_major(k), _head_major(v)
      scale = 1.0 / math.sqrt(hd)
      if self.sow_weights or use_dropout:
        weights = _attention_weights(qh, kh, scale).astype(self.dtype)
        if self.sow_weights:
          self.sow("intermediates", "attention_weights", weights)
        if use_dropout:
          weights = nn.Dropout(self.dropout_rate)(weights, deterministic=False)
        oh = jnp.einsum("bhqk,bhkd->bhqd", weights, vh)
      else:
        oh = _attention_core(qh, kh, vh, scale)
      y = jnp.transpose(oh, (0, 2, 1, 3))  # (B, N, H, hd)
    else:
      y = jax.nn.dot_product_attention(q, k, v, implementation=impl)
    return _project(y.reshape(b * n, d), out_kernel, out_bias).reshape(
        b, n, d)


class MlpBlock(nn.Module):
  """Dense -> exact GELU -> dropout -> Dense -> dropout."""

  mlp_dim: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  dropout_rate: float = 0.0
  deterministic: bool = True

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    x = x.astype(self.dtype)
    # In bf16/f16 the hidden layer leaves its GEMM in float32 (the GEMM
    # accumulates in float32 anyway) and GELU runs in float32: exact-erf
    # GELU and its gradient are slower in bf16 on CPU, and less accurate.
    low = x.dtype in _LOW_PRECISION
    x = Dense(self.mlp_dim, self.param_dtype, name="Dense_0")(
        x, out_dtype=jnp.float32 if low else None)
    x = _gelu(x).astype(self.dtype)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=self.deterministic)
    x = Dense(d, self.param_dtype, name="Dense_1")(x)
    return nn.Dropout(self.dropout_rate)(x, deterministic=self.deterministic)


class Encoder1DBlock(nn.Module):
  """Pre-LayerNorm transformer block: x + MHSA(LN(x)); x + MLP(LN(x)).

  Returns ``(output, output)`` so the same module runs under ``nn.scan``.
  ``drop_path_rate`` is this block's stochastic-depth rate (a float, or a
  traced scalar under ``nn.scan``).
  """

  mlp_dim: int
  num_heads: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  use_drop_path: bool = False
  deterministic: bool = True
  sow_attention_weights: bool = False
  attention_impl: Optional[str] = None

  @nn.compact
  def __call__(self, inputs, drop_path_rate=0.0):
    ln = functools.partial(nn.LayerNorm, epsilon=_LN_EPS, dtype=self.dtype,
                           param_dtype=self.param_dtype)
    drop_path = (
        lambda y: _drop_path(self, y, drop_path_rate, self.deterministic)
    ) if self.use_drop_path else (lambda y: y)

    x = ln()(inputs)
    x = MultiHeadDotProductAttention(
        num_heads=self.num_heads, dtype=self.dtype,
        param_dtype=self.param_dtype,
        dropout_rate=self.attention_dropout_rate,
        deterministic=self.deterministic,
        sow_weights=self.sow_attention_weights,
        attention_impl=self.attention_impl)(x)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=self.deterministic)
    x = drop_path(x) + inputs

    y = ln()(x)
    y = MlpBlock(mlp_dim=self.mlp_dim, dtype=self.dtype,
                 param_dtype=self.param_dtype, dropout_rate=self.dropout_rate,
                 deterministic=self.deterministic)(y)
    out = x + drop_path(y)
    return out, out


class AddPositionEmbs(nn.Module):
  """Adds a learned 1-D position embedding (one row per token)."""

  grid: Tuple[int, int]
  num_prefix_tokens: int
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    shape = (1, x.shape[1], x.shape[2])
    if self.has_variable("params", "pos_embedding"):
      have = self.get_variable("params", "pos_embedding").shape
      if tuple(have) != shape:
        _raise_posemb_mismatch(have, shape, self.grid, self.num_prefix_tokens)
    pe = self.param("pos_embedding", nn.initializers.normal(stddev=0.02),
                    shape, self.param_dtype)
    return x + pe.astype(x.dtype)


def _raise_posemb_mismatch(have, want, grid, prefix):
  rows = have[1] - prefix
  side = math.isqrt(rows)
  had = f"a {side}x{side} patch grid" if side * side == rows else f"{rows} patches"
  raise ValueError(
      f"Input resolution does not match the position embedding: it has "
      f"{have[1]} rows ({had} + {prefix} class token), but the input gives a "
      f"{grid[0]}x{grid[1]} patch grid ({want[1]} rows needed). Resample the "
      f"embedding to the new resolution first, e.g. "
      f"vit_jax.convert.resize_posemb(variables, image_size) or "
      f"convert.from_torchvision(..., image_size=...).")


class Encoder(nn.Module):
  """Position embedding + dropout + ``num_layers`` blocks + final LayerNorm."""

  num_layers: int
  mlp_dim: int
  num_heads: int
  num_prefix_tokens: int = 1
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  drop_path_rate: float = 0.0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  scan_layers: bool = False
  remat_policy: Optional[str] = None
  sow_attention_weights: bool = False
  attention_impl: Optional[str] = None

  @nn.compact
  def __call__(self, x, *, grid: Tuple[int, int], train: bool):
    x = AddPositionEmbs(grid, self.num_prefix_tokens, self.param_dtype,
                        name="posembed_input")(x)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)

    block_cls = Encoder1DBlock
    if self.remat_policy not in (None, "none"):
      block_cls = nn.remat(block_cls, policy=_remat_policy(self.remat_policy))
    # Stochastic depth rate grows linearly from 0 (first block) to the rate.
    rates = np.linspace(0.0, self.drop_path_rate, self.num_layers)
    kwargs = dict(
        mlp_dim=self.mlp_dim, num_heads=self.num_heads, dtype=self.dtype,
        param_dtype=self.param_dtype, dropout_rate=self.dropout_rate,
        attention_dropout_rate=self.attention_dropout_rate,
        use_drop_path=self.drop_path_rate > 0.0, deterministic=not train,
        sow_attention_weights=self.sow_attention_weights,
        attention_impl=self.attention_impl)

    if self.scan_layers:
      scanned = nn.scan(
          block_cls,
          variable_axes={"params": 0, "intermediates": 0},
          split_rngs={"params": True, "dropout": True},
          in_axes=0, length=self.num_layers)
      x, outs = scanned(name="encoderblock", **kwargs)(
          x, jnp.asarray(rates, jnp.float32))
      block_outputs = [outs[i] for i in range(self.num_layers)]
    else:
      block_outputs = []
      for i in range(self.num_layers):
        x, _ = block_cls(name=f"encoderblock_{i}", **kwargs)(x, float(rates[i]))
        block_outputs.append(x)
    encoded = nn.LayerNorm(epsilon=_LN_EPS, dtype=self.dtype,
                           param_dtype=self.param_dtype, name="encoder_norm")(x)
    return encoded, block_outputs


def _remat_policy(name: str):
  policies = {
      "full": None,  # save nothing, recompute everything
      "dots": jax.checkpoint_policies.checkpoint_dots,
      "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
      "nothing": jax.checkpoint_policies.nothing_saveable,
  }
  if name not in policies:
    raise ValueError(f"remat_policy={name!r}: expected None or one of "
                     f"{sorted(policies)}")
  return policies[name]
