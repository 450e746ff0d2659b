"""CaiT (Touvron et al. 2021, "Going deeper with Image Transformers"), as
timm's ``Cait`` computes it: the pieces the classic ViT lacks.

* **Talking-heads attention** (``talking_heads``; Shazeer et al. 2020) in
  the blocks: the attention logits of every query and key are mixed
  across the heads by a learned (heads, heads) linear map with a bias
  before the softmax (``proj_l``), and the probabilities by another after
  it (``proj_w``); q / k / v and the output projection are the usual
  ones (timm's fused ``qkv``, split into ours as for the other families).
* **Class attention** (``class_attn_layers``): the class token stays out
  of the blocks, which see the patch tokens only (the position embedding
  covers the patches: ``no_embed_class``). After them,
  ``class_attn_layers`` class-attention blocks (timm's
  ``LayerScaleBlockClassAttn``; 2 in every CaiT) update the class token
  alone: its query attends to [class token, patches] (the keys and values
  of both; plain attention), then an MLP, both branches with LayerScale;
  the patch tokens pass unchanged. The final norm then runs over [class
  token, patches] and the head reads the class token (or the mean of the
  patches). The class-attention blocks have the blocks' MLP width (timm's
  ``mlp_ratio_token_only``, 4 as its ``mlp_ratio`` in every CaiT), and
  neither dropout nor stochastic depth (timm gives them none).
* **Stochastic depth at one rate** (``drop_path_schedule='constant'``):
  every block drops its branches at ``drop_path_rate``, as timm's CaiT
  (the default ``'linear'`` grows from 0 at the first block).

Parameters (only when on): ``MultiHeadDotProductAttention_0/proj_l`` and
``proj_w`` (kernel (H, H), bias (H,)) in every block;
``Transformer/classblock_{i}/{LayerNorm_0, MultiHeadDotProductAttention_0/
{query,key,value,out}, LayerScale_0, LayerNorm_1, MlpBlock_0/{Dense_0,
Dense_1}, LayerScale_1}`` after them.

The mixing needs the logits and the probabilities of every head: the
talking-heads attention runs as XLA ops with both materialised (timm's
only path); cuDNN's fused kernel is refused when requested (:func:`check`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Dtype = Any

# How the stochastic-depth rate is spread over the blocks.
DROP_PATH_SCHEDULES = ("linear", "constant")


class HeadMix(nn.Module):
  """A torch ``Linear(heads, heads)`` across the heads of attention maps
  (B, H, N, M): timm's ``proj(attn.permute(0, 2, 3, 1)).permute(0, 3, 1,
  2)``. Parameters ``kernel`` (H, H) (linen's (in, out)) and ``bias``
  (H,)."""

  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    h = x.shape[1]
    kernel = self.param("kernel", nn.initializers.xavier_uniform(), (h, h),
                        self.param_dtype)
    bias = self.param("bias", nn.initializers.zeros, (h,), self.param_dtype)
    y = jnp.einsum("bhnm,hg->bgnm", x, kernel.astype(x.dtype))
    return y + bias.astype(x.dtype)[:, None, None]


def talking_heads_weights(q, k, scale: float, proj_l: HeadMix,
                          proj_w: HeadMix):
  """Queries (B, N, H, hd) and keys (B, M, H, hd) -> the talking-heads
  attention probabilities (B, H, N, M), float32: the scaled logits mixed
  across heads by ``proj_l``, the softmax over the keys, then mixed by
  ``proj_w`` (so a head's row need not sum to 1, as timm's)."""
  logits = jnp.einsum("bnhd,bmhd->bhnm", q, k,
                      preferred_element_type=jnp.float32) * scale
  return proj_w(jax.nn.softmax(proj_l(logits), axis=-1))


def check(model) -> None:
  """Raises for CaiT options that are out of range or that other options
  cannot be combined with (``model``: a VisionTransformer)."""
  if model.drop_path_schedule not in DROP_PATH_SCHEDULES:
    raise ValueError(f"drop_path_schedule={model.drop_path_schedule!r}: "
                     f"expected one of {DROP_PATH_SCHEDULES}")
  if model.class_attn_layers < 0:
    raise ValueError(f"class_attn_layers={model.class_attn_layers}: "
                     f"expected 0 (none) or the number of class-attention "
                     f"blocks")
  if model.talking_heads:
    clash = [k for k, on in (
        ("attention_impl='cudnn' (its fused kernel has no head mixing; "
         "None, 'xla' or 'matmul' run XLA ops)",
         model.attention_impl == "cudnn"),
        ("rel_pos_bias", model.rel_pos_bias is not None),
        ("rel_pos (SAM)", model.rel_pos),
        ("naflex (its padding masks)", model.naflex is not None),
    ) if on]
    if clash:
      raise ValueError(f"talking_heads (CaiT's logits mixed across heads) "
                       f"cannot be combined with {', '.join(clash)}")
  if not model.class_attn_layers:
    return
  clash = [k for k, on in (
      ("registers", model.num_registers),
      ("a distillation token", model.distilled),
      ("rel_pos_bias", model.rel_pos_bias is not None),
      ("rope", model.rope is not None),
      ("naflex", model.naflex is not None),
  ) if on]
  if clash:
    raise ValueError(f"class_attn_layers (CaiT's class token apart from the "
                     f"blocks) cannot be combined with {', '.join(clash)}")
  if not model.has_class_token or not model.no_embed_class:
    raise ValueError(
        "class_attn_layers: the class token joins the patch tokens after "
        "the blocks, so it needs a class token (class_token, or "
        "classifier='token') and a position embedding of the patches only "
        "(no_embed_class=True), as timm's Cait")
