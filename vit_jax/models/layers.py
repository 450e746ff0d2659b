"""Building blocks of the Vision Transformer encoder (Flax linen).

Parameter names follow google-research/vision_transformer's linen modules
(``LayerNorm_0``, ``MultiHeadDotProductAttention_0/{query,key,value,out}``,
``LayerNorm_1``, ``MlpBlock_0/{Dense_0,Dense_1}``, ``posembed_input``,
``encoder_norm``) and big_vision's (``MAPHead_0``); options that other
families need (LayerScale, a pre-norm, registers' position rows) add
parameters only when they are on. :mod:`vit_jax.models` assembles the
blocks; the arithmetic lives in :mod:`vit_jax.models.kernels`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from vit_jax.models import cait, diffattn, interpolate, kernels, naflex, relpos
from vit_jax.models import rope as rope_lib
from vit_jax.models import sam as sam_lib

Dtype = Any

_KERNEL_INIT = nn.initializers.xavier_uniform()
_BIAS_INIT = nn.initializers.normal(stddev=1e-6)
LN_EPS = 1e-6
_SQRT1_2 = 1.0 / math.sqrt(2.0)


# --------------------------------------------------------------------------- #
# Activations.
# --------------------------------------------------------------------------- #


def gelu(x):
  """Exact (erf) GELU, written as torch computes it: x/2 * (1 + erf(x/sqrt2)).

  The same function as ``nn.gelu(x, approximate=False)``, which goes through
  ``erfc`` (an exp plus polynomials per element on XLA:CPU); ``erf`` is one
  rational polynomial, which makes the MLP block ~10% faster on CPU, forward
  and backward (bench/README.md), and follows torchvision's formula.
  """
  return x * 0.5 * (1.0 + lax.erf(x * _SQRT1_2))


def quick_gelu(x):
  """OpenAI CLIP's QuickGELU: x * sigmoid(1.702 x)."""
  return x * jax.nn.sigmoid(1.702 * x)


def gelu_tanh(x):
  """GELU's tanh approximation (torch's ``GELU(approximate='tanh')``,
  flax's default ``nn.gelu``): used by SigLIP and big_vision."""
  return jax.nn.gelu(x, approximate=True)


ACTIVATIONS = {"gelu": gelu, "quick_gelu": quick_gelu, "gelu_tanh": gelu_tanh,
               "silu": jax.nn.silu}  # silu: the gate of SwiGLU MLPs


def activation(name: str):
  if name not in ACTIVATIONS:
    raise ValueError(f"act={name!r}: expected one of {sorted(ACTIVATIONS)}")
  return ACTIVATIONS[name]


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


# --------------------------------------------------------------------------- #
# Dense layers.
# --------------------------------------------------------------------------- #


class LayerNorm(nn.Module):
  """``nn.LayerNorm``'s parameters (``scale``, ``bias``), initialisers and
  function (float32 statistics, output in ``dtype``), computed by
  :func:`vit_jax.models.kernels.layer_norm` (a closed-form backward pass)."""

  epsilon: float = 1e-6
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32
  use_bias: bool = True
  use_scale: bool = True

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    scale = (self.param("scale", nn.initializers.ones_init(), (d,),
                        self.param_dtype) if self.use_scale else None)
    bias = (self.param("bias", nn.initializers.zeros_init(), (d,),
                       self.param_dtype) if self.use_bias else None)
    out_dtype = self.dtype or jnp.result_type(x.dtype, self.param_dtype)
    if x.ndim > 2 and jax.default_backend() != "cpu":
      # Off the CPU the norm runs on the (tokens, D) rows. With (B, N, D)
      # norms XLA:GPU's layout assignment laid the whole residual stream
      # out batch-minor ({0,2,1}) and transposed it around the norms and
      # GEMMs, forward and backward: ViT-B/16's train step on an H200
      # ran 3,535 img/s with 2-D rows against 3,334-3,356 without
      # (docs/accelerators.md). The CPU's programs are unchanged.
      return kernels.layer_norm(x.reshape(-1, d), scale, bias, self.epsilon,
                                jnp.dtype(out_dtype)).reshape(x.shape)
    return kernels.layer_norm(x, scale, bias, self.epsilon,
                              jnp.dtype(out_dtype))


class RMSNorm(nn.Module):
  """Root-mean-square norm (timm's ``RmsNorm``, AIMv2): ``x / sqrt(mean(x^2)
  + eps) * scale``, statistics in float32, output in ``dtype``. Parameter
  ``scale`` only (no bias), so a tree's norms say which kind they are."""

  epsilon: float = 1e-6
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones_init(), (x.shape[-1],),
                       self.param_dtype)
    out_dtype = self.dtype or jnp.result_type(x.dtype, self.param_dtype)
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) +
                       self.epsilon)
    return (y * scale.astype(jnp.float32)).astype(out_dtype)


NORMS = ("layer", "rms")


def norm_layer(norm_type: str, epsilon: float, dtype, param_dtype):
  """A constructor of the model's norm: ``'layer'`` (LayerNorm) or
  ``'rms'`` (RMSNorm), taking ``name=``."""
  if norm_type == "layer":
    return functools.partial(LayerNorm, epsilon=epsilon, dtype=dtype,
                             param_dtype=param_dtype)
  if norm_type == "rms":
    return functools.partial(RMSNorm, epsilon=epsilon, dtype=dtype,
                             param_dtype=param_dtype)
  raise ValueError(f"norm_type={norm_type!r}: expected one of {NORMS}")


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """What every encoder block shares: the one record of the block options.

  Built once from :class:`~vit_jax.models.VisionTransformer`'s public
  fields of the same names (:meth:`of`) and passed down whole: the encoder
  gives it to each block, each block to its attention and MLP, which read
  the options they use. A new block option is a field here and on
  ``VisionTransformer`` (and in the weights table that maps it), nothing in
  between. The meaning of each field is documented on
  ``VisionTransformer``; ``rope`` is the rotary variant (its tables are
  built once by the encoder and passed to every block).
  """

  num_heads: int = 12
  mlp_dim: int = 3072
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  sow_attention_weights: bool = False
  attention_impl: Optional[str] = None
  layer_scale_init: Optional[float] = None
  layer_norm_eps: float = LN_EPS
  act: str = "gelu"
  qkv_bias: bool = True
  key_bias: bool = True
  proj_bias: bool = True
  qk_norm: bool = False
  attn_norm: bool = False
  norm_type: str = "layer"
  gated_mlp: Optional[str] = None
  mlp_norm: bool = False
  mlp_input_norm: bool = False
  post_norm: bool = False
  rope: Optional[str] = None
  rel_pos_bias: Optional[str] = None  # BEiT's / timm's relpos bias
  rel_pos_mlp: Optional[str] = None  # ... from an MLP (timm's RelPosMlp)
  rel_pos_mlp_dim: int = 128
  rel_pos: bool = False  # SAM's decomposed relative positions
  talking_heads: bool = False  # CaiT's logits mixed across heads
  diff_attn: Optional[str] = None  # differential attention ('qk' | 'dual')
  parallel: Optional[str] = None  # attention and MLP side by side

  @classmethod
  def of(cls, module) -> "BlockConfig":
    """The record of ``module``'s fields of the same names (a
    ``VisionTransformer``)."""
    return cls(**{f.name: getattr(module, f.name)
                  for f in dataclasses.fields(cls)})

  def norm(self):
    """The constructor of the blocks' norm (takes ``name=``)."""
    return norm_layer(self.norm_type, self.layer_norm_eps, self.dtype,
                      self.param_dtype)


class _Projection(nn.Module):
  """Holds a DenseGeneral-shaped kernel and bias (names as linen's)."""

  kernel_shape: Tuple[int, ...]
  bias_shape: Tuple[int, ...]
  param_dtype: Dtype = jnp.float32
  use_bias: bool = True

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
    bias = (self.param("bias", nn.initializers.zeros, self.bias_shape,
                       self.param_dtype) if self.use_bias else None)
    return kernel, bias


class Dense(nn.Module):
  """``nn.Dense``'s parameters (``kernel`` (in, out), ``bias``) and init,
  computed with :func:`vit_jax.models.kernels.dense` (the fast low-precision path
  on CPU)."""

  features: int
  param_dtype: Dtype = jnp.float32
  kernel_init: Any = _KERNEL_INIT
  bias_init: Any = _BIAS_INIT
  use_bias: bool = True

  @nn.compact
  def __call__(self, x, out_dtype=None, with_gelu: bool = False):
    """``with_gelu``: returns ``gelu(x @ kernel + bias)`` (one op with its own
    backward in float32, :func:`vit_jax.models.kernels.dense_gelu`)."""
    kernel = self.param("kernel", self.kernel_init,
                        (x.shape[-1], self.features), self.param_dtype)
    bias = (self.param("bias", self.bias_init, (self.features,),
                       self.param_dtype) if self.use_bias else None)
    if with_gelu:
      if out_dtype is None:
        y = kernels.dense_gelu(x, kernel, bias)
        if y is not None:
          return y
      return gelu(kernels.dense(x, kernel, bias, out_dtype))
    return kernels.dense(x, kernel, bias, out_dtype)


class PatchEmbed(nn.Module):
  """``nn.Conv(features, (p, p), strides=(p, p), padding='VALID')``: its
  parameters (``kernel`` (p, p, C, features), ``bias``), initialisers and
  function, computed as one GEMM of the flattened patches
  (B*h*w, p*p*C) @ (p*p*C, features) through :func:`vit_jax.models.kernels.dense`.

  XLA:CPU runs the strided convolution and its kernel gradient far below
  GEMM speed, and in bfloat16 upcasts both to float32 (bench/README.md);
  the patch GEMM takes the fast paths of every other dense layer. Rows and
  columns past the last whole patch are dropped, as a VALID convolution
  does. ``patch_size=1`` is a 1x1 convolution (the last layer of a
  convolutional stem).
  """

  features: int
  patch_size: int
  use_bias: bool = True
  dtype: Optional[Dtype] = None
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, patches: bool = False):
    """``x``: images (B, H, W, C) -> (B, h, w, features); with ``patches``
    already cut patches (B, N, p*p*C) in (y, x, channel) order (a NaFlex
    batch) -> (B, N, features): the same kernel as one matrix."""
    p = self.patch_size
    if patches:
      b, n, k = x.shape
      c = k // (p * p)
    else:
      b, height, width, c = x.shape
    kernel = self.param("kernel", nn.linear.default_kernel_init,
                        (p, p, c, self.features), self.param_dtype)
    bias = (self.param("bias", nn.initializers.zeros_init(), (self.features,),
                       self.param_dtype) if self.use_bias else None)
    if patches:
      x = x.astype(self.dtype or jnp.result_type(x.dtype, self.param_dtype))
      y = kernels.dense(x.reshape(b * n, k),
                        kernel.reshape(p * p * c, self.features), bias)
      return y.reshape(b, n, self.features)
    h, w = height // p, width // p
    x = x[:, :h * p, :w * p].astype(self.dtype or jnp.result_type(
        x.dtype, self.param_dtype))
    patches = x.reshape(b, h, p, w, p, c).transpose(0, 1, 3, 2, 4, 5)
    y = kernels.dense(patches.reshape(b * h * w, p * p * c),
                      kernel.reshape(p * p * c, self.features), bias)
    return y.reshape(b, h, w, self.features)


def _project(x2d, kernel, bias):
  """(M, K) @ DenseGeneral kernel (K as one or more leading axes, ...) +
  bias -> (M, prod(...)): one plain 2-D GEMM, no transposes around it."""
  return kernels.dense(x2d, kernel.reshape(x2d.shape[-1], -1),
                       None if bias is None else bias.reshape(-1))


# --------------------------------------------------------------------------- #
# Attention, MLP, LayerScale, blocks.
# --------------------------------------------------------------------------- #


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head dot-product attention with linen's parameter layout.

  Parameters are exactly those of ``flax.linen.MultiHeadDotProductAttention``
  (``query``/``key``/``value`` kernels (D, H, D/H), ``out`` kernel
  (H, D/H, D)); ``qkv_bias=False`` drops the query/key/value biases. Self-
  attention by default; ``inputs_kv`` gives cross-attention (the MAP head's
  probe attending to the tokens). Every projection runs as one plain 2-D GEMM
  on the (batch * tokens, D) activations. Which attention computation runs is
  :func:`vit_jax.models.kernels.choose_attention`'s decision; all compute the same
  function. Attention weights are sown with ``sow_weights`` and dropped out
  with an active dropout rate.

  Its options are the :class:`BlockConfig` ``config`` (``num_heads``,
  ``dtype``, ``attention_dropout_rate``, ``sow_attention_weights``,
  ``attention_impl``, ``qkv_bias``; the newer families', each adding
  parameters only when on: ``key_bias=False`` (query and value biases but
  none on the key: EVA, DINOv3), ``proj_bias=False`` (no bias on ``out``:
  AIMv2), ``qk_norm`` (a norm over each head's queries and keys: linen's
  ``query_ln`` / ``key_ln``), ``attn_norm`` (a norm of the heads' output
  before the out projection: EVA-02 CLIP's ``inner_norm``).
  ``rope=(sin, cos, kind)`` rotates the queries and keys after those norms
  (:mod:`vit_jax.models.rope`). ``mask`` (B, S) bool: the keys that may be
  read (a NaFlex batch's padding is not); every path computes the same
  masked function. ``rel_pos``: a relative position bias (BEiT's, timm's
  ``vision_transformer_relpos``; :mod:`vit_jax.models.relpos`): the
  shared (heads, T, T) bias, and/or with ``rel_pos_bias='block'`` this
  attention's own table or MLP (``rel_pos_bias/...``) for the input's
  patch grid (``grids``); the logits with a bias go through
  :func:`relpos.attention_impl`'s path.
  ``decomposed=(grid, table)``: SAM's decomposed relative positions over
  the tokens' (h, w) ``grid`` (a per-query bias), parameters
  ``rel_pos_h`` / ``rel_pos_w`` made for ``table``
  (:mod:`vit_jax.models.sam`); they take :func:`sam.attention_impl`'s path.
  Every bias given is added to the logits, a key mask's included.
  ``talking_heads``: CaiT's logits and probabilities mixed across heads
  (``proj_l`` / ``proj_w``, :mod:`vit_jax.models.cait`), computed as XLA
  ops with both materialised.
  """

  config: BlockConfig = BlockConfig()
  deterministic: bool = True
  grids: Optional[relpos.Grids] = None  # for rel_pos_bias='block'

  @nn.compact
  def __call__(self, inputs_q, inputs_kv=None, rope=None, mask=None,
               rel_pos=None, decomposed=None, lambda_init=None):
    cfg = self.config
    inputs_kv = inputs_q if inputs_kv is None else inputs_kv
    b, n, d = inputs_q.shape
    s = inputs_kv.shape[1]
    if d % cfg.num_heads:
      raise ValueError(
          f"hidden size {d} is not divisible by num_heads={cfg.num_heads}")
    h, hd = cfg.num_heads, d // cfg.num_heads
    qkv = [_Projection((d, h, hd), (h, hd), cfg.param_dtype,
                       use_bias=cfg.qkv_bias and (
                           name != "key" or cfg.key_bias), name=name)()
           for name in ("query", "key", "value")]
    out_kernel, out_bias = _Projection((h, hd, d), (d,), cfg.param_dtype,
                                       use_bias=cfg.proj_bias, name="out")()
    rate = cfg.attention_dropout_rate
    use_dropout = rate > 0.0 and not self.deterministic
    impl = kernels.choose_attention(
        jax.default_backend(), jnp.dtype(cfg.dtype), hd,
        requested=cfg.attention_impl, dropout=use_dropout,
        sow_weights=cfg.sow_attention_weights)
    # cuDNN's training kernels take even lengths only: an odd self-attention
    # gets its one masked token here, before the projections, where the pad
    # joins the LayerNorm's pass and the slice the residual's, instead of
    # q, k, v padded and the output sliced (8 more passes over the tokens per
    # block, forward and backward; kernels.padded_attention).
    pad = (impl == "cudnn" and n % 2 == 1 and inputs_kv is inputs_q
           and mask is None and rope is None and rel_pos is None
           and decomposed is None and cfg.rel_pos_bias is None
           and not cfg.talking_heads and cfg.diff_attn is None)
    n_real = n
    if pad:
      inputs_q = inputs_kv = jnp.pad(inputs_q, ((0, 0), (0, 1), (0, 0)))
      n = s = n + 1
    # Three (B*N, D) x (D, D) GEMMs. One fused (D, 3D) GEMM would need the
    # three kernels concatenated on every call (a copy of 3*D*D weights
    # that costs more on CPU than it saves; measured in bench/README.md).
    xq = inputs_q.astype(cfg.dtype).reshape(b * n, d)
    xkv = xq if inputs_kv is inputs_q else inputs_kv.astype(
        cfg.dtype).reshape(b * s, d)
    # Fused self-attention whose rows of weights each sum to one (no mask,
    # bias, dropout or per-position rotation of the keys): the key bias adds
    # the same q . b_k to every logit of a query, which the softmax cancels,
    # and the value bias leaves every head's output as itself, so it joins
    # the out projection's bias as b_v @ W_out. Both exactly; cuDNN then
    # reads the GEMMs' outputs without two bias passes (and their gradient
    # sums) per block. Only where cuDNN is chosen, so never on a CPU.
    fold = (impl == "cudnn" and inputs_kv is inputs_q and mask is None
            and rope is None and not cfg.qk_norm and rel_pos is None
            and decomposed is None and cfg.rel_pos_bias is None
            and not cfg.talking_heads and cfg.diff_attn is None
            and not cfg.attn_norm and not use_dropout
            and not cfg.sow_attention_weights)
    q = _project(xq, *qkv[0]).reshape(b, n, h, hd)
    if fold:
      k = _project(xkv, qkv[1][0], None).reshape(b, s, h, hd)
      v = _project(xkv, qkv[2][0], None).reshape(b, s, h, hd)
      if qkv[2][1] is not None:
        folded = jnp.matmul(qkv[2][1].reshape(-1),
                            out_kernel.reshape(h * hd, d),
                            precision=jax.lax.Precision.HIGHEST)
        out_bias = folded if out_bias is None else out_bias + folded
    else:
      k = _project(xkv, *qkv[1]).reshape(b, s, h, hd)
      v = _project(xkv, *qkv[2]).reshape(b, s, h, hd)
    norm = cfg.norm()
    if cfg.diff_attn is not None:  # two maps per head (diffattn)
      y = self._differential(q, k, v, mask, lambda_init, use_dropout)
      if cfg.attn_norm:
        y = norm(name="inner_norm")(y)
      return _project(y, out_kernel, out_bias).reshape(b, n, d)
    if cfg.qk_norm:
      q, k = norm(name="query_ln")(q), norm(name="key_ln")(k)
    if rope is not None:
      sin, cos, kind = rope
      q, k = rope_lib.apply(q, sin, cos, kind), rope_lib.apply(k, sin, cos, kind)
    tables = None
    if decomposed is not None:  # SAM's decomposed relative positions
      grid, table = decomposed
      tables = (*sam_lib.rel_pos_tables(self, table, hd, cfg.param_dtype),
                grid)

    if cfg.rel_pos_bias == "block" and inputs_kv is inputs_q:
      own = relpos.bias_module(cfg, self.deterministic)(self.grids, n)
      rel_pos = own if rel_pos is None else rel_pos + own
    if tables is not None:  # 'weights', whatever else is given
      impl = sam_lib.attention_impl(impl, cfg.attention_impl)
    elif rel_pos is not None:
      impl = relpos.attention_impl(impl, cfg.attention_impl)
    scale = 1.0 / math.sqrt(hd)
    if cfg.talking_heads:  # CaiT: the heads' logits and weights mixed
      weights = cait.talking_heads_weights(
          q, k, scale, cait.HeadMix(cfg.param_dtype, name="proj_l"),
          cait.HeadMix(cfg.param_dtype, name="proj_w")).astype(cfg.dtype)
      if cfg.sow_attention_weights:
        self.sow("intermediates", "attention_weights", weights)
      if use_dropout:
        weights = nn.Dropout(rate)(weights, deterministic=False)
      y = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    elif impl in ("matmul", "weights"):
      qh, kh, vh = (kernels.head_major(t) for t in (q, k, v))
      bias = None if mask is None else naflex.attention_bias(mask)
      if rel_pos is not None:  # (1, H, T, T), plus a key mask's bias
        bias = rel_pos[None] if bias is None else bias + rel_pos[None]
      chunked = (tables is not None and bias is None and not use_dropout
                 and not cfg.sow_attention_weights
                 and sam_lib.query_chunks(n) > 1)
      if tables is not None and not chunked:  # (B, H, N, N)
        decomposed_bias = sam_lib.decomposed_bias(q, *tables)
        bias = (decomposed_bias if bias is None
                else bias + decomposed_bias)
      if chunked:  # the weights need not exist all at once
        oh = sam_lib.decomposed_attention(q, qh, kh, vh, *tables, scale,
                                          cfg.dtype)
      elif impl == "weights":
        weights = kernels.attention_weights(qh, kh, scale, bias).astype(
            cfg.dtype)
        if cfg.sow_attention_weights:
          self.sow("intermediates", "attention_weights", weights)
        if use_dropout:
          weights = nn.Dropout(rate)(weights, deterministic=False)
        oh = jnp.einsum("bhqk,bhkd->bhqd", weights, vh)
      elif bias is None:
        oh = kernels.attention(qh, kh, vh, scale)
      else:
        oh = kernels.attention(qh, kh, vh, scale, bias)
      y = jnp.transpose(oh, (0, 2, 1, 3))  # (B, N, H, hd)
    elif rel_pos is not None:
      y = _fused_attention(q, k, v, mask, impl, fallback=False,
                           bias=rel_pos[None])
    else:
      y = _fused_attention(q, k, v, mask, impl,
                           fallback=cfg.attention_impl is None,
                           valid=n_real if pad else None)
    y = y.reshape(b * n, d)
    if cfg.attn_norm:
      y = norm(name="inner_norm")(y)
    return _project(y, out_kernel, out_bias).reshape(b, n, d)[:, :n_real]

  def _differential(self, q, k, v, mask, lambda_init, use_dropout):
    """Differential attention (:mod:`vit_jax.models.diffattn`) of q, k, v
    (B, N, H, hd) -> the heads' outputs (B * N, H * hd), before the out
    projection; ``lambda_init`` the block's (default: the first
    block's)."""
    cfg = self.config
    b, n, h, hd = q.shape
    init = diffattn.lambda_init(0) if lambda_init is None else lambda_init
    q, k = diffattn.halves(q), diffattn.halves(k)
    if cfg.qk_norm:  # over the half-width heads, as timm's
      norm = cfg.norm()
      q, k = norm(name="query_ln")(q), norm(name="key_ln")(k)
    lam = diffattn.lambdas(self, cfg.diff_attn, hd // 2, cfg.param_dtype,
                           init)
    bias = None if mask is None else naflex.attention_bias(mask)
    weights = diffattn.weights(q, k, lam, bias).astype(cfg.dtype)
    if cfg.sow_attention_weights:
      self.sow("intermediates", "attention_weights", weights)
    if use_dropout:
      weights = nn.Dropout(cfg.attention_dropout_rate)(weights,
                                                       deterministic=False)
    y = jnp.einsum("bhqk,bkhd->bqhd", weights, v.astype(cfg.dtype))
    y = RMSNorm(epsilon=diffattn.SUB_NORM_EPS, dtype=cfg.dtype,
                param_dtype=cfg.param_dtype, name="sub_norm")(y)
    y = y * (1.0 - jnp.asarray(init, jnp.float32)).astype(y.dtype)
    return y.reshape(b * n, h * hd)


def _fused_attention(q, k, v, mask, impl: str, *, fallback: bool,
                     bias=None, valid=None):
  """``jax.nn.dot_product_attention`` ('xla' or 'cudnn'); ``mask`` (B, S)
  marks the keys to attend to. cuDNN runs through
  :func:`kernels.padded_attention` (its training kernels refuse odd
  lengths) and, with a mask, :func:`kernels.masked_attention` (the mask
  as sequence lengths, each row's valid keys moved first). A cuDNN
  call JAX refuses while tracing (for these shapes: NotImplementedError;
  no cuDNN, as on a ROCm GPU: RuntimeError) runs XLA's where ``fallback``
  (the implementation was chosen, not requested); an error of the run
  itself (JaxRuntimeError: out of memory, a failed kernel) is raised.
  ``bias`` (1, H, N, S): added to the logits (XLA's path only).
  ``valid``: q, k and v were padded at the end; only their first ``valid``
  tokens are real (keys past them are masked out; their query rows are
  the caller's to drop)."""
  if valid is not None:  # no mask and no bias here (the caller's check)
    b = q.shape[0]
    lengths = jnp.full((b,), valid, jnp.int32)
    try:
      return jax.nn.dot_product_attention(
          q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
          implementation=impl)
    except (NotImplementedError, RuntimeError) as e:
      if (impl != "cudnn" or not fallback or
          isinstance(e, jax.errors.JaxRuntimeError)):
        raise
      return jax.nn.dot_product_attention(
          q, k, v, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
          implementation="xla")
  if bias is not None:
    b, n, s = q.shape[0], q.shape[1], k.shape[1]
    return jax.nn.dot_product_attention(
        q, k, v, bias=bias, implementation=impl, mask=None if mask is None
        else jnp.broadcast_to(mask[:, None, None, :], (b, 1, n, s)))
  try:
    if impl == "cudnn":
      if mask is None:
        return kernels.padded_attention(q, k, v, implementation="cudnn")
      return kernels.masked_attention(q, k, v, mask, implementation="cudnn")
    if mask is None:
      return jax.nn.dot_product_attention(q, k, v, implementation=impl)
    b, n, s = q.shape[0], q.shape[1], k.shape[1]
    return jax.nn.dot_product_attention(
        q, k, v, mask=jnp.broadcast_to(mask[:, None, None, :], (b, 1, n, s)),
        implementation=impl)
  except (NotImplementedError, RuntimeError) as e:
    if (impl != "cudnn" or not fallback or
        isinstance(e, jax.errors.JaxRuntimeError)):
      raise
    return _fused_attention(q, k, v, mask, "xla", fallback=False)


class MlpBlock(nn.Module):
  """Dense -> activation -> dropout -> Dense -> dropout, of the
  :class:`BlockConfig` ``config`` (``mlp_dim``, ``act``, ``dropout_rate``,
  ``dtype``).

  ``gated_mlp`` makes it a gated linear unit (SwiGLU with ``act='silu'``):
  ``Dense_1(act(gate) * value)``. ``'packed'``: gate and value are the two
  halves of one ``Dense_0`` of width 2 * ``mlp_dim`` (the gate first: timm's
  ``GluMlp`` / ``SwiGLUPacked``, DINOv2 giant, EVA-02 Ti/S); ``'split'``:
  ``Gate_0`` and ``Dense_0`` (timm's ``SwiGLU`` ``fc1_g`` / ``fc1_x``:
  DINOv3 S+/H+/7B, EVA-02 B/L, AIMv2). ``mlp_norm``: a norm over the hidden
  layer before ``Dense_1`` (``LayerNorm_0``; EVA-02 B/L);
  ``mlp_input_norm``: a norm over its input (``InputNorm``; ViTamin's
  ``GeGluMlp``, a split GELU-gated MLP).
  ``proj_bias=False``: no biases (AIMv2).
  """

  config: BlockConfig = BlockConfig()
  deterministic: bool = True

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    d, width = x.shape[-1], cfg.mlp_dim
    if cfg.mlp_input_norm:
      x = cfg.norm()(name="InputNorm")(x)
    x = x.astype(cfg.dtype)
    # In bf16/f16 the activation runs in float32 (exact-erf GELU and its
    # gradient are less accurate in bf16, and slower on CPU). On the CPU
    # the hidden layer leaves its GEMM in float32 (the GEMM accumulates in
    # float32 anyway). On a GPU / TPU it stays in the compute dtype between
    # ops, as under torch's autocast, and is widened inside the
    # activation's fused elementwise op: the (tokens, mlp_dim) tensors are
    # the largest a block writes, and in float32 their writes, reads and
    # roundings took 7 of ViT-B/16's 83 ms train step on an H200
    # (docs/accelerators.md).
    low = x.dtype in (jnp.bfloat16, jnp.float16)
    wide_hidden = low and jax.default_backend() == "cpu"
    hidden_dtype = jnp.float32 if wide_hidden else None
    dense = functools.partial(Dense, param_dtype=cfg.param_dtype,
                              use_bias=cfg.proj_bias)
    act = activation(cfg.act)
    if low and not wide_hidden:
      act = functools.partial(kernels.widened, act)
    if cfg.gated_mlp is None and cfg.act == "gelu":
      x = dense(width, name="Dense_0")(x, out_dtype=hidden_dtype,
                                       with_gelu=True)
    elif cfg.gated_mlp is None:
      x = act(dense(width, name="Dense_0")(x, out_dtype=hidden_dtype))
    elif cfg.gated_mlp == "packed":
      h = dense(2 * width, name="Dense_0")(x, out_dtype=hidden_dtype)
      x = act(h[..., :width]) * h[..., width:]
    elif cfg.gated_mlp == "split":
      gate = dense(width, name="Gate_0")(x, out_dtype=hidden_dtype)
      value = dense(width, name="Dense_0")(x, out_dtype=hidden_dtype)
      x = act(gate) * value
    else:
      raise ValueError(f"gated_mlp={cfg.gated_mlp!r}: expected None, "
                       f"'packed' or 'split'")
    x = x.astype(cfg.dtype)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=self.deterministic)
    if cfg.mlp_norm:
      x = cfg.norm()(name="LayerNorm_0")(x)
    # A fused parallel block's one output bias is the attention's.
    x = dense(d, name="Dense_1",
              use_bias=cfg.proj_bias and cfg.parallel != "fused")(x)
    return nn.Dropout(cfg.dropout_rate)(x, deterministic=self.deterministic)


class LayerScale(nn.Module):
  """Per-channel scale of a residual branch (CaiT, DeiT-III, DINOv2):
  ``scale`` (D,), initialised to ``init_value``."""

  init_value: float
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.constant(self.init_value),
                       (x.shape[-1],), self.param_dtype)
    return x * scale.astype(x.dtype)


class Encoder1DBlock(nn.Module):
  """Transformer block of the :class:`BlockConfig` ``config``: pre-norm
  x + MHSA(LN(x)); x + MLP(LN(x)), each branch optionally scaled by
  LayerScale (``layer_scale_init``); with ``post_norm`` the norm closes
  each branch instead, x + LN(MHSA(x)); x + LN(MLP(x)) (timm's
  ``ResPostBlock``, Swin v2's res-post-norm).

  Returns ``(output, output)`` so the same module runs under ``nn.scan``.
  ``drop_path_rate`` is this block's stochastic-depth rate (a float, or a
  traced scalar under ``nn.scan``); ``rope``: the (sin, cos) rotary tables
  of ``config.rope`` for the token grid, shared by every block ('mixed':
  this block's own, (T, heads, head_dim)); ``mask``
  (B, T) bool: the tokens attention may read (a NaFlex batch's padding is
  not). The norms are ``LayerNorm_0`` / ``LayerNorm_1`` whatever their
  kind (an RMSNorm has a ``scale`` and no ``bias``) or place.
  ``rel_pos``: the shared relative position bias (heads, T, T) of
  ``rel_pos_bias='shared'``; ``grids``: the input's patch grid, for the
  attention's own table or MLP with ``rel_pos_bias='block'``
  (:mod:`vit_jax.models.relpos`). ``spatial``: how a SAM block attends
  over the patch grid (windows, decomposed relative positions;
  :func:`vit_jax.models.sam.attend`), in place of plain attention.
  ``lambda_init``: the block's constant of differential attention
  (``config.diff_attn``; :mod:`vit_jax.models.diffattn`). With
  ``config.parallel`` the attention and the MLP read the same norm and
  their sum is one branch, x + LS(MHSA(LN(x)) + MLP(LN(x))) (timm's
  ``ParallelScalingBlock``, ViT-22B's): ``LayerNorm_0``, ``LayerScale_0``
  only.
  """

  config: BlockConfig = BlockConfig()
  use_drop_path: bool = False
  deterministic: bool = True
  grids: Optional[relpos.Grids] = None  # rel_pos_bias='block'
  spatial: Optional[sam_lib.Spatial] = None  # SAM: windows, rel-pos

  @nn.compact
  def __call__(self, inputs, drop_path_rate=0.0, rope=None, mask=None,
               rel_pos=None, lambda_init=None):
    cfg = self.config
    norm = cfg.norm()
    drop_path = (
        lambda y: _drop_path(self, y, drop_path_rate, self.deterministic)
    ) if self.use_drop_path else (lambda y: y)
    scale = (
        lambda y: LayerScale(cfg.layer_scale_init, cfg.param_dtype)(y)
    ) if cfg.layer_scale_init is not None else (lambda y: y)
    # Pre-norm: the norm opens each branch; post-norm: it closes it.
    if cfg.post_norm:
      pre = lambda name, y: y  # noqa: E731
      post = lambda name, y: norm(name=name)(y)  # noqa: E731
    else:
      pre = lambda name, y: norm(name=name)(y)  # noqa: E731
      post = lambda name, y: y  # noqa: E731

    x = pre("LayerNorm_0", inputs)
    attention = MultiHeadDotProductAttention(
        cfg, deterministic=self.deterministic, grids=self.grids,
        name="MultiHeadDotProductAttention_0")
    kw = {} if lambda_init is None else {"lambda_init": lambda_init}
    if cfg.parallel is not None:  # x + LS(attn(LN(x)) + MLP(LN(x)))
      y = attention(x, rope=None if rope is None else (*rope, cfg.rope),
                    mask=mask, rel_pos=rel_pos, **kw)
      y = nn.Dropout(cfg.dropout_rate)(y, deterministic=self.deterministic)
      y = y + MlpBlock(cfg, deterministic=self.deterministic,
                       name="MlpBlock_0")(x)
      out = inputs + drop_path(scale(y))
      return out, out
    if self.spatial is None:
      x = attention(x, rope=None if rope is None else (*rope, cfg.rope),
                    mask=mask, rel_pos=rel_pos, **kw)
    else:  # SAM: within windows, with decomposed relative positions
      x = sam_lib.attend(attention, x, self.spatial, cfg.rel_pos)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=self.deterministic)
    x = drop_path(scale(post("LayerNorm_0", x))) + inputs

    y = pre("LayerNorm_1", x)
    y = MlpBlock(cfg, deterministic=self.deterministic, name="MlpBlock_0")(y)
    out = x + drop_path(scale(post("LayerNorm_1", y)))
    return out, out


class ClassAttentionBlock(nn.Module):
  """CaiT's class-attention block (timm's ``LayerScaleBlockClassAttn``;
  :mod:`vit_jax.models.cait`): the class token (B, 1, D) attends to
  [class token, patches] (its query alone; the keys and values of both,
  through the block's first norm), then runs through the MLP; both
  branches scaled by LayerScale when ``config.layer_scale_init`` is set.
  Returns the new class token; the patches are read, not changed.
  ``config``: the blocks' record, used as timm's class-attention blocks
  use it: plain attention (no talking heads), no dropout or stochastic
  depth. Parameters as :class:`Encoder1DBlock`'s."""

  config: BlockConfig = BlockConfig()

  @nn.compact
  def __call__(self, cls, x):
    cfg = dataclasses.replace(self.config, talking_heads=False,
                              dropout_rate=0.0, attention_dropout_rate=0.0)
    norm = cfg.norm()
    scale = (
        lambda y: LayerScale(cfg.layer_scale_init, cfg.param_dtype)(y)
    ) if cfg.layer_scale_init is not None else (lambda y: y)
    u = norm(name="LayerNorm_0")(jnp.concatenate([cls, x], axis=1))
    cls = cls + scale(MultiHeadDotProductAttention(
        cfg, name="MultiHeadDotProductAttention_0")(u[:, :1], u))
    y = MlpBlock(cfg, name="MlpBlock_0")(norm(name="LayerNorm_1")(cls))
    return cls + scale(y)


class MAPHead(nn.Module):
  """Multihead attention pooling (big_vision's ``MAPHead``, timm's
  ``attn_pool``): a learned ``probe`` token attends to all tokens, then a
  residual MLP; returns the pooled (B, D) features. ``config``: its
  attention's and MLP's :class:`BlockConfig` (heads, MLP width,
  activation, epsilon; biases on, no extra norms). ``mask`` (B, N) bool:
  the tokens the probe may read (a NaFlex batch's padding is not)."""

  config: BlockConfig = BlockConfig()

  @nn.compact
  def __call__(self, x, mask=None):
    cfg = self.config
    n, _, d = x.shape
    probe = self.param("probe", nn.initializers.xavier_uniform(), (1, 1, d),
                       cfg.param_dtype)
    probe = jnp.broadcast_to(probe.astype(cfg.dtype), (n, 1, d))
    x = MultiHeadDotProductAttention(cfg)(probe, x, mask=mask)
    y = LayerNorm(epsilon=cfg.layer_norm_eps, dtype=cfg.dtype,
                  param_dtype=cfg.param_dtype)(x)
    x = x + MlpBlock(cfg)(y)
    return x[:, 0]


# --------------------------------------------------------------------------- #
# Position embedding and the encoder.
# --------------------------------------------------------------------------- #


class AddPositionEmbs(nn.Module):
  """Adds a learned 1-D position embedding (one row per token it is given:
  the patch tokens, plus the prefix tokens unless ``no_embed_class``).

  With ``dynamic=True`` (a model's ``dynamic_img_size``) the parameter keeps
  the shape it was made for (``base_grid``, else the square its patch rows
  form, else at ``init`` the input's grid) and its patch rows are resampled
  to the input's ``grid`` inside the forward pass whenever the two differ,
  exactly as timm's ``dynamic_img_size`` does (``resample_abs_pos_embed``:
  antialiased bicubic, half-pixel centres; prefix rows kept). The per-axis
  interpolation matrices are numpy constants built at trace time
  (:mod:`vit_jax.models.interpolate`), applied as two small matmuls, so gradients
  flow to the stored embedding; under ``jax.jit`` each new input shape
  traces and compiles once.
  """

  grid: Tuple[int, int]
  num_prefix_tokens: int
  param_dtype: Dtype = jnp.float32
  dynamic: bool = False
  base_grid: Optional[Tuple[int, int]] = None

  @nn.compact
  def __call__(self, x):
    if not self.dynamic:
      shape = (1, x.shape[1], x.shape[2])
      if self.has_variable("params", "pos_embedding"):
        have = self.get_variable("params", "pos_embedding").shape
        if tuple(have) != shape:
          _raise_posemb_mismatch(have, shape, self.grid,
                                 self.num_prefix_tokens)
      pe = self.param("pos_embedding", nn.initializers.normal(stddev=0.02),
                      shape, self.param_dtype)
      return x + pe.astype(x.dtype)

    prefix, d = self.num_prefix_tokens, x.shape[2]
    if self.has_variable("params", "pos_embedding"):
      shape = tuple(self.get_variable("params", "pos_embedding").shape)
      base = self.base_grid or _square_grid(shape[1] - prefix, prefix)
      if shape != (1, prefix + base[0] * base[1], d):
        raise ValueError(
            f"The position embedding has shape {shape}, but the model's "
            f"image_size gives a {base[0]}x{base[1]} patch grid: expected "
            f"(1, {prefix + base[0] * base[1]}, {d}) ({prefix} prefix "
            f"row(s)). Set image_size to the resolution the weights were "
            f"made for.")
    else:
      base = tuple(self.base_grid or self.grid)
      shape = (1, prefix + base[0] * base[1], d)
    pe = self.param("pos_embedding", nn.initializers.normal(stddev=0.02),
                    shape, self.param_dtype)
    if tuple(base) != tuple(self.grid):
      pe = resample_grid(pe, base, self.grid, prefix)
    return x + pe.astype(x.dtype)


def resample_grid(pe, old_grid, new_grid, num_prefix_tokens: int):
  """(1, prefix + gh*gw, D) -> (1, prefix + nh*nw, D) in JAX: timm's
  ``resample_abs_pos_embed`` (antialiased bicubic, float32) as two matmuls
  with constant matrices; the prefix rows are kept."""
  (gh, gw), (nh, nw) = old_grid, new_grid
  dtype = pe.dtype
  pe = pe.astype(jnp.float32)
  head, grid = pe[:, :num_prefix_tokens], pe[:, num_prefix_tokens:]
  grid = grid.reshape(gh, gw, -1)
  hi = lax.Precision.HIGHEST  # an exact resample on every backend
  mh = jnp.asarray(interpolate.aa_bicubic_matrix(gh, nh), jnp.float32)
  mw = jnp.asarray(interpolate.aa_bicubic_matrix(gw, nw), jnp.float32)
  grid = jnp.einsum("Hh,hwd->Hwd", mh, grid, precision=hi)
  grid = jnp.einsum("Ww,hwd->hWd", mw, grid, precision=hi)
  out = jnp.concatenate([head, grid.reshape(1, nh * nw, -1)], axis=1)
  return out.astype(dtype)


def _square_grid(rows: int, prefix: int) -> Tuple[int, int]:
  side = math.isqrt(max(rows, 0))
  if side * side != rows:
    raise ValueError(
        f"The position embedding has {rows} patch rows (+ {prefix} prefix "
        f"token(s)), which are not a square grid: a dynamic_img_size model "
        f"needs to know the grid they were made for; set image_size=(height, "
        f"width) to the resolution of the weights.")
  return side, side


def _raise_posemb_mismatch(have, want, grid, prefix):
  rows = have[1] - prefix
  side = math.isqrt(max(rows, 0))
  had = (f"a {side}x{side} patch grid" if side * side == rows
         else f"{rows} patches")
  raise ValueError(
      f"Input resolution does not match the position embedding: it has "
      f"{have[1]} rows ({had} + {prefix} prefix token(s)), but the input gives "
      f"a {grid[0]}x{grid[1]} patch grid ({want[1]} rows needed). Resample the "
      f"embedding to the new resolution first, e.g. "
      f"vit_jax.convert.resize_posemb(variables, image_size) or "
      f"convert.from_torchvision(..., image_size=...), or build the model "
      f"with dynamic_img_size=True to run any resolution.")


class Encoder(nn.Module):
  """Position embedding + dropout + (pre-norm) + ``num_layers`` blocks +
  final norm (absent with ``final_norm=False``).

  ``dynamic_img_size`` / ``base_grid``: see :class:`AddPositionEmbs`.
  ``abs_pos_embed=False``: no learned position embedding (DINOv3, whose
  positions are rotary only). ``rope``: the rotary embedding of the patch
  tokens (:mod:`vit_jax.models.rope`), built once per forward pass for the
  input's grid and shared by the blocks ('mixed': one table per block from
  the learned frequencies ``rope_freqs`` (2, depth, heads, head_dim / 2),
  a parameter of the encoder as timm's ``rope.freqs``).
  ``no_embed_registers``: the
  position embedding covers the class token but not the registers, which
  are inserted after it is added (transformers' Dinov2WithRegisters).
  ``naflex`` (a resize kind of :mod:`vit_jax.models.naflex`): the learned
  position embedding is a ``naflex_grid`` grid (``posembed_input/
  pos_grid``) resized to each image's patch grid, added to the patch
  tokens only (timm's NaFlexEmbeds); a NaFlex batch's ``valid`` mask keeps
  its padding out of every attention. ``window_size`` /
  ``global_attn_indexes`` (with the block record's ``rel_pos``): SAM's
  windowed blocks and relative positions (:mod:`vit_jax.models.sam`).
  ``class_attn_layers``: CaiT's class token kept apart from the blocks
  (which see the patches only) and updated by that many class-attention
  blocks after them (:class:`ClassAttentionBlock`, ``classblock_{i}``),
  then put before the patches for the final norm. ``drop_path_schedule``:
  the blocks' stochastic-depth rates grow linearly from 0 to
  ``drop_path_rate`` (``'linear'``) or are all that rate (``'constant'``:
  CaiT's; :mod:`vit_jax.models.cait`).
  """

  block: BlockConfig
  num_layers: int
  drop_path_rate: float = 0.0
  scan_layers: bool = False
  remat_policy: Optional[str] = None
  no_embed_class: bool = False
  pre_norm: bool = False
  final_norm: bool = True
  dynamic_img_size: bool = False
  base_grid: Optional[Tuple[int, int]] = None
  # The newer families' options (see VisionTransformer).
  abs_pos_embed: bool = True
  no_embed_registers: int = 0  # the last prefix tokens without a position
  rope_temperature: Optional[float] = None
  rope_grid_offset: float = 0.0
  rope_grid_indexing: str = "ij"
  rope_ref_grid: Optional[Tuple[int, int]] = None
  rope_augment: Optional[Tuple[Tuple[str, Optional[float]], ...]] = None
  naflex: Optional[str] = None
  naflex_square: bool = False
  naflex_align_corners: bool = False
  naflex_grid: Tuple[int, int] = (16, 16)
  naflex_factorized: bool = False
  window_size: int = 0  # SAM: windowed attention but in the global blocks
  global_attn_indexes: Tuple[int, ...] = ()
  class_attn_layers: int = 0  # CaiT: the class token's blocks, after these
  drop_path_schedule: str = "linear"

  def _rope_tables(self, grid, num_prefix: int, hidden: int, train: bool):
    """(sin, cos) for every block; 'mixed': each block's own, stacked
    (depth, T, heads, head_dim), from the learned ``rope_freqs``."""
    if self.block.rope is None:
      return None
    augment = dict(self.rope_augment or ())
    use_aug = train and any(v is not None for v in augment.values())
    if self.block.rope == "mixed":  # RoPE-Mixed: learned, per block
      heads = self.block.num_heads
      freqs = self.param(
          "rope_freqs", rope_lib.mixed_init(self.rope_temperature),
          (2, self.num_layers, heads, hidden // heads // 2),
          self.block.param_dtype)
      coords = rope_lib.positions(
          grid, num_prefix_tokens=num_prefix,
          indexing=self.rope_grid_indexing,
          augment=augment if use_aug else None,
          key=self.make_rng("dropout") if use_aug else None)
      return rope_lib.mixed_sincos(coords, freqs)
    sin, cos = rope_lib.sincos(
        self.block.rope, grid, hidden // self.block.num_heads,
        num_prefix_tokens=num_prefix, temperature=self.rope_temperature,
        offset=self.rope_grid_offset, indexing=self.rope_grid_indexing,
        ref_grid=self.rope_ref_grid, augment=augment if use_aug else None,
        key=self.make_rng("dropout") if use_aug else None)
    return jnp.asarray(sin), jnp.asarray(cos)

  def _rel_pos(self, grid, num_tokens: int, train: bool):
    """(the shared relative position bias or None, the blocks' grids or
    None) of ``block.rel_pos_bias`` (:mod:`vit_jax.models.relpos`)."""
    if self.block.rel_pos_bias is None:
      return None, None
    grids = relpos.Grids(tuple(grid), self.base_grid, self.dynamic_img_size)
    if self.block.rel_pos_bias != "shared":
      return None, grids
    return relpos.bias_module(self.block, not train)(grids, num_tokens), None

  def _class_attention(self, cls, x):
    """CaiT: the class token through the class-attention blocks, then
    before the patch tokens x (B, N, D) -> (B, 1 + N, D)."""
    block_cls = ClassAttentionBlock
    if self.remat_policy not in (None, "none"):
      block_cls = nn.remat(block_cls,
                           policy=_remat_policy(self.remat_policy))
    cls = cls.astype(x.dtype)
    for i in range(self.class_attn_layers):
      cls = block_cls(self.block, name=f"classblock_{i}")(cls, x)
    return jnp.concatenate([cls.astype(x.dtype), x], axis=1)

  @nn.compact
  def __call__(self, x, *, prefix=None, grid: Optional[Tuple[int, int]],
               train: bool, take: Optional[Sequence[int]] = None,
               norm_taken: bool = False, coord=None, valid=None):
    """``x``: patch tokens (B, N, D); ``prefix``: class / register tokens
    (B, P, D) or None; ``grid``: the images' patch grid, or with a NaFlex
    batch None and each patch's ``coord`` (B, N, 2) and ``valid`` (B, N).
    Returns (encoded tokens, block outputs): every block's output, or those
    of the blocks ``take`` lists (0-based, in that order), passed through
    the final norm with ``norm_taken``."""
    cls_apart = None
    if self.class_attn_layers:  # CaiT: the class token joins after the blocks
      cls_apart, prefix = prefix, None
    num_prefix = 0 if prefix is None else prefix.shape[1]
    # The prefix tokens that get a position row: all, none
    # (no_embed_class), or all but the registers (no_embed_registers).
    covered = 0 if self.no_embed_class else num_prefix - self.no_embed_registers
    mask = None
    if self.naflex is not None:  # patches only; prefix tokens get none
      covered = 0
      naflex_pos = naflex.NaFlexPositionEmbs(
          tuple(self.naflex_grid), self.naflex, self.naflex_square,
          self.naflex_align_corners, self.block.param_dtype,
          factorized=self.naflex_factorized, name="posembed_input")
      pos = lambda y: naflex_pos(y, grid=grid, coord=coord, valid=valid)  # noqa: E731
      if valid is not None:
        mask = naflex.key_mask(valid, num_prefix)
    elif self.abs_pos_embed:
      pos = AddPositionEmbs(grid, covered, self.block.param_dtype,
                            dynamic=self.dynamic_img_size,
                            base_grid=self.base_grid, name="posembed_input")
    else:
      pos = lambda y: y  # noqa: E731
    if prefix is None:
      x = pos(x)
    elif covered == 0:  # DeiT-III, DINOv2-reg: prefix tokens get none
      x = jnp.concatenate([prefix.astype(x.dtype), pos(x)], axis=1)
    elif covered == num_prefix:
      x = pos(jnp.concatenate([prefix.astype(x.dtype), x], axis=1))
    else:  # [covered prefix, patches] + pos, then the rest after them
      x = pos(jnp.concatenate([prefix[:, :covered].astype(x.dtype), x],
                              axis=1))
      x = jnp.concatenate([x[:, :covered], prefix[:, covered:].astype(x.dtype),
                           x[:, covered:]], axis=1)
    x = nn.Dropout(self.block.dropout_rate)(x, deterministic=not train)
    norm = self.block.norm()
    if self.pre_norm:  # CLIP's ln_pre
      x = norm(name="pre_norm")(x)
    rope = self._rope_tables(grid, num_prefix, x.shape[-1], train)
    rel_pos, grids = self._rel_pos(grid, x.shape[1], train)

    block_cls = Encoder1DBlock
    if self.remat_policy not in (None, "none"):
      block_cls = nn.remat(block_cls, policy=_remat_policy(self.remat_policy),
                           prevent_cse=not self.scan_layers)
    if self.drop_path_schedule == "constant":  # CaiT's: every block at it
      rates = np.full(self.num_layers, self.drop_path_rate)
    else:  # grows linearly from 0 (first block) to the rate
      rates = np.linspace(0.0, self.drop_path_rate, self.num_layers)
    kwargs = dict(config=self.block, use_drop_path=self.drop_path_rate > 0.0,
                  deterministic=not train)
    if grids is not None:
      kwargs["grids"] = grids

    if self.scan_layers:
      args = (jnp.asarray(rates, jnp.float32),)
      in_axes = (0,)
      # The same for every layer: rope (but 'mixed''s, one per layer),
      # mask, the shared position bias (up to the last one given);
      # differential attention's lambda_init is each block's own.
      diff = self.block.diff_attn is not None
      shared = (rope, mask, rel_pos)
      if not diff:
        shared = shared[:max((i + 1 for i, a in enumerate(shared)
                              if a is not None), default=0)]
      args += shared
      in_axes += tuple(
          0 if j == 0 and self.block.rope == "mixed" and rope is not None
          else nn.broadcast for j in range(len(shared)))
      if diff:
        args += (jnp.asarray(diffattn.lambda_init(
            np.arange(self.num_layers)), jnp.float32),)
        in_axes += (0,)
      scanned = nn.scan(
          block_cls,
          variable_axes={"params": 0, "intermediates": 0},
          split_rngs={"params": True, "dropout": True},
          in_axes=in_axes if len(in_axes) > 1 else 0,
          length=self.num_layers)
      x, outs = scanned(name="encoderblock", **kwargs)(x, *args)
      block_outputs = [outs[i] for i in range(self.num_layers)]
    else:
      block_outputs = []
      spatial = None
      if sam_lib.uses_grid(self.window_size, self.block.rel_pos):
        spatial = sam_lib.block_spatial(
            self.num_layers, grid, self.base_grid, self.window_size,
            self.global_attn_indexes, self.block.rel_pos)
      for i in range(self.num_layers):
        block = block_cls(name=f"encoderblock_{i}", **kwargs, **(
            {} if spatial is None else {"spatial": spatial[i]}))
        rope_i = rope
        if self.block.rope == "mixed":  # this block's own tables
          rope_i = (rope[0][i], rope[1][i])
        if self.block.diff_attn is not None:
          x, _ = block(x, float(rates[i]), rope_i, mask, rel_pos,
                       float(diffattn.lambda_init(i)))
        elif rel_pos is not None:
          x, _ = block(x, float(rates[i]), rope_i, mask, rel_pos)
        elif mask is None:
          x, _ = block(x, float(rates[i]), rope_i)
        else:
          x, _ = block(x, float(rates[i]), rope_i, mask)
        block_outputs.append(x)
    if cls_apart is not None:
      x = self._class_attention(cls_apart, x)
    if take is not None:
      block_outputs = [block_outputs[i] for i in take]
    if not self.final_norm:
      return x, block_outputs
    final = norm(name="encoder_norm")  # one module: the same parameters
    if norm_taken:
      block_outputs = [final(y) for y in block_outputs]
    return final(x), block_outputs


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
