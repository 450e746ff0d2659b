"""Resampling the spatial weights: a checkpoint made for one resolution or
patch size used at another.

* :func:`resample_posemb` / :func:`resize_posemb`: the position embedding
  on a new patch grid. ``method='torchvision'`` (default) is torchvision's
  ``interpolate_embeddings`` (bicubic, ``align_corners=True``, A = -0.75);
  ``method='timm'`` is timm's ``resample_abs_pos_embed`` (bicubic with
  antialiasing, half-pixel centres, A = -0.5), which is also what a
  ``dynamic_img_size`` model computes inside its forward pass. The prefix rows
  (class token, registers) are kept as they are.
* :func:`resample_patch_embed` / :func:`resize_patch_embed`: FlexiViT's
  (Beyer et al. 2023) pseudo-inverse resampling of the patch-embedding
  kernel to another patch size: the same numbers as timm's
  ``resample_patch_embed`` (and big_vision's ``resample_patchemb`` up to its
  resize), so that ``<x, w> == <resize(x), resample(w)>`` for patches ``x``.
* :func:`resize_rel_pos`: relative position tables (BEiT's, timm's
  ``RelPosBias``) on a new patch grid, as timm loads them at another
  ``img_size`` (``resize_rel_pos_bias_table``;
  :mod:`vit_jax.models.relpos`).

The interpolation matrices are :mod:`vit_jax.models.interpolate`'s.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np

from vit_jax.models import interpolate, relpos
from vit_jax import models
from vit_jax.weights import trees

METHODS = ("torchvision", "timm", "radio", "radio_ac")


def _matrix(method: str, n_in: int, n_out: int, dtype) -> np.ndarray:
  if method == "torchvision":
    return interpolate.bicubic_matrix(n_in, n_out, np.dtype(dtype).type)
  if method == "timm":
    return interpolate.aa_bicubic_matrix(n_in, n_out)
  if method in ("radio", "radio_ac"):
    return interpolate.bilinear_matrix(n_in, n_out, method == "radio_ac")
  raise ValueError(f"method={method!r}: expected one of {METHODS}")


def _grid_of(rows: int, what: str) -> Tuple[int, int]:
  side = math.isqrt(rows)
  if side * side != rows:
    raise ValueError(
        f"{what}: {rows} patch rows do not form a square grid; pass the grid "
        f"as old_grid=(height, width).")
  return side, side


def resample_posemb(posemb, new_grid, *, num_prefix_tokens: int = 1,
                    old_grid: Optional[Tuple[int, int]] = None,
                    method: str = "torchvision") -> np.ndarray:
  """Resamples a (1, prefix + H*W, D) position embedding to ``new_grid``.

  ``method='torchvision'``: bicubic with ``align_corners=True``, the same
  numbers as torchvision's ``interpolate_embeddings``; ``'timm'``: timm's
  ``resample_abs_pos_embed`` (antialiased bicubic); ``'radio'`` /
  ``'radio_ac'``: RADIO's (timm's ``_convert_radio``): bilinear without
  antialiasing (``align_corners`` False / True) to the square of the larger
  side, then the top-left ``new_grid`` cropped. Prefix (class, register)
  rows are kept. ``new_grid`` is an int (square) or (height, width) in
  patches; ``old_grid`` defaults to the square the patch rows form.
  """
  _matrix(method, 1, 1, np.float32)  # a clear error for an unknown method
  posemb = np.asarray(posemb)
  if posemb.ndim != 3 or posemb.shape[0] != 1:
    raise ValueError(f"Expected a position embedding of shape (1, tokens, "
                     f"width), got {posemb.shape}")
  prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
  gh, gw = old_grid or _grid_of(grid.shape[1], "resample_posemb")
  if gh * gw != grid.shape[1]:
    raise ValueError(f"old_grid={old_grid} has {gh * gw} cells, the embedding "
                     f"has {grid.shape[1]} patch rows")
  nh, nw = models.pair(new_grid)
  if (nh, nw) == (gh, gw):
    return posemb
  d = grid.shape[-1]
  img = grid.reshape(gh, gw, d).astype(np.float64)
  th, tw = (nh, nw) if not method.startswith("radio") else (max(nh, nw),) * 2
  img = interpolate.resize_2d(img, _matrix(method, gh, th, posemb.dtype),
                             _matrix(method, gw, tw, posemb.dtype))
  img = img[:nh, :nw].reshape(1, nh * nw, d).astype(posemb.dtype)
  return np.concatenate([prefix, img], axis=1)


def resize_posemb(variables, image_size, patch_size: Optional[int] = None,
                  num_prefix_tokens: Optional[int] = None, *,
                  method: str = "torchvision",
                  old_grid: Optional[Tuple[int, int]] = None,
                  remainder_ok: bool = False):
  """Returns ``variables`` with the position embedding resampled for
  ``image_size`` (int or (H, W)). ``patch_size`` defaults to the embedding
  conv's kernel (pass it for a conv-stem model, or the new patch size when
  the kernel is resampled too); ``num_prefix_tokens`` (the embedding's rows
  that are not patches) to the class token and registers the tree has (pass
  0 for a ``no_embed_class`` model). ``method`` and ``old_grid``: as
  :func:`resample_posemb`. ``remainder_ok``: a size that is not a multiple
  of the patch gets the grid of its whole patches (timm's convolution leaves
  the remainder out). A tree without a position embedding (DINOv3), or with
  a NaFlex grid (resized to every input in the forward pass), comes back as
  it is."""
  params = trees.params_of(variables)
  if "pos_embedding" not in params.get("Transformer", {}).get(
      "posembed_input", {}):
    return variables  # none (DINOv3), or a NaFlex grid: resized per image
  if patch_size is None:
    patch_size = trees.patch_size_of(params)
  h, w = models.pair(image_size)
  if (h % patch_size or w % patch_size) and not remainder_ok:
    raise ValueError(f"image_size {h}x{w} is not divisible by the patch size "
                     f"{patch_size}")
  pe = params["Transformer"]["posembed_input"]["pos_embedding"]
  if num_prefix_tokens is None:  # the tree's class token and registers
    num_prefix_tokens = int("cls" in params) + int("dist" in params) + (
        int(np.shape(params["registers"])[1]) if "registers" in params else 0)
    rows = int(np.shape(pe)[1])
    if _is_square(rows) and not _is_square(rows - num_prefix_tokens):
      num_prefix_tokens = 0  # no_embed_class: patch rows only
  new = resample_posemb(pe, (h // patch_size, w // patch_size),
                        num_prefix_tokens=num_prefix_tokens, method=method,
                        old_grid=old_grid)
  return _replace_posemb(variables, new)


def resize_rel_pos(variables, image_size, patch_size: Optional[int] = None,
                   old_grid: Optional[Tuple[int, int]] = None):
  """Returns ``variables`` (per-layer) with every relative position table
  (``.../rel_pos_bias/table``) resized to the patch grid of ``image_size``
  as timm's BEiT and VisionTransformerRelPos do when built at another
  ``img_size`` (:func:`vit_jax.models.relpos.resize_table`, the class
  token's rows where the tree has one; ``old_grid``: the tables' grid,
  default the square their rows give, as timm's loader assumes). A tree
  without one (a relative position MLP gives any grid's bias) comes back
  as it is; a table already of the new grid is kept."""
  flat = trees.flatten(trees.wrap(variables))
  keys = [k for k in flat if k.endswith("/rel_pos_bias/table")]
  if not keys:
    return variables
  if patch_size is None:
    patch_size = trees.patch_size_of(trees.unflatten(flat))
  h, w = models.pair(image_size)
  new = (h // patch_size, w // patch_size)
  cls = "params/cls" in flat
  for k in keys:
    table = flat[k]
    if np.shape(table)[0] != relpos.table_rows(new, cls):
      flat[k] = relpos.resize_table(table, new, old_grid, cls)
  out = trees.unflatten(flat)
  return out if "params" in variables else out["params"]


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


# --------------------------------------------------------------------------- #
# Patch embedding (FlexiViT).
# --------------------------------------------------------------------------- #


def resample_patch_embed(kernel, new_patch_size) -> np.ndarray:
  """FlexiViT's pseudo-inverse resampling of a (P, P, C, D) patch-embedding
  kernel to ``new_patch_size`` (an int or (height, width)).

  With ``B`` the (P'*P', P*P) matrix of resizing a P x P patch to P' x P'
  (antialiased bicubic, as timm), the new kernel is ``pinv(B).T @ w``: the
  kernel whose response to a resized patch best matches the old kernel's
  response to the patch (exact when upsampling). The same numbers as
  ``timm.layers.resample_patch_embed`` on timm's (D, C, P, P) layout (timm
  computes in float32, this in float64; the result has the kernel's dtype).
  """
  kernel = np.asarray(kernel)
  if kernel.ndim != 4:
    raise ValueError(f"Expected a patch-embedding kernel of shape (P, P, "
                     f"channels, width) (our layout), got {kernel.shape}")
  ph, pw = kernel.shape[:2]
  nh, nw = models.pair(new_patch_size)
  if min(nh, nw) < 1:
    raise ValueError(f"new_patch_size={new_patch_size}: expected positive "
                     f"sizes")
  if (nh, nw) == (ph, pw):
    return kernel
  # Resizing a patch (row-major pixels) is the Kronecker product of the two
  # per-axis matrices; its pseudo-inverse maps the kernel.
  resize = np.kron(interpolate.aa_bicubic_matrix(ph, nh),
                   interpolate.aa_bicubic_matrix(pw, nw))  # (nh*nw, ph*pw)
  w = kernel.astype(np.float64).reshape(ph * pw, -1)
  new = np.linalg.pinv(resize).T @ w
  return new.reshape(nh, nw, *kernel.shape[2:]).astype(kernel.dtype)


def resize_patch_embed(variables, new_patch_size: int):
  """Returns ``variables`` with ``embedding/kernel`` resampled to
  ``new_patch_size`` (:func:`resample_patch_embed`; the bias is kept)."""
  is_wrapped = "params" in variables
  params = dict(trees.params_of(variables))
  emb = dict(params["embedding"])
  emb["kernel"] = resample_patch_embed(emb["kernel"], new_patch_size)
  params["embedding"] = emb
  return dict(variables, params=params) if is_wrapped else params
