"""Differential attention (Ye et al. 2024, "Differential Transformer"), as
timm's ``DiffAttention`` (``vision_transformer.py``'s ``attn_layer='diff'``)
and ``DiffParallelScalingBlock`` compute it.

Each head's queries and keys are two half-width heads (the first and the
second half of the head's channels, as timm's ``reshape(B, N, 2 * H,
hd / 2)``); each pair gives a softmax attention map, and the head reads
its values (full width) through their difference::

    attn = softmax(q1 k1^T / sqrt(hd/2)) - lambda * softmax(q2 k2^T / sqrt(hd/2))
    out  = RMSNorm(attn @ v) * (1 - lambda_init)

``lambda = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2) +
lambda_init`` (the paper's, the model's ``diff_attn='qk'``: four learned
vectors of hd/2), or ``exp(lambda_a) - exp(lambda_b) + lambda_init``
(timm's ``dual_lambda``: two learned scalars, ``diff_attn='dual'``), in
float32; ``lambda_init = 0.8 - 0.6 * exp(-0.3 * depth)`` for the block
at ``depth`` (0-based), a constant of the architecture. The RMSNorm over
each head's output (``sub_norm``, epsilon 1e-5 whatever the model's
norms, a scale only) is timm's. The q/k norms (``qk_norm``) run over the
half-width heads, as timm's; the projections are the classic ones (our
``query`` / ``key`` kernels (D, H, hd) hold both halves of a head).

Parameters (only when on), in each block's attention:
``MultiHeadDotProductAttention_0/{lambda_q1, lambda_k1, lambda_q2,
lambda_k2}`` (hd/2,) or ``{lambda_a, lambda_b}`` (), and ``sub_norm/scale``
(hd,).

The two maps are materialised (timm's non-fused path; its fused path
computes the same function): the attention runs as XLA ops, and
``attention_impl='cudnn'`` is refused when requested (:func:`check`).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Dtype = Any

# How lambda is parametrised: the paper's q/k vectors, timm's two scalars.
KINDS = ("qk", "dual")
# timm's sub_norm: RmsNorm(2 * head_dim, eps=1e-5) whatever the model's norm.
SUB_NORM_EPS = 1e-5


def lambda_init(depth) -> Any:
  """timm's ``0.8 - 0.6 * exp(-0.3 * depth)`` of the block at ``depth``
  (0-based; numpy for an int or an array of them)."""
  return 0.8 - 0.6 * np.exp(-0.3 * np.asarray(depth, np.float64))


def lambdas(module: nn.Module, kind: str, half: int, param_dtype,
            init) -> jax.Array:
  """The block's lambda (a float32 scalar) from ``module``'s parameters
  (made here): ``kind`` 'qk' (``lambda_q1`` ... ``lambda_k2`` of ``half``
  values, N(0, 0.1) as timm's) or 'dual' (``lambda_a``, ``lambda_b``,
  zeros); ``init`` the block's lambda_init (a float, or a traced scalar
  under ``nn.scan``)."""
  if kind == "dual":
    a, b = (module.param(n, nn.initializers.zeros, (), param_dtype)
            for n in ("lambda_a", "lambda_b"))
    first = jnp.exp(a.astype(jnp.float32))
    second = jnp.exp(b.astype(jnp.float32))
  else:
    q1, k1, q2, k2 = (
        module.param(n, nn.initializers.normal(stddev=0.1), (half,),
                     param_dtype).astype(jnp.float32)
        for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"))
    first = jnp.exp(jnp.sum(q1 * k1))
    second = jnp.exp(jnp.sum(q2 * k2))
  return first - second + jnp.asarray(init, jnp.float32)


def halves(x):
  """(B, N, H, hd) -> (B, N, 2H, hd/2): each head's two half-width heads,
  in timm's order (head i's are 2i and 2i + 1)."""
  b, n, h, hd = x.shape
  return x.reshape(b, n, 2 * h, hd // 2)


def weights(q, k, lam, bias=None):
  """Half-width queries (B, N, 2H, hd/2) and keys (B, S, 2H, hd/2) -> the
  differential attention map (B, H, N, S), float32: the softmax of each
  half's scaled logits (plus ``bias``: broadcastable to (B, 1, N, S)),
  the second's scaled by ``lam`` subtracted from the first's."""
  scale = 1.0 / math.sqrt(q.shape[-1])
  logits = jnp.einsum("bnhd,bshd->bhns", q, k,
                      preferred_element_type=jnp.float32) * scale
  if bias is not None:
    logits = logits + bias
  p = jax.nn.softmax(logits, axis=-1)
  b, h2, n, s = p.shape
  p = p.reshape(b, h2 // 2, 2, n, s)
  return p[:, :, 0] - lam * p[:, :, 1]


def check(model) -> None:
  """Raises for a ``diff_attn`` out of range, or combined with what it
  cannot be (``model``: a VisionTransformer)."""
  if model.diff_attn is None:
    return
  if model.diff_attn not in KINDS:
    raise ValueError(
        f"diff_attn={model.diff_attn!r}: expected None, 'qk' (lambda from "
        f"learned q/k vectors: the paper's, timm's default) or 'dual' (two "
        f"learned scalars: timm's dual_lambda)")
  if (model.hidden_size // model.num_heads) % 2:
    raise ValueError(
        f"diff_attn: each head's queries and keys are two half-width heads; "
        f"the head width {model.hidden_size // model.num_heads} is odd")
  clash = [k for k, on in (
      ("attention_impl='cudnn' (its fused kernel gives one map per head; "
       "None, 'xla' or 'matmul' run XLA ops)", model.attention_impl == "cudnn"),
      ("rope", model.rope is not None),
      ("rel_pos_bias", model.rel_pos_bias is not None),
      ("rel_pos (SAM)", model.rel_pos),
      ("window_size (SAM)", bool(model.window_size)),
      ("talking_heads", model.talking_heads),
      ("class_attn_layers", bool(model.class_attn_layers)),
  ) if on]
  if clash:
    raise ValueError(f"diff_attn (differential attention) cannot be "
                     f"combined with {', '.join(clash)}")
