"""NaFlex inputs (SigLIP 2's, timm's ``NaFlexVit``): images of any aspect
ratio as padded sequences of patches, and the learned position grid
resized to each image's own patch grid.

A NaFlex batch is the dict timm's ``NaFlexVit`` takes::

    {"patches":     (B, N, P*P*C) float, each patch's pixels in (y, x, channel)
                    order (timm's ``patchify_image``, transformers' Siglip2
                    ``pixel_values``),
     "patch_coord": (B, N, 2) int, each patch's (row, column) in its image's
                    patch grid,
     "patch_valid": (B, N) bool, False for padding}

An image of ``gh x gw`` patches has its learned position grid (``pos_grid``
(1, H0, W0, D), 16 x 16 for SigLIP 2) resized to ``gh x gw`` with PyTorch's
``F.interpolate`` (:data:`~vit_jax.models.interpolate.RESIZE_KINDS`;
``square``: to the square of the longer side, then the top-left ``gh x gw``
kept, RADIO's), and each patch gets the row at its own coordinate. The
image's grid is read from its valid coordinates (``max + 1``), so the
output size of the resize is a traced value: the rows of the resize matrix
are computed inside ``jit`` (:func:`~vit_jax.models.interpolate.
resize_weights`), one sequence length compiles once whatever the images'
shapes.

timm adds the resized grid by sequence index (valid patches first, in
row-major order: what its patchifier makes); here each patch is placed by
its coordinate, which is the same for those inputs and also holds when the
padding or the patches are elsewhere in the sequence.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from jax import lax

from vit_jax.models import interpolate

Dtype = Any

KEYS = ("patches", "patch_coord", "patch_valid")
RESIZE_KINDS = interpolate.RESIZE_KINDS
_MASKED = float(np.finfo(np.float32).min)  # timm's and transformers' fill


def is_naflex_input(x) -> bool:
  """Whether ``x`` is a NaFlex dict (rather than an image array)."""
  return isinstance(x, Mapping)


def unpack(inputs: Mapping[str, Any], patch_size: int, num_channels: int
           ) -> Tuple[Any, Any, Any]:
  """The dict's ``(patches, patch_coord, patch_valid)``, checked: a
  ValueError that names what was expected for a missing key, a wrong
  shape or dtype. ``patch_valid`` comes back as bool, ``patch_coord`` as
  int32."""
  missing = [k for k in KEYS if k not in inputs]
  extra = sorted(set(inputs) - set(KEYS) - {"seq_len"})
  if missing or extra:
    raise ValueError(
        f"A NaFlex input is a dict with keys {list(KEYS)} (timm's NaFlexVit "
        f"dict: 'seq_len' is allowed and ignored); got keys {sorted(inputs)}"
        + (f", missing {missing}" if missing else "")
        + (f", unexpected {extra}" if extra else "") + ".")
  patches, coord, valid = (inputs[k] for k in KEYS)
  k = patch_size * patch_size * num_channels
  ps, cs, vs = (tuple(getattr(a, "shape", np.shape(a)))
                for a in (patches, coord, valid))
  if len(ps) != 3 or ps[-1] != k:
    raise ValueError(
        f"NaFlex 'patches' must be (batch, sequence, {k}): patches of "
        f"{patch_size}x{patch_size} pixels x {num_channels} channels in "
        f"(y, x, channel) order, got shape {ps}.")
  b, n = ps[:2]
  if cs != (b, n, 2):
    raise ValueError(f"NaFlex 'patch_coord' must be (batch, sequence, 2) = "
                     f"({b}, {n}, 2) integer (row, column) coordinates, got "
                     f"shape {cs}.")
  if vs != (b, n):
    raise ValueError(f"NaFlex 'patch_valid' must be (batch, sequence) = "
                     f"({b}, {n}) booleans (False: padding), got shape {vs}.")
  if not jnp.issubdtype(jnp.result_type(patches), jnp.floating):
    raise ValueError(
        f"NaFlex 'patches' must be float (normalised pixels), got dtype "
        f"{jnp.result_type(patches)}.")
  if not jnp.issubdtype(jnp.result_type(coord), jnp.integer):
    raise ValueError(f"NaFlex 'patch_coord' must be integers, got dtype "
                     f"{jnp.result_type(coord)}.")
  return (patches, jnp.asarray(coord).astype(jnp.int32),
          jnp.asarray(valid).astype(bool))


def grid_sizes(coord, valid):
  """(B, 2) int32: each image's patch grid (rows, columns), one more than
  its largest valid coordinates (at least 1x1 for an all-padding row)."""
  c = jnp.where(valid[..., None], coord, 0)
  return jnp.maximum(jnp.max(c, axis=1) + 1, 1)


def key_mask(valid, num_prefix: int = 0):
  """(B, prefix + N) bool: which tokens attention may read; the prefix
  tokens (class token, registers) are always valid."""
  if not num_prefix:
    return valid
  ones = jnp.ones((valid.shape[0], num_prefix), bool)
  return jnp.concatenate([ones, valid], axis=1)


def attention_bias(mask):
  """Key mask (B, S) -> additive float32 bias (B, 1, 1, S): 0 where a key
  may be read, float32's lowest where not (timm's and transformers' fill,
  finite, so an all-padding row gives no NaN)."""
  return jnp.where(mask, 0.0, _MASKED).astype(jnp.float32)[:, None, None, :]


def masked_mean(x, valid):
  """(B, N, D), (B, N) -> (B, D): the mean over the valid tokens (timm's
  ``global_pool_naflex`` 'avg': the count at least 1)."""
  w = valid.astype(x.dtype)[..., None]
  count = jnp.maximum(jnp.sum(w, axis=1), 1)
  return jnp.sum(x * w, axis=1) / count


def _resize_sizes(sizes, square: bool):
  if square:  # RADIO / timm's ar_preserving: the square of the longer side
    side = jnp.max(sizes, axis=-1, keepdims=True)
    return jnp.concatenate([side, side], axis=-1)
  return sizes


def positions(grid, coord, sizes, kind: str, square: bool = False,
              align_corners: bool = False):
  """The position rows of every patch: (B, N, D) float32.

  ``grid``: the learned (H0, W0, D) grid; ``coord`` (B, N, 2) each patch's
  (row, column); ``sizes`` (B, 2) each image's patch grid. Row ``(y, x)``
  of the grid resized to that image's size (``square``: to the square of
  its longer side; the top-left part is the image's), computed directly:
  antialiased kinds as the (N, H0*W0) outer product of the two axes'
  weights times the grid (one GEMM); plain bilinear from its four taps
  (gathers: a 128 x 128 RADIO grid costs four rows per patch).
  """
  h0, w0, d = grid.shape
  size = _resize_sizes(sizes, square)[:, None, :]  # (B, 1, 2)
  y, x = coord[..., 0], coord[..., 1]
  grid = grid.astype(jnp.float32)
  if kind == "bilinear":
    ty = interpolate.bilinear_taps(h0, size[..., 0], y, align_corners, jnp)
    tx = interpolate.bilinear_taps(w0, size[..., 1], x, align_corners, jnp)
    flat = grid.reshape(h0 * w0, d)
    out = 0.0
    for iy, wy in ((ty[0], ty[2]), (ty[1], ty[3])):
      for ix, wx in ((tx[0], tx[2]), (tx[1], tx[3])):
        out = out + (wy * wx)[..., None] * jnp.take(flat, iy * w0 + ix, axis=0)
    return out
  wy = interpolate.resize_weights(kind, h0, size[..., 0], y, xp=jnp)
  wx = interpolate.resize_weights(kind, w0, size[..., 1], x, xp=jnp)
  outer = (wy[..., :, None] * wx[..., None, :]).reshape(*y.shape, h0 * w0)
  return jnp.einsum("bnk,kd->bnd", outer, grid.reshape(h0 * w0, d),
                    precision=lax.Precision.HIGHEST)


def grid_positions(grid, size: Tuple[int, int], kind: str,
                   square: bool = False, align_corners: bool = False):
  """The learned (H0, W0, D) grid resized to a static ``size`` (an image
  batch's grid): (h*w, D) float32, row-major, with numpy matrices (as
  timm's ``_apply_learned_pos_embed``: the grid as it is when the sizes
  match)."""
  h0, w0, d = grid.shape
  h, w = size
  grid = grid.astype(jnp.float32)
  if (h, w) == (h0, w0):
    return grid.reshape(h * w, d)
  th, tw = (max(h, w),) * 2 if square else (h, w)
  mh = interpolate.resize_weights(kind, h0, th, np.arange(th), align_corners)
  mw = interpolate.resize_weights(kind, w0, tw, np.arange(tw), align_corners)
  hi = lax.Precision.HIGHEST
  out = jnp.einsum("Hh,hwd->Hwd", jnp.asarray(mh[:h]), grid, precision=hi)
  out = jnp.einsum("Ww,hwd->hWd", jnp.asarray(mw[:w]), out, precision=hi)
  return out.reshape(h * w, d)


def factorized_positions(pe_y, pe_x, coord, sizes, square: bool = False):
  """A factorized position embedding's rows of every patch: (B, N, D)
  float32. ``pe_y`` (H0, D) and ``pe_x`` (W0, D): the learned rows and
  columns, each resized to its image's grid (``sizes`` (B, 2); ``square``:
  both to its longer side, the first rows / columns kept) as PyTorch's
  1-D ``F.interpolate(mode='linear', align_corners=False)`` (timm's
  ``_apply_factorized_naflex_pos_embed``); patch (y, x) gets row y plus
  column x (two taps of each table)."""
  size = _resize_sizes(sizes, square)[:, None, :]  # (B, 1, 2)
  out = 0.0
  for table, n, pos in ((pe_y, size[..., 0], coord[..., 0]),
                        (pe_x, size[..., 1], coord[..., 1])):
    table = table.astype(jnp.float32)
    i0, i1, w0, w1 = interpolate.bilinear_taps(table.shape[0], n, pos, False,
                                               jnp)
    out = out + (w0[..., None] * jnp.take(table, i0, axis=0) +
                 w1[..., None] * jnp.take(table, i1, axis=0))
  return out


def factorized_grid_positions(pe_y, pe_x, size: Tuple[int, int],
                              square: bool = False):
  """A factorized position embedding for a static ``size`` (an image
  batch's grid): (h*w, D) float32, row-major, with numpy matrices (timm's
  ``_apply_factorized_pos_embed``: a table as it is where its length is
  the grid's)."""
  h, w = size
  th, tw = (max(h, w),) * 2 if square else (h, w)
  hi = lax.Precision.HIGHEST
  rows = []
  for table, n, keep in ((pe_y, th, h), (pe_x, tw, w)):
    m = interpolate.resize_weights("bilinear", table.shape[0], n,
                                   np.arange(n))[:keep]
    rows.append(jnp.einsum("Hh,hd->Hd", jnp.asarray(m),
                           table.astype(jnp.float32), precision=hi))
  return (rows[0][:, None] + rows[1][None]).reshape(h * w, -1)


class NaFlexPositionEmbs(nn.Module):
  """Adds the learned position grid ``pos_grid`` (1, H0, W0, D), resized to
  each image's patch grid, to the patch tokens (B, N, D).

  With ``coord`` / ``valid`` (a NaFlex batch) every image gets its own
  resize (:func:`positions`); without, the batch's static ``grid``
  (:func:`grid_positions`). ``kind``, ``square``, ``align_corners``: how
  the grid is resized (timm's ``pos_embed_interp_mode`` / ``antialias``,
  ``pos_embed_ar_preserving``, ``pos_embed_align_corners``).
  ``factorized``: learned rows ``pos_y`` (1, H0, D) and columns ``pos_x``
  (1, W0, D) instead of the grid, each resized by linear interpolation
  (``kind`` 'bilinear', the 1-D taps) and added (timm's
  ``pos_embed='factorized'``; :func:`factorized_positions`).
  """

  grid_size: Tuple[int, int]
  kind: str = "bilinear_aa"
  square: bool = False
  align_corners: bool = False
  param_dtype: Dtype = jnp.float32
  factorized: bool = False

  @nn.compact
  def __call__(self, x, *, grid: Optional[Tuple[int, int]] = None,
               coord=None, valid=None):
    d = x.shape[-1]
    if self.factorized:
      init = nn.initializers.normal(stddev=0.02)
      pe_y, pe_x = (self.param(name, init, (1, n, d), self.param_dtype)[0]
                    for name, n in (("pos_y", self.grid_size[0]),
                                    ("pos_x", self.grid_size[1])))
      if coord is None:
        pos = factorized_grid_positions(pe_y, pe_x, grid, self.square)[None]
      else:
        pos = factorized_positions(pe_y, pe_x, coord,
                                   grid_sizes(coord, valid), self.square)
      return x + pos.astype(x.dtype)
    shape = (1, *self.grid_size, d)
    if self.has_variable("params", "pos_grid"):
      have = tuple(self.get_variable("params", "pos_grid").shape)
      if len(have) != 4 or have[-1] != d:
        raise ValueError(
            f"The NaFlex position grid has shape {have}: expected (1, rows, "
            f"columns, {d}).")
      shape = have
    pe = self.param("pos_grid", nn.initializers.normal(stddev=0.02), shape,
                    self.param_dtype)[0]
    if coord is None:
      pos = grid_positions(pe, grid, self.kind, self.square,
                           self.align_corners)[None]
    else:
      pos = positions(pe, coord, grid_sizes(coord, valid), self.kind,
                      self.square, self.align_corners)
    return x + pos.astype(x.dtype)


def check_kind(kind: Optional[str], square: bool, align_corners: bool,
               factorized: bool = False) -> None:
  """A clear error for an unknown resize or an impossible combination."""
  if kind is None:
    if factorized:
      raise ValueError("naflex_factorized: a factorized position embedding "
                       "is a NaFlex model's (naflex='bilinear')")
    return
  if factorized and (kind != "bilinear" or align_corners):
    raise ValueError(
        f"naflex_factorized: the rows and columns are resized by linear "
        f"interpolation (timm's pos_embed='factorized'): it needs "
        f"naflex='bilinear' without naflex_align_corners, not "
        f"naflex={kind!r}, naflex_align_corners={align_corners}")
  if kind not in RESIZE_KINDS:
    raise ValueError(f"naflex={kind!r}: expected None or one of "
                     f"{RESIZE_KINDS} (how each image's position grid is "
                     f"resized: SigLIP 2 'bilinear_aa', timm's NaFlexVit "
                     f"default 'bicubic_aa', RADIO 'bilinear')")
  if align_corners and kind != "bilinear":
    raise ValueError(f"naflex_align_corners=True needs naflex='bilinear' "
                     f"(PyTorch's antialiased resizes have no align_corners)")
  del square


def pad_to(inputs: Mapping[str, Any], length: int) -> dict:
  """A NaFlex batch padded (or cut) to ``length`` tokens: zero patches,
  (0, 0) coordinates, invalid (as timm's collator pads)."""
  patches, coord, valid = (inputs[k] for k in KEYS)
  n = patches.shape[1]
  if length <= n:
    return {"patches": patches[:, :length], "patch_coord": coord[:, :length],
            "patch_valid": valid[:, :length]}
  pad = length - n
  widths = lambda a: [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)  # noqa: E731
  xp = np if isinstance(patches, np.ndarray) else jnp
  return {"patches": xp.pad(patches, widths(patches)),
          "patch_coord": xp.pad(coord, widths(coord)),
          "patch_valid": xp.pad(valid, widths(valid))}


__all__ = ["KEYS", "RESIZE_KINDS", "NaFlexPositionEmbs", "attention_bias",
           "factorized_grid_positions", "factorized_positions",
           "grid_positions", "grid_sizes", "is_naflex_input", "key_mask",
           "masked_mean", "pad_to", "positions", "unpack"]
