"""Segment Anything's image encoder (Kirillov et al. 2023; the ViTDet
backbone of Li et al. 2022), as timm's ``VisionTransformerSAM`` computes
it: the pieces the classic ViT lacks.

* **Windowed attention** (``window_size``): every block but those of
  ``global_attn_indexes`` attends within non-overlapping square windows of
  ``window_size`` patches. The patch grid is zero-padded at the bottom and
  right to a multiple of the window (after the block's first norm, so the
  padding tokens enter the attention as zeros, keys and values included,
  exactly as timm's ``window_partition``), cut into windows, and put back
  without the padding.
* **Decomposed relative positions** (``rel_pos``; MViTv2's): each
  attention adds to its logits ``q . R_h[qy - ky] + q . R_w[qx - kx]``
  (the unscaled query), from two learned tables ``rel_pos_h`` /
  ``rel_pos_w`` of ``2 * S - 1`` rows of the head width, where ``S`` is
  the window (windowed blocks) or the patch grid the model was built for
  (global blocks). Tables of another length are resized to the attended
  grid linearly (``F.interpolate(mode='linear')``), as timm's
  ``get_rel_pos``.
* **The neck** (``neck_chans``): the encoder's tokens as an (h, w, D) map
  through a 1x1 conv, a LayerNorm over channels, a 3x3 conv (padding 1),
  another LayerNorm (both convs without bias; epsilon 1e-6, timm's
  ``LayerNorm2d``). ``forward_features`` returns the map, NHWC
  (timm's is NCHW); the head pools it by its mean.

Parameters (only when on): ``MultiHeadDotProductAttention_0/rel_pos_h``,
``rel_pos_w`` in each block; ``neck/{Conv_0, LayerNorm_0, Conv_1,
LayerNorm_1}`` at the top. The position embedding is the usual
``posembed_input/pos_embedding`` (1, h*w, D) over the patches only (no
class token), timm's (1, h, w, D) grid in row-major order.

The rel-pos bias is (B, heads, N, N) and takes gradients (into the
tables and the queries): the attention runs as XLA ops with the
probabilities materialised (timm's non-fused path); the hand-written
``'matmul'`` kernel (whose key bias takes no gradient) and cuDNN's fused
kernel are not used for it (see :func:`attention_impl`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Tuple

import flax.linen as nn
import jax.numpy as jnp
from jax import lax
import numpy as np

from vit_jax.models import interpolate, kernels

Dtype = Any

# timm's LayerNorm2d (the neck's norms).
NECK_EPS = 1e-6


class Spatial(NamedTuple):
  """How one block attends over the patch grid (static, hashable).

  ``grid``: the tokens' (h, w) patch grid; ``window``: the window side (0:
  global attention); ``table``: the (h, w) grid that sizes the block's
  rel-pos tables when they are made (the window, or the grid the model is
  built for), None without relative positions."""

  grid: Tuple[int, int]
  window: int
  table: Optional[Tuple[int, int]]


def uses_grid(window_size: int, rel_pos: bool) -> bool:
  """Whether the blocks attend over the patch grid (SAM / ViTDet)."""
  return bool(window_size) or bool(rel_pos)


def block_spatial(num_layers: int, grid: Tuple[int, int],
                  base_grid: Optional[Tuple[int, int]], window_size: int,
                  global_attn_indexes: Sequence[int],
                  rel_pos: bool) -> Tuple[Spatial, ...]:
  """Every block's :class:`Spatial`: windowed (``window_size`` > 0) except
  the ``global_attn_indexes`` (indexes past the last block are ignored,
  as timm does); tables of the window, or of ``base_grid`` (the grid the
  model is built for; else the input's) for global blocks."""
  grid = (int(grid[0]), int(grid[1]))
  base = tuple(base_grid) if base_grid is not None else grid
  globals_ = {int(i) for i in global_attn_indexes}
  out = []
  for i in range(num_layers):
    window = 0 if (not window_size or i in globals_) else int(window_size)
    table = None
    if rel_pos:
      table = (window, window) if window else (int(base[0]), int(base[1]))
    out.append(Spatial(grid, window, table))
  return tuple(out)


def window_partition(x, grid: Tuple[int, int], window: int):
  """Tokens (B, h*w, D) of ``grid`` -> windows (B * nh * nw, window**2,
  D), the grid zero-padded at the bottom / right to multiples of the
  window first (timm's ``window_partition``); windows in row-major order
  of the padded grid."""
  b, _, d = x.shape
  h, w = grid
  ph, pw = -h % window, -w % window
  x = x.reshape(b, h, w, d)
  if ph or pw:
    x = jnp.pad(x, ((0, 0), (0, ph), (0, pw), (0, 0)))
  nh, nw = (h + ph) // window, (w + pw) // window
  x = x.reshape(b, nh, window, nw, window, d).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b * nh * nw, window * window, d)


def window_unpartition(windows, grid: Tuple[int, int], window: int):
  """Inverse of :func:`window_partition`: (B * nh * nw, window**2, D) ->
  (B, h*w, D), the padding dropped."""
  h, w = grid
  nh, nw = -(-h // window), -(-w // window)
  d = windows.shape[-1]
  b = windows.shape[0] // (nh * nw)
  x = windows.reshape(b, nh, nw, window, window, d).transpose(0, 1, 3, 2, 4, 5)
  x = x.reshape(b, nh * window, nw * window, d)[:, :h, :w]
  return x.reshape(b, h * w, d)


def attend(attention: nn.Module, x, spatial: Spatial, rel_pos: bool):
  """``attention`` (a :class:`~vit_jax.models.layers.
  MultiHeadDotProductAttention`) over tokens (B, h*w, D) as the block's
  ``spatial`` says: within windows, or over the whole grid; with the
  decomposed rel-pos bias when ``rel_pos``."""
  if spatial.window:
    win = (spatial.window, spatial.window)
    y = attention(window_partition(x, spatial.grid, spatial.window),
                  decomposed=(win, spatial.table) if rel_pos else None)
    return window_unpartition(y, spatial.grid, spatial.window)
  return attention(x, decomposed=(spatial.grid, spatial.table) if rel_pos
                   else None)


def rel_pos_tables(module: nn.Module, table: Tuple[int, int], head_dim: int,
                   param_dtype: Dtype):
  """``module``'s parameters ``rel_pos_h`` (2*th - 1, hd) and ``rel_pos_w``
  (2*tw - 1, hd), zeros at first (timm's); loaded tables keep their own
  length (resized in the forward pass where it is not the grid's)."""
  out = []
  for name, side in (("rel_pos_h", table[0]), ("rel_pos_w", table[1])):
    shape = (2 * int(side) - 1, head_dim)
    if module.has_variable("params", name):
      shape = tuple(module.get_variable("params", name).shape)
    out.append(module.param(name, nn.initializers.zeros, shape, param_dtype))
  return out


def relative_table(table, size: int):
  """timm's ``get_rel_pos(size, size, table)``: ``table`` (L, hd) resized
  to ``2 * size - 1`` rows (linear, align_corners=False, float32) where
  its length differs, then gathered to (size, size, hd) with entry
  [i, j] = row ``i - j + size - 1``."""
  rows = 2 * size - 1
  t = table
  if t.shape[0] != rows:
    mat = jnp.asarray(interpolate.bilinear_matrix(int(t.shape[0]), rows,
                                                  False), jnp.float32)
    t = jnp.einsum("rl,ld->rd", mat, t.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST).astype(table.dtype)
  idx = np.arange(size)[:, None] - np.arange(size)[None, :] + size - 1
  return t[idx]


def _bias_parts(q, rel_h, rel_w, grid: Tuple[int, int]):
  """The two terms of the decomposed bias: float32 (B, H, N, h) and (B, H,
  N, w), ``q . Rh[qy, ky]`` and ``q . Rw[qx, kx]``."""
  b, n, heads, hd = q.shape
  h, w = grid
  rh = relative_table(rel_h, h)  # (h, h, hd)
  rw = relative_table(rel_w, w)  # (w, w, hd)
  r_q = q.reshape(b, h, w, heads, hd)
  f32 = jnp.float32
  bias_h = jnp.einsum("byxnc,ykc->bnyxk", r_q, rh.astype(q.dtype),
                      preferred_element_type=f32)
  bias_w = jnp.einsum("byxnc,xkc->bnyxk", r_q, rw.astype(q.dtype),
                      preferred_element_type=f32)
  return bias_h.reshape(b, heads, n, h), bias_w.reshape(b, heads, n, w)


def _bias(bias_h, bias_w):
  """(B, H, Q, h) and (B, H, Q, w) -> the (B, H, Q, h*w) bias."""
  b, heads, rows, h = bias_h.shape
  w = bias_w.shape[-1]
  return (bias_h[..., :, None] + bias_w[..., None, :]).reshape(
      b, heads, rows, h * w)


def decomposed_bias(q, rel_h, rel_w, grid: Tuple[int, int]):
  """The decomposed relative-position logits bias (timm's
  ``get_decomposed_rel_pos_bias``): queries (B, N, H, hd) over ``grid``
  (N = h*w) -> float32 (B, H, N, N), ``bias[qy, qx, ky, kx] = q . Rh[qy,
  ky] + q . Rw[qx, kx]``."""
  return _bias(*_bias_parts(q, rel_h, rel_w, grid))


# A global block at SAM's 1024 px has 4096 tokens: its (B, H, N, N)
# float32 bias, logits and weights are 805 MB each for SAM-B (12 heads).
# Where the weights themselves are not needed (no dropout on them, none
# sown), the queries are taken QUERY_CHUNK rows at a time (each row's
# softmax is its own), so only (B, H, QUERY_CHUNK, N) blocks exist at once
# (under a gradient too: the loop keeps each chunk's own).
QUERY_CHUNK = 512


def query_chunks(n: int) -> int:
  """How many chunks of queries :func:`decomposed_attention` takes for
  ``n`` tokens (1: all at once)."""
  return n // QUERY_CHUNK if n > QUERY_CHUNK and n % QUERY_CHUNK == 0 else 1


def decomposed_attention(q, qh, k, v, rel_h, rel_w, grid: Tuple[int, int],
                         scale: float, dtype):
  """softmax(q k^T * scale + decomposed bias) v for head-major (B, H, N,
  hd) ``qh``, ``k``, ``v`` (``q``: the queries token-major, (B, N, H, hd),
  for the bias), without the (B, H,
  N, N) matrices: the queries in :func:`query_chunks` blocks, each
  block's bias made from the two small terms. The weights are cast to
  ``dtype`` before the product with ``v``, as the unchunked path does.
  Returns (B, H, N, hd)."""
  b, n, heads, hd = q.shape
  parts = _bias_parts(q, rel_h, rel_w, grid)
  chunks = query_chunks(n)

  def rows(block):
    qc, bias_h, bias_w = block
    weights = kernels.attention_weights(qc, k, scale, _bias(bias_h, bias_w))
    return jnp.einsum("bhqk,bhkd->bhqd", weights.astype(dtype), v)

  # (B, H, N, x) -> (chunks, B, H, N / chunks, x), and back.
  split = lambda t: jnp.moveaxis(  # noqa: E731
      t.reshape(b, heads, chunks, n // chunks, t.shape[-1]), 2, 0)
  out = lax.map(rows, (split(qh), *(split(t) for t in parts)))
  return jnp.moveaxis(out, 0, 2).reshape(b, heads, n, hd)


def attention_impl(chosen: str, requested: Optional[str]) -> str:
  """The attention computation for a logits bias that takes gradients:
  ``'weights'`` (XLA ops, the probabilities materialised). A requested
  ``'cudnn'`` is refused: its fused kernel is not given the bias."""
  if requested == "cudnn":
    raise ValueError(
        "attention_impl='cudnn': the decomposed relative positions (rel_pos, "
        "SAM) add a (batch, heads, N, N) bias to the attention logits, which "
        "cuDNN's fused attention is not given here; use attention_impl=None, "
        "'xla' or 'matmul' (all run XLA ops with the bias).")
  del chosen
  return "weights"


class Neck(nn.Module):
  """SAM's neck over the encoder's (B, h, w, D) map: 1x1 conv (no bias) ->
  LayerNorm -> 3x3 conv (padding 1, no bias) -> LayerNorm, to
  ``channels``; norms over channels with epsilon 1e-6 (timm's
  ``LayerNorm2d``). Parameters ``Conv_0``, ``LayerNorm_0``, ``Conv_1``,
  ``LayerNorm_1``."""

  channels: int
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    conv = lambda k, name: nn.Conv(  # noqa: E731
        self.channels, (k, k), padding=[((k - 1) // 2,) * 2] * 2,
        use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
        name=name)
    # Two-pass variance, as torch's layer_norm.
    norm = lambda name: nn.LayerNorm(  # noqa: E731
        NECK_EPS, dtype=self.dtype, param_dtype=self.param_dtype,
        use_fast_variance=False, name=name)
    x = norm("LayerNorm_0")(conv(1, "Conv_0")(x))
    return norm("LayerNorm_1")(conv(3, "Conv_1")(x))


def check(model) -> None:
  """Raises for options that SAM's windowed / relative-position attention
  cannot be combined with (``model``: a VisionTransformer)."""
  if model.window_size < 0:
    raise ValueError(f"window_size={model.window_size}: expected 0 (global "
                     f"attention) or a window side in patches")
  if model.neck_chans is not None and model.neck_chans <= 0:
    raise ValueError(f"neck_chans={model.neck_chans}: expected None (no "
                     f"neck) or the neck's channels")
  if model.neck_chans and model.classifier not in ("gap", "unpooled"):
    raise ValueError(f"neck_chans: the neck's map is pooled by its mean "
                     f"(classifier='gap') or returned ('unpooled'), not "
                     f"classifier={model.classifier!r}")
  if not (uses_grid(model.window_size, model.rel_pos) or model.neck_chans):
    return
  what = ("window_size / rel_pos / neck_chans (SAM's attention over the "
          "patch grid)")
  clash = [k for k, on in (
      ("prefix tokens (class token, registers, distillation token)",
       model.num_prefix_tokens > 0),
      ("naflex", model.naflex is not None),
      ("rope", model.rope is not None),
      ("rel_pos_bias (a bias for the whole grid's attention)",
       model.rel_pos_bias is not None),
      ("scan_layers (the blocks differ: windowed and global)",
       model.scan_layers and uses_grid(model.window_size, model.rel_pos)),
  ) if on]
  if clash:
    raise ValueError(f"{what} cannot be combined with {', '.join(clash)}")
