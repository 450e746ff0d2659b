"""BEiT's relative position bias (timm's ``beit.py``; BEiT, BEiT v2,
Data2Vec-Vision): a learned table of one bias per head for every relative
offset between two patches, added to the attention logits.

For a patch grid of ``h x w`` the table has ``(2h - 1)(2w - 1) + 3`` rows
of ``num_heads`` values: one per offset (dy, dx), row ``(dy + h - 1) *
(2w - 1) + (dx + w - 1)``, then three for the class token: class -> patch,
patch -> class and class -> class (timm's ``gen_relative_position_index``).
The (1 + hw, 1 + hw) index into it depends only on the grid, so it is a
numpy constant built at trace time; the bias is a gather of the table.

Two places for the table (the model's ``rel_pos_bias``):

* ``'block'``: one table per block, in its attention (timm's
  ``use_rel_pos_bias``, every released BEiT): parameter
  ``encoderblock_{i}/MultiHeadDotProductAttention_0/rel_pos_bias/table``;
* ``'shared'``: one table for all blocks (timm's
  ``use_shared_rel_pos_bias``; BEiT's self-supervised checkpoints):
  ``Transformer/rel_pos_bias/table``.

The table is laid out for one grid: the grid of ``image_size`` (else of the
input given to ``init``). timm's BEiT has a fixed input size and resizes the
table when it is built for another one (``resize_rel_pos_bias_table``: the
offsets placed on a geometric progression, linearly interpolated to the
new grid's offsets, the three class-token rows kept); :func:`resize_matrix`
is that resize as a constant matrix, which the weights layer applies to
loaded tables (``image_size=``) and a ``dynamic_img_size`` model applies in
the forward pass, so any grid runs with one set of variables (under
``jax.jit`` each new input shape compiles once).

The bias needs the attention's logits: the model computes attention with
a bias through the paths that take one (:func:`attention_impl`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Tuple

import flax.linen as nn
import jax.numpy as jnp
from jax import lax
import numpy as np

KINDS = ("block", "shared")
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


def check(kind: str) -> None:
  if kind not in KINDS:
    raise ValueError(
        f"rel_pos_bias={kind!r}: expected None, 'block' (a table per block, "
        f"timm's use_rel_pos_bias) or 'shared' (one table for every block, "
        f"timm's use_shared_rel_pos_bias)")


def table_rows(grid: Grid) -> int:
  """Rows of the table of an ``h x w`` patch grid."""
  h, w = grid
  return (2 * h - 1) * (2 * w - 1) + EXTRA_ROWS


def grid_of_rows(rows: int) -> Optional[Grid]:
  """The square grid whose table has ``rows`` rows (None if none has)."""
  side = math.isqrt(max(rows - EXTRA_ROWS, 0))
  if side * side != rows - EXTRA_ROWS or side % 2 == 0:
    return None
  return (side + 1) // 2, (side + 1) // 2


@functools.lru_cache(maxsize=32)
def position_index(grid: Grid) -> np.ndarray:
  """(1 + hw, 1 + hw) int32 rows of the table for every (query, key) pair
  of [class token, patches in row-major order]: timm's
  ``gen_relative_position_index``."""
  h, w = grid
  n = table_rows(grid)
  ys, xs = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
  ys, xs = ys.reshape(-1), xs.reshape(-1)
  dy = ys[:, None] - ys[None, :] + h - 1
  dx = xs[:, None] - xs[None, :] + w - 1
  out = np.zeros((h * w + 1,) * 2, np.int32)
  out[1:, 1:] = dy * (2 * w - 1) + dx
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
def resize_matrix(old: Grid, new: Grid) -> np.ndarray:
  """(rows of ``new``, rows of ``old``) float64: timm's
  ``resize_rel_pos_bias_table`` (without scipy, its default) from the
  table of grid ``old`` to that of ``new`` as one linear map; the identity
  for the same grid."""
  old, new = tuple(old), tuple(new)
  n_new, n_old = table_rows(new), table_rows(old)
  if old == new:
    return np.eye(n_old)
  src = (2 * old[0] - 1, 2 * old[1] - 1)
  dst = (2 * new[0] - 1, 2 * new[1] - 1)
  mats = []
  for s, d in zip(src, dst):
    t = d // 2.0
    target = np.arange(-t, t + 0.1, 1.0, dtype=np.float32)
    mats.append(_linear_matrix(_progression(s, d), target))
  out = np.zeros((n_new, n_old))
  out[:-EXTRA_ROWS, :-EXTRA_ROWS] = np.kron(mats[0], mats[1])
  out[-EXTRA_ROWS:, -EXTRA_ROWS:] = np.eye(EXTRA_ROWS)
  out.setflags(write=False)
  return out


def resize_table(table, new: Grid, old: Optional[Grid] = None) -> np.ndarray:
  """A (rows, heads) table resized to the grid ``new`` (``old``: its grid,
  default the square its rows give), float32: what timm's BEiT loads at
  another ``img_size``."""
  table = np.asarray(table, np.float32)
  old = tuple(old) if old is not None else grid_of_rows(table.shape[0])
  if old is None or table_rows(old) != table.shape[0]:
    raise ValueError(
        f"A relative position table of {table.shape[0]} rows is not that of "
        f"a square patch grid ((2g - 1)^2 + 3 rows): pass the grid it was "
        f"made for.")
  if old == tuple(new):
    return table
  m = resize_matrix(old, tuple(new))
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
  """The table (parameter ``table``: (rows, heads), zeros as timm's) and
  the float32 (heads, 1 + hw, 1 + hw) bias it gives for the input's grid
  (:class:`Grids`; with ``dynamic`` the table is resized to it,
  :func:`resize_matrix`)."""

  num_heads: int
  param_dtype: object = jnp.float32

  @nn.compact
  def __call__(self, grids: Grids, num_tokens: int):
    grid = tuple(int(g) for g in grids.grid)
    if num_tokens != 1 + grid[0] * grid[1]:
      raise ValueError(
          f"rel_pos_bias: the relative position bias is BEiT's, for one "
          f"class token before the {grid[0]}x{grid[1]} patches "
          f"({1 + grid[0] * grid[1]} tokens); got {num_tokens} tokens.")
    base = tuple(grids.base) if grids.base else None
    if self.has_variable("params", "table"):
      rows = int(self.get_variable("params", "table").shape[0])
      if base is not None and table_rows(base) != rows:
        raise ValueError(
            f"rel_pos_bias: the table has {rows} rows, but the model's "
            f"image_size gives a {base[0]}x{base[1]} patch grid "
            f"({table_rows(base)} rows). Set image_size to the resolution "
            f"the weights were made for.")
      if base is None:
        base = grid if rows == table_rows(grid) else grid_of_rows(rows)
      if base is None:
        raise ValueError(
            f"rel_pos_bias: the table has {rows} rows, which is neither the "
            f"table of the input's {grid[0]}x{grid[1]} patch grid "
            f"({table_rows(grid)} rows) nor a square grid's. Set "
            f"image_size to the resolution the weights were made for.")
    base = base or grid
    table = self.param("table", nn.initializers.zeros,
                       (table_rows(base), self.num_heads), self.param_dtype)
    table = table.astype(jnp.float32)
    if base != grid:
      if not grids.dynamic:
        raise ValueError(
            f"Input resolution does not match the relative position bias: "
            f"its table is made for a {base[0]}x{base[1]} patch grid, the "
            f"input gives {grid[0]}x{grid[1]}. Load the weights with "
            f"image_size= (the table resized as timm's BEiT does) or build "
            f"the model with dynamic_img_size=True.")
      table = jnp.matmul(jnp.asarray(resize_matrix(base, grid), jnp.float32),
                         table, precision=lax.Precision.HIGHEST)
    index = position_index(grid)
    t = index.shape[0]
    bias = jnp.take(table, jnp.asarray(index.reshape(-1)), axis=0)
    return jnp.transpose(bias.reshape(t, t, self.num_heads), (2, 0, 1))
