"""PyTorch's bicubic resizing as (n_out, n_in) numpy matrices.

Resizing a grid along one axis is a linear map; PyTorch's separable bicubic
``F.interpolate`` is one matrix per axis, and a 2-D resize is two small
matmuls. Two of PyTorch's variants matter here, and they use different cubic
kernels:

* :func:`bicubic_matrix`: ``mode='bicubic', align_corners=True`` without
  antialiasing (Keys' kernel with A = -0.75, border taps clamped):
  torchvision's ``interpolate_embeddings``.
* :func:`aa_bicubic_matrix`: ``mode='bicubic', antialias=True,
  align_corners=False`` (A = -0.5 as PIL, half-pixel centres, the kernel
  widened by the scale when shrinking, taps outside the grid dropped and the
  rest renormalised): timm's ``resample_abs_pos_embed`` (its
  ``dynamic_img_size`` forward pass) and ``resample_patch_embed``.

* :func:`bilinear_matrix`: ``mode='bilinear'`` without antialiasing
  (RADIO's position grid).
* :func:`resize_weights` / :func:`bilinear_taps`: rows of those resizes
  (and of the antialiased bilinear one, SigLIP 2's NaFlex grid) at chosen
  output indices for an output size that may be a traced value: written
  once for numpy and ``jax.numpy`` (``xp``), so that NaFlex models resize
  their position grid to each image's own grid inside ``jit``.

Note ``jax.image.resize`` ('cubic') is neither (A = -0.5, no renormalisation
at the border, no widening when upsampling). The matrices are numpy, so they
are built once per shape at trace time and enter a jitted computation as
constants.
"""

from __future__ import annotations

import functools

import numpy as np


def _keys_cubic(x: np.ndarray, a: float) -> np.ndarray:
  """Keys' cubic convolution kernel at distances ``x``."""
  x = np.abs(x)
  near = ((a + 2) * x - (a + 3)) * x * x + 1
  far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
  return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _cubic_weights(t: np.ndarray, a: float = -0.75) -> np.ndarray:
  """The 4 taps' weights around fractional positions ``t`` in [0, 1), in
  ``t``'s dtype (PyTorch computes them in the input's dtype)."""
  def near(x):  # |x| <= 1
    return ((a + 2) * x - (a + 3)) * x * x + 1

  def far(x):  # 1 < |x| < 2
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

  return np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=-1)


@functools.lru_cache(maxsize=256)
def bicubic_matrix(n_in: int, n_out: int, dtype=np.float32) -> np.ndarray:
  """(n_out, n_in) float64 matrix of PyTorch's bicubic resize with
  ``align_corners=True`` and no antialiasing (A = -0.75).

  Source coordinates and tap weights are computed in ``dtype``, as PyTorch
  does for inputs of that dtype; the matrix entries are summed in float64.
  """
  f = np.float64 if np.dtype(dtype) == np.float64 else np.float32
  scale = f(n_in - 1) / f(n_out - 1) if n_out > 1 else f(0)
  src = np.arange(n_out, dtype=f) * scale
  base = np.floor(src).astype(np.int64)
  weights = _cubic_weights(src - base.astype(f)).astype(np.float64)
  mat = np.zeros((n_out, n_in), np.float64)
  for tap in range(4):
    # Out-of-range taps read the border pixel, as PyTorch clamps indices.
    idx = np.clip(base - 1 + tap, 0, n_in - 1)
    np.add.at(mat, (np.arange(n_out), idx), weights[:, tap])
  mat.setflags(write=False)
  return mat


@functools.lru_cache(maxsize=256)
def aa_bicubic_matrix(n_in: int, n_out: int) -> np.ndarray:
  """(n_out, n_in) float64 matrix of PyTorch's ``F.interpolate(...,
  mode='bicubic', antialias=True, align_corners=False)`` along one axis.

  PyTorch's separable antialiased kernel (``_compute_weights_aa``): output
  ``i`` is centred at ``scale * (i + 0.5)`` in the input (scale = n_in /
  n_out); the support is 2 input pixels, times ``scale`` when shrinking
  (then the kernel is stretched by it: a low-pass filter); the taps are the
  input pixels ``floor(center -+ support + 0.5)`` inside the grid, weighted by
  the A = -0.5 cubic and normalised to sum to one.
  """
  scale = n_in / n_out
  support = 2.0 * scale if scale >= 1.0 else 2.0
  invscale = 1.0 / scale if scale >= 1.0 else 1.0
  mat = np.zeros((n_out, n_in), np.float64)
  for i in range(n_out):
    center = scale * (i + 0.5)
    # PyTorch truncates (int64 cast) and clamps to the grid.
    lo = max(int(center - support + 0.5), 0)
    hi = min(int(center + support + 0.5), n_in)
    j = np.arange(lo, hi)
    w = _keys_cubic((j - center + 0.5) * invscale, -0.5)
    total = w.sum()
    mat[i, lo:hi] = w / total if total != 0 else w
  mat.setflags(write=False)
  return mat


@functools.lru_cache(maxsize=256)
def bilinear_matrix(n_in: int, n_out: int, align_corners: bool) -> np.ndarray:
  """(n_out, n_in) float64 matrix of PyTorch's ``F.interpolate(...,
  mode='bilinear', antialias=False, align_corners=...)`` along one axis
  (RADIO's resize of its position grid).

  Source coordinates in float32, as PyTorch computes them for float32
  inputs: ``i * (n_in - 1) / (n_out - 1)`` with ``align_corners``, else
  ``(i + 0.5) * n_in / n_out - 0.5`` clamped at 0; the two neighbours
  (the upper clamped to the grid) weighted linearly.
  """
  f = np.float32
  i = np.arange(n_out, dtype=f)
  if align_corners:
    scale = f((n_in - 1) / (n_out - 1)) if n_out > 1 else f(0)
    src = i * scale
  else:
    src = np.maximum((i + f(0.5)) * f(n_in / n_out) - f(0.5), f(0))
  lo = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
  hi = np.minimum(lo + 1, n_in - 1)
  w_hi = (src - lo.astype(f)).astype(np.float64)
  mat = np.zeros((n_out, n_in), np.float64)
  np.add.at(mat, (np.arange(n_out), lo), 1.0 - w_hi)
  np.add.at(mat, (np.arange(n_out), hi), w_hi)
  mat.setflags(write=False)
  return mat


def resize_2d(grid: np.ndarray, mat_h: np.ndarray, mat_w: np.ndarray):
  """(..., H, W, D) -> (..., H', W', D) with per-axis matrices (numpy)."""
  out = np.einsum("Hh,...hwd->...Hwd", mat_h, grid)
  return np.einsum("Ww,...hwd->...hWd", mat_w, out)


# --------------------------------------------------------------------------- #
# Rows of a resize for an output size known only at run time (NaFlex).
# --------------------------------------------------------------------------- #

# PyTorch's F.interpolate modes a NaFlex position grid is resized with:
# 'bilinear_aa' (bilinear, antialias=True: SigLIP 2), 'bicubic_aa' (bicubic,
# antialias=True: timm's NaFlexVit default), 'bilinear' (no antialiasing:
# RADIO). align_corners=False for the antialiased ones, as timm's.
RESIZE_KINDS = ("bilinear_aa", "bicubic_aa", "bilinear")


def bilinear_taps(n_in: int, size, pos, align_corners: bool, xp=np):
  """The two taps of PyTorch's plain bilinear resize (``antialias=False``)
  of an ``n_in`` axis to ``size`` at output indices ``pos``: ``(i0, i1,
  w0, w1)``, each shaped like ``pos`` (``i*`` int32, ``w*`` float32).

  ``size`` and ``pos`` are arrays (traced under ``jit`` with
  ``xp=jax.numpy``), broadcast together. Source coordinates in float32,
  as PyTorch computes them for float32 inputs: :func:`bilinear_matrix`'s
  arithmetic.
  """
  f = xp.float32
  size = xp.asarray(size).astype(f)
  pos = xp.asarray(pos).astype(f)
  if align_corners:
    scale = xp.where(size > 1, f(n_in - 1) / xp.maximum(size - 1, f(1)), f(0))
    src = pos * scale
  else:
    src = xp.maximum((pos + f(0.5)) * (f(n_in) / size) - f(0.5), f(0))
  i0 = xp.minimum(xp.floor(src), f(n_in - 1))
  i1 = xp.minimum(i0 + 1, f(n_in - 1))
  w1 = (src - i0).astype(f)
  return (i0.astype(xp.int32), i1.astype(xp.int32), (f(1) - w1).astype(f),
          w1)


def resize_weights(kind: str, n_in: int, size, pos, align_corners: bool = False,
                   xp=np):
  """Rows of PyTorch's (size, n_in) resize matrix at output indices
  ``pos``: (..., n_in) float32 for ``pos`` and ``size`` (arrays, traced
  under ``jit`` with ``xp=jax.numpy``) broadcast together.

  ``kind`` (:data:`RESIZE_KINDS`): ``'bilinear'`` (``antialias=False``,
  ``align_corners`` as given: :func:`bilinear_taps`), or the antialiased
  ``'bilinear_aa'`` / ``'bicubic_aa'`` (``align_corners=False``): PyTorch's
  separable antialiased kernel, as :func:`aa_bicubic_matrix` describes,
  with the triangle filter (support 1) or the A = -0.5 cubic (support 2),
  widened by the scale when shrinking, computed in float32 as PyTorch does
  for float32 inputs.
  """
  if kind not in RESIZE_KINDS:
    raise ValueError(f"resize kind {kind!r}: expected one of {RESIZE_KINDS}")
  f = xp.float32
  j = xp.arange(n_in).astype(f)
  if kind == "bilinear":
    i0, i1, w0, w1 = bilinear_taps(n_in, size, pos, align_corners, xp)
    return (w0[..., None] * (j == i0[..., None].astype(f)) +
            w1[..., None] * (j == i1[..., None].astype(f))).astype(f)
  if align_corners:
    raise ValueError(f"resize kind {kind!r} is antialiased: PyTorch has no "
                     f"align_corners=True for it")
  size = xp.asarray(size).astype(f)
  pos = xp.asarray(pos).astype(f)
  base = f(1.0) if kind == "bilinear_aa" else f(2.0)
  scale = f(n_in) / size
  shrink = scale >= 1
  support = xp.where(shrink, scale * base, base)
  invscale = xp.where(shrink, f(1) / scale, f(1))
  center = scale * (pos + f(0.5))
  # PyTorch truncates toward zero and clamps to the grid: for the lower
  # bound floor-then-clamp is the same.
  lo = xp.maximum(xp.floor(center - support + f(0.5)), f(0))
  hi = xp.minimum(xp.floor(center + support + f(0.5)), f(n_in))
  t = xp.abs((j - center[..., None] + f(0.5)) * invscale[..., None])
  if kind == "bilinear_aa":
    w = xp.maximum(f(1) - t, f(0))
  else:
    a = f(-0.5)
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    w = xp.where(t < 1, near, xp.where(t < 2, far, f(0)))
  w = w * ((j >= lo[..., None]) & (j < hi[..., None])).astype(f)
  total = xp.sum(w, axis=-1, keepdims=True)
  return (w / xp.where(total != 0, total, f(1))).astype(f)


@functools.lru_cache(maxsize=256)
def aa_bilinear_matrix(n_in: int, n_out: int) -> np.ndarray:
  """(n_out, n_in) float32-computed matrix of PyTorch's ``F.interpolate(...,
  mode='bilinear', antialias=True, align_corners=False)`` along one axis
  (SigLIP 2's NaFlex position grid): :func:`resize_weights` at every output
  index, as float64."""
  mat = resize_weights("bilinear_aa", n_in, n_out,
                       np.arange(n_out)).astype(np.float64)
  mat.setflags(write=False)
  return mat
