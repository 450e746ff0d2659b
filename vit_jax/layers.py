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
import numpy as np

Dtype = Any

_KERNEL_INIT = nn.initializers.xavier_uniform()
_BIAS_INIT = nn.initializers.normal(stddev=1e-6)
_LN_EPS = 1e-6


def _gelu(x):
  return nn.gelu(x, approximate=False)


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


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head self-attention with linen's parameter layout.

  Parameters are exactly those of ``flax.linen.MultiHeadDotProductAttention``
  (``query``/``key``/``value`` kernels (D, H, D/H), ``out`` kernel
  (H, D/H, D)), but the three input projections run as one fused matmul and
  the attention itself uses ``jax.nn.dot_product_attention`` unless the
  weights are wanted (``sow_weights``) or attention dropout is active.
  """

  num_heads: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  dropout_rate: float = 0.0
  deterministic: bool = True
  sow_weights: bool = False
  attention_impl: Optional[str] = None  # None | 'xla' | 'cudnn'

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
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
    # Fused q/k/v projection: one (D, 3*D) matmul instead of three.
    w = jnp.stack([k for k, _ in projs], axis=1)  # (D, 3, H, hd)
    b = jnp.stack([b for _, b in projs], axis=0)  # (3, H, hd)
    x, w, b, out_kernel, out_bias = nn.dtypes.promote_dtype(
        x, w, b, out_kernel, out_bias, dtype=self.dtype)
    qkv = jnp.einsum("bnd,dthk->tbnhk", x, w) + b[:, None, None]
    q, k, v = qkv[0], qkv[1], qkv[2]

    use_dropout = self.dropout_rate > 0.0 and not self.deterministic
    if self.sow_weights or use_dropout:
      scale = 1.0 / math.sqrt(hd)
      logits = jnp.einsum("bqhk,bshk->bhqs", q * scale, k)
      weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
      weights = weights.astype(self.dtype)
      if self.sow_weights:
        self.sow("intermediates", "attention_weights", weights)
      if use_dropout:
        weights = nn.Dropout(self.dropout_rate)(weights, deterministic=False)
      y = jnp.einsum("bhqs,bshk->bqhk", weights, v)
    else:
      y = jax.nn.dot_product_attention(q, k, v, implementation=self.attention_impl)
    return jnp.einsum("bnhk,hkd->bnd", y, out_kernel) + out_bias


class MlpBlock(nn.Module):
  """Dense -> exact GELU -> dropout -> Dense -> dropout."""

  mlp_dim: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  dropout_rate: float = 0.0
  deterministic: bool = True

  @nn.compact
  def __call__(self, x):
    dense = functools.partial(nn.Dense, dtype=self.dtype,
                              param_dtype=self.param_dtype,
                              kernel_init=_KERNEL_INIT, bias_init=_BIAS_INIT)
    d = x.shape[-1]
    x = dense(self.mlp_dim)(x)
    x = _gelu(x)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=self.deterministic)
    x = dense(d)(x)
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
