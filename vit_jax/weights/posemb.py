"""Position-embedding resampling: a checkpoint made for one resolution used at
another.

:func:`resample_posemb` is torchvision's ``interpolate_embeddings`` in numpy
(bicubic, ``align_corners=True``, PyTorch's cubic kernel A = -0.75), so
weights resampled here give torchvision's numbers; the prefix rows (class
token, registers) are kept as they are. :func:`resize_posemb` applies it to
a variables tree.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np

from vit_jax import models
from vit_jax.weights import trees


def _cubic_weights(t: np.ndarray, a: float = -0.75) -> np.ndarray:
  """Keys' cubic convolution weights for the 4 taps around ``t`` in [0, 1).

  Same kernel (A = -0.75) as PyTorch's ``upsample_bicubic2d``; note
  ``jax.image.resize`` uses A = -0.5 and half-pixel centres instead.
  """
  def near(x):  # |x| <= 1
    return ((a + 2) * x - (a + 3)) * x * x + 1

  def far(x):  # 1 < |x| < 2
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

  return np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=-1)


def _bicubic_matrix(n_in: int, n_out: int, dtype=np.float32) -> np.ndarray:
  """(n_out, n_in) matrix of bicubic interpolation with align_corners=True.

  Source coordinates and tap weights are computed in ``dtype``, as PyTorch
  does for inputs of that dtype; the result is accumulated in float64.
  """
  f = np.dtype(dtype).type if np.dtype(dtype) == np.float64 else np.float32
  scale = f(n_in - 1) / f(n_out - 1) if n_out > 1 else f(0)
  src = np.arange(n_out, dtype=f) * scale
  base = np.floor(src).astype(np.int64)
  weights = _cubic_weights(src - base.astype(f)).astype(np.float64)
  mat = np.zeros((n_out, n_in), np.float64)
  for tap in range(4):
    # Out-of-range taps read the border pixel, as PyTorch clamps indices.
    idx = np.clip(base - 1 + tap, 0, n_in - 1)
    np.add.at(mat, (np.arange(n_out), idx), weights[:, tap])
  return mat


def _grid_of(rows: int, what: str) -> Tuple[int, int]:
  side = math.isqrt(rows)
  if side * side != rows:
    raise ValueError(
        f"{what}: {rows} patch rows do not form a square grid; pass the grid "
        f"as old_grid=(height, width).")
  return side, side


def resample_posemb(posemb, new_grid, *, num_prefix_tokens: int = 1,
                    old_grid: Optional[Tuple[int, int]] = None) -> np.ndarray:
  """Resamples a (1, prefix + H*W, D) position embedding to ``new_grid``.

  Bicubic with ``align_corners=True``, prefix (class) tokens kept: the same
  numbers as torchvision's ``interpolate_embeddings``. ``new_grid`` is an int
  (square) or (height, width) in patches.
  """
  posemb = np.asarray(posemb)
  if posemb.ndim != 3 or posemb.shape[0] != 1:
    raise ValueError(f"Expected a position embedding of shape (1, tokens, "
                     f"width), got {posemb.shape}")
  prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
  gh, gw = old_grid or _grid_of(grid.shape[1], "resample_posemb")
  if gh * gw != grid.shape[1]:
    raise ValueError(f"old_grid={old_grid} has {gh * gw} cells, the embedding "
                     f"has {grid.shape[1]} patch rows")
  nh, nw = models._pair(new_grid)  # pylint: disable=protected-access
  if (nh, nw) == (gh, gw):
    return posemb
  d = grid.shape[-1]
  img = grid.reshape(gh, gw, d).astype(np.float64)
  img = np.einsum("Hh,hwd->Hwd", _bicubic_matrix(gh, nh, posemb.dtype), img)
  img = np.einsum("Ww,hwd->hWd", _bicubic_matrix(gw, nw, posemb.dtype), img)
  img = img.reshape(1, nh * nw, d).astype(posemb.dtype)
  return np.concatenate([prefix, img], axis=1)


def resize_posemb(variables, image_size, patch_size: Optional[int] = None,
                  num_prefix_tokens: Optional[int] = None):
  """Returns ``variables`` with the position embedding resampled for
  ``image_size`` (int or (H, W)). ``patch_size`` defaults to the embedding
  conv's kernel (pass it for a conv-stem model); ``num_prefix_tokens`` (the
  embedding's rows that are not patches) to the class token and registers
  the tree has (pass 0 for a ``no_embed_class`` model)."""
  params = trees.params_of(variables)
  if patch_size is None:
    patch_size = int(np.shape(params["embedding"]["kernel"])[0])
  h, w = models._pair(image_size)  # pylint: disable=protected-access
  if h % patch_size or w % patch_size:
    raise ValueError(f"image_size {h}x{w} is not divisible by the patch size "
                     f"{patch_size}")
  pe = params["Transformer"]["posembed_input"]["pos_embedding"]
  if num_prefix_tokens is None:  # the tree's class token and registers
    num_prefix_tokens = int("cls" in params) + (
        int(np.shape(params["registers"])[1]) if "registers" in params else 0)
    rows = int(np.shape(pe)[1])
    if _is_square(rows) and not _is_square(rows - num_prefix_tokens):
      num_prefix_tokens = 0  # no_embed_class: patch rows only
  new = resample_posemb(pe, (h // patch_size, w // patch_size),
                        num_prefix_tokens=num_prefix_tokens)
  return _replace_posemb(variables, new)


def _is_square(n: int) -> bool:
  return n >= 0 and math.isqrt(n) ** 2 == n


def _replace_posemb(variables, new):
  out = dict(variables)
  is_wrapped = "params" in variables
  params = dict(out["params"] if is_wrapped else out)
  tr = dict(params["Transformer"])
  tr["posembed_input"] = {"pos_embedding": new}
  params["Transformer"] = tr
  if is_wrapped:
    out["params"] = params
    return out
  return params
