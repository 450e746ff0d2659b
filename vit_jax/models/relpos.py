"""Relative position biases added to the attention logits: BEiT's table
(timm's ``beit.py``; BEiT, BEiT v2, Data2Vec-Vision) and timm's
``vision_transformer_relpos.py`` family's table or MLP (``RelPosBias``,
``RelPosMlp``).

**The table** (``RelativePositionBias``): one learned bias per head for
every relative offset between two patches. For a patch grid of ``h x w``
it has ``(2h - 1)(2w - 1)`` rows of ``num_heads`` values, one per offset
(dy, dx), row ``(dy + h - 1) * (2w - 1) + (dx + w - 1)``; with a class
token three more follow for it: class -> patch, patch -> class and class
-> class (timm's ``gen_relative_position_index``; BEiT always has one,
timm's ``RelPosBias`` (Swin v1's table) only where the model has a class
token). The index into it depends only on the grid, so it is a numpy
constant built at trace time; the bias is a gather of the table.

**The MLP** (``RelativePositionMlp``, the model's ``rel_pos_mlp``; Swin
v2's continuous position bias, timm's ``RelPosMlp``): a two-layer MLP
(ReLU; 2 -> ``rel_pos_mlp_dim`` -> heads) maps each offset's log-spaced
coordinates to one bias per head, gathered by the same index. Two modes,
timm's: ``'cr'`` (every ``vit_relpos_*``): ``sign(d) * log(1 + |d|)`` of
the offsets in patches, the bias as the MLP gives it; ``'swin'`` (Swin
v2's): the offsets scaled to [-8, 8] by the grid, ``sign * log2(1 +
|.|) / 3``, no bias on the MLP's second layer, the bias ``16 *
sigmoid(.)``. Prefix tokens (the class token) get a zero bias. The
coordinates depend on the grid only, so any input grid gets its bias
(timm's ``set_input_size``); timm drops the MLP's hidden units at 0.125
in training, as here (the ``'dropout'`` rng).

Two places for either (the model's ``rel_pos_bias``):

* ``'block'``: one per block, in its attention (timm's
  ``use_rel_pos_bias``, every released BEiT and ``vit_relpos_*``):
  ``encoderblock_{i}/MultiHeadDotProductAttention_0/rel_pos_bias/...``;
* ``'shared'``: one for all blocks (timm's ``use_shared_rel_pos_bias``,
  BEiT's self-supervised checkpoints; ``shared_rel_pos``, the
  ``vit_srelpos_*``): ``Transformer/rel_pos_bias/...``.

Parameters: ``table`` (rows, heads), or the MLP's ``Dense_0`` (kernel (2,
hidden), bias) and ``Dense_1`` (kernel (hidden, heads), and a bias but in
``'swin'`` mode).

The table is laid out for one grid: the grid of ``image_size`` (else of the
input given to ``init``). timm resizes it when it builds the model for
another input size (``resize_rel_pos_bias_table``: the offsets placed on
a geometric progression, linearly interpolated to the new grid's offsets,
the class token's rows kept); :func:`resize_matrix` is that resize as a
constant matrix, which the weights layer applies to loaded tables
(``image_size=``) and a ``dynamic_img_size`` model applies in the forward
pass, so any grid runs with one set of variables (under ``jax.jit`` each
new input shape compiles once).

The bias needs the attention's logits: the model computes attention with
a bias through the paths that take one (:func:`attention_impl`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

KINDS = ("block", "shared")
# timm's RelPosMlp modes (its 'rw' mode is no longer in timm 1.0).
MLP_MODES = ("cr", "swin")
# The hidden units of timm's RelPosMlp dropped in training.
MLP_DROPOUT = 0.125
# The class token's rows: class -> patch, patch -> class, class -> class.
EXTRA_ROWS = 3
Grid = Tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Grids:
  """What a table needs to know of the input: its patch ``grid``; the
  grid the tables are laid out for (``base``; None: the input's at
  ``init``, else the square the table's rows give); whether a table is
  resized to another input grid in the forward pass (``dynamic``; else
  another grid is an error)."""

  grid: Grid
  base: Optional[Grid] = None
  dynamic: bool = False


def check(kind: str, mlp: Optional[str] = None) -> None:
  if kind not in KINDS:
    raise ValueError(
        f"rel_pos_bias={kind!r}: expected None, 'block' (a table or MLP "
        f"per block, timm's use_rel_pos_bias) or 'shared' (one for every "
        f"block, timm's use_shared_rel_pos_bias / shared_rel_pos)")
  if mlp is not None and mlp not in MLP_MODES:
    raise ValueError(
        f"rel_pos_mlp={mlp!r}: expected None (a table), 'cr' (timm's "
        f"vit_relpos_*: log coordinates) or 'swin' (Swin v2's: coordinates "
        f"scaled by the grid, 16 * sigmoid)")


def _extra(class_token: bool) -> int:
  return EXTRA_ROWS if class_token else 0


def table_rows(grid: Grid, class_token: bool = True) -> int:
  """Rows of the table of an ``h x w`` patch grid (with the class
  token's three, or without a class token)."""
  h, w = grid
  return (2 * h - 1) * (2 * w - 1) + _extra(class_token)


def grid_of_rows(rows: int, class_token: bool = True) -> Optional[Grid]:
  """The square grid whose table has ``rows`` rows (None if none has)."""
  extra = _extra(class_token)
  side = math.isqrt(max(rows - extra, 0))
  if side * side != rows - extra or side % 2 == 0:
    return None
  return (side + 1) // 2, (side + 1) // 2


@functools.lru_cache(maxsize=32)
def position_index(grid: Grid, class_token: bool = True) -> np.ndarray:
  """(T, T) int32 rows of the table for every (query, key) pair of
  [class token, patches in row-major order] (T = 1 + hw), or of the
  patches alone (T = hw): timm's ``gen_relative_position_index``."""
  h, w = grid
  ys, xs = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
  ys, xs = ys.reshape(-1), xs.reshape(-1)
  dy = ys[:, None] - ys[None, :] + h - 1
  dx = xs[:, None] - xs[None, :] + w - 1
  patches = (dy * (2 * w - 1) + dx).astype(np.int32)
  if not class_token:
    patches.setflags(write=False)
    return patches
  n = table_rows(grid)
  out = np.zeros((h * w + 1,) * 2, np.int32)
  out[1:, 1:] = patches
  out[0, :] = n - 3  # class -> patch
  out[:, 0] = n - 2  # patch -> class
  out[0, 0] = n - 1  # class -> class
  out.setflags(write=False)
  return out


def _progression(src: int, dst: int) -> np.ndarray:
  """timm's ``_calc``: the ``src`` offsets placed on a geometric
  progression that reaches the ``dst`` offsets' half width (float32, as
  timm's ``torch.tensor`` of them)."""
  left, right = 1.01, 1.5
  q = (left + right) / 2.0
  while right - left > 1e-6:
    q = (left + right) / 2.0
    gp = (1.0 - q ** (src // 2)) / (1.0 - q)
    if gp > dst // 2:
      right = q
    else:
      left = q
  dis, cur = [], 1.0
  for i in range(src // 2):
    dis.append(cur)
    cur += q ** (i + 1)
  return np.asarray([-d for d in reversed(dis)] + [0.0] + dis, np.float32)


def _linear_matrix(points: np.ndarray, x: np.ndarray) -> np.ndarray:
  """(len(x), len(points)) weights of timm's ``RegularGridInterpolator``
  along one axis (linear between the two neighbours, the end values
  beyond the ends), in float64 from the float32 positions."""
  p64, x64 = points.astype(np.float64), x.astype(np.float64)
  n = len(points)
  right = np.minimum(np.searchsorted(points, x, side="left"), n - 1)
  left = np.clip(right - 1, 0, n - 1)
  dl = np.maximum(x64 - p64[left], 0.0)
  dr = np.maximum(p64[right] - x64, 0.0)
  both = (dl == 0) & (dr == 0)
  dl[both] = dr[both] = 1.0
  out = np.zeros((len(x), n))
  rows = np.arange(len(x))
  np.add.at(out, (rows, left), dr / (dl + dr))
  np.add.at(out, (rows, right), dl / (dl + dr))
  return out


@functools.lru_cache(maxsize=32)
def resize_matrix(old: Grid, new: Grid, class_token: bool = True
                  ) -> np.ndarray:
  """(rows of ``new``, rows of ``old``) float64: timm's
  ``resize_rel_pos_bias_table`` (without scipy, its default) from the
  table of grid ``old`` to that of ``new`` as one linear map (the class
  token's rows, if any, kept); the identity for the same grid."""
  old, new = tuple(old), tuple(new)
  n_new, n_old = (table_rows(new, class_token),
                  table_rows(old, class_token))
  if old == new:
    return np.eye(n_old)
  src = (2 * old[0] - 1, 2 * old[1] - 1)
  dst = (2 * new[0] - 1, 2 * new[1] - 1)
  mats = []
  for s, d in zip(src, dst):
    t = d // 2.0
    target = np.arange(-t, t + 0.1, 1.0, dtype=np.float32)
    mats.append(_linear_matrix(_progression(s, d), target))
  extra = _extra(class_token)
  out = np.zeros((n_new, n_old))
  out[:n_new - extra, :n_old - extra] = np.kron(mats[0], mats[1])
  out[n_new - extra:, n_old - extra:] = np.eye(extra)
  out.setflags(write=False)
  return out


def resize_table(table, new: Grid, old: Optional[Grid] = None,
                 class_token: bool = True) -> np.ndarray:
  """A (rows, heads) table resized to the grid ``new`` (``old``: its grid,
  default the square its rows give; ``class_token``: it has the class
  token's three rows), float32: what timm's BEiT and ``RelPosBias`` load
  at another ``img_size``."""
  table = np.asarray(table, np.float32)
  old = (tuple(old) if old is not None
         else grid_of_rows(table.shape[0], class_token))
  if old is None or table_rows(old, class_token) != table.shape[0]:
    raise ValueError(
        f"A relative position table of {table.shape[0]} rows is not that of "
        f"a square patch grid ((2g - 1)^2{' + 3' if class_token else ''} "
        f"rows): pass the grid it was made for.")
  if old == tuple(new):
    return table
  m = resize_matrix(old, tuple(new), class_token)
  return (m @ table.astype(np.float64)).astype(np.float32)


def attention_impl(impl: str, requested: Optional[str]) -> str:
  """The attention path for logits with a position bias: the
  materialised-probabilities path (``'weights'``: softmax(q k^T * scale +
  bias) v, differentiable in the bias) for ``'matmul'`` (whose fused CPU
  kernel takes only a padding mask), ``jax.nn.dot_product_attention``'s
  ``bias`` for ``'xla'``; cuDNN's fused kernel, chosen, gives way to
  ``'xla'``, and requested is refused."""
  if impl == "cudnn":
    if requested == "cudnn":
      raise ValueError(
          "attention_impl='cudnn': a relative position bias (rel_pos_bias) "
          "is added to the attention logits, which vit_jax's cuDNN path "
          "does not take; use attention_impl='xla' or None.")
    return "xla"
  return "weights" if impl == "matmul" else impl


class RelativePositionBias(nn.Module):
  """The table (parameter ``table``: (rows, heads), zeros as timm's BEiT)
  and the float32 (heads, T, T) bias it gives for the input's grid
  (:class:`Grids`; with ``dynamic`` the table is resized to it,
  :func:`resize_matrix`). ``num_tokens``: T, the patches and, before
  them, a class token or none."""

  num_heads: int
  param_dtype: object = jnp.float32

  @nn.compact
  def __call__(self, grids: Grids, num_tokens: int):
    grid = tuple(int(g) for g in grids.grid)
    cls = _class_token(grid, num_tokens)
    base = tuple(grids.base) if grids.base else None
    if self.has_variable("params", "table"):
      rows = int(self.get_variable("params", "table").shape[0])
      if base is not None and table_rows(base, cls) != rows:
        raise ValueError(
            f"rel_pos_bias: the table has {rows} rows, but the model's "
            f"image_size gives a {base[0]}x{base[1]} patch grid "
            f"({table_rows(base, cls)} rows). Set image_size to the "
            f"resolution the weights were made for.")
      if base is None:
        base = (grid if rows == table_rows(grid, cls)
                else grid_of_rows(rows, cls))
      if base is None:
        raise ValueError(
            f"rel_pos_bias: the table has {rows} rows, which is neither the "
            f"table of the input's {grid[0]}x{grid[1]} patch grid "
            f"({table_rows(grid, cls)} rows) nor a square grid's. Set "
            f"image_size to the resolution the weights were made for.")
    base = base or grid
    table = self.param("table", nn.initializers.zeros,
                       (table_rows(base, cls), self.num_heads),
                       self.param_dtype)
    table = table.astype(jnp.float32)
    if base != grid:
      if not grids.dynamic:
        raise ValueError(
            f"Input resolution does not match the relative position bias: "
            f"its table is made for a {base[0]}x{base[1]} patch grid, the "
            f"input gives {grid[0]}x{grid[1]}. Load the weights with "
            f"image_size= (the table resized as timm does) or build the "
            f"model with dynamic_img_size=True.")
      table = jnp.matmul(
          jnp.asarray(resize_matrix(base, grid, cls), jnp.float32), table,
          precision=lax.Precision.HIGHEST)
    index = position_index(grid, cls)
    t = index.shape[0]
    bias = jnp.take(table, jnp.asarray(index.reshape(-1)), axis=0)
    return jnp.transpose(bias.reshape(t, t, self.num_heads), (2, 0, 1))


def _class_token(grid: Grid, num_tokens: int) -> bool:
  """Whether a class token comes before the ``grid``'s patches."""
  prefix = num_tokens - grid[0] * grid[1]
  if prefix not in (0, 1):
    raise ValueError(
        f"rel_pos_bias: a relative position bias is for the "
        f"{grid[0]}x{grid[1]} patches and at most one class token before "
        f"them ({grid[0] * grid[1]} or {grid[0] * grid[1] + 1} tokens); "
        f"got {num_tokens} tokens.")
  return prefix == 1


@functools.lru_cache(maxsize=32)
def log_coords(grid: Grid, mode: str) -> np.ndarray:
  """(2h - 1, 2w - 1, 2) float32 log-spaced coordinates of the offsets
  (dy, dx) between two patches of an ``h x w`` grid, in float32 as timm's
  ``gen_relative_log_coords``: ``'cr'`` sign(d) * log(1 + |d|); ``'swin'``
  d scaled to [-8, 8] by the grid (d / (side - 1) * 8), then sign *
  log2(1 + |.|) / log2(8)."""
  h, w = grid
  dy = np.arange(-(h - 1), h, dtype=np.float32)
  dx = np.arange(-(w - 1), w, dtype=np.float32)
  c = np.stack(np.meshgrid(dy, dx, indexing="ij"), axis=-1)
  if mode == "swin":
    with np.errstate(divide="ignore", invalid="ignore"):  # a side of 1
      c = c / np.asarray([h - 1, w - 1], np.float32) * np.float32(8)
    c = np.sign(c) * np.log2(np.float32(1) + np.abs(c)) / np.float32(
        math.log2(8))
  else:
    c = np.sign(c) * np.log(np.float32(1) + np.abs(c))
  c = c.astype(np.float32)
  c.setflags(write=False)
  return c


class RelativePositionMlp(nn.Module):
  """timm's ``RelPosMlp``: the MLP (``Dense_0``, ReLU, ``Dense_1``; no
  ``Dense_1`` bias in ``'swin'`` mode) of the grid's :func:`log_coords`,
  gathered to the float32 (heads, T, T) bias of the patches (``'swin'``:
  ``16 * sigmoid``), zeros for the prefix tokens before them (``num_tokens
  - hw``). Computed at the highest matmul precision (a few hundred rows:
  exact on every backend for nothing). ``deterministic=False``: the
  hidden units dropped at :data:`MLP_DROPOUT`, as timm's in training."""

  num_heads: int
  mode: str = "cr"
  hidden: int = 128
  param_dtype: object = jnp.float32
  deterministic: bool = True

  @nn.compact
  def __call__(self, grids: Grids, num_tokens: int):
    grid = tuple(int(g) for g in grids.grid)
    prefix = num_tokens - grid[0] * grid[1]
    dense = functools.partial(nn.Dense, dtype=jnp.float32,
                              param_dtype=self.param_dtype,
                              precision=lax.Precision.HIGHEST)
    y = jnp.asarray(log_coords(grid, self.mode).reshape(-1, 2))
    y = nn.relu(dense(self.hidden, name="Dense_0")(y))
    y = nn.Dropout(MLP_DROPOUT)(y, deterministic=self.deterministic)
    y = dense(self.num_heads, use_bias=self.mode != "swin", name="Dense_1")(y)
    index = position_index(grid, class_token=False)
    t = index.shape[0]
    bias = jnp.take(y, jnp.asarray(index.reshape(-1)), axis=0)
    bias = jnp.transpose(bias.reshape(t, t, self.num_heads), (2, 0, 1))
    if self.mode == "swin":
      bias = 16.0 * jax.nn.sigmoid(bias)
    if prefix:
      bias = jnp.pad(bias, ((0, 0), (prefix, 0), (prefix, 0)))
    return bias


def bias_module(config, deterministic: bool = True, name: str = "rel_pos_bias"):
  """The module of ``config``'s relative position bias (a
  :class:`~vit_jax.models.BlockConfig`): its table, or its MLP
  (``rel_pos_mlp``); called with (:class:`Grids`, tokens)."""
  if config.rel_pos_mlp is None:
    return RelativePositionBias(config.num_heads, config.param_dtype,
                                name=name)
  return RelativePositionMlp(config.num_heads, config.rel_pos_mlp,
                             config.rel_pos_mlp_dim, config.param_dtype,
                             deterministic, name=name)
