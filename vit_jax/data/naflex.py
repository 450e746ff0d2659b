"""NaFlex batches on the host (NumPy, PIL): images of any shapes -> the dict
a NaFlex model takes, as timm's NaFlex data pipeline makes it.

    batch = naflex.batch_images([img_a, img_b], patch_size=16,
                                max_seq_len=256, mean=pp.HALF, std=pp.HALF)
    logits = model.apply(variables, batch, train=False)

Each image is resized (PIL, antialiased as timm's eval transform on PIL
images) to the largest size that keeps its aspect ratio and whose patch
grid fits the token budget (:func:`image_size_for_seq`: timm's
``get_image_size_for_seq``, transformers' Siglip2
``get_image_size_for_max_num_patches``), scaled to [0, 1], normalised, cut
into patches in (y, x, channel) order, row-major (:func:`patchify`: timm's
``patchify_image``), and the batch is padded to one length with zero
patches at coordinate (0, 0), marked invalid (:func:`collate`: timm's
``NaFlexCollator``, which pads every batch to ``max_seq_len`` and cuts
longer sequences).

The sequence lengths timm uses: evaluation pads to ``max_seq_len`` (576 by
default: 24 x 24 patches of 16), training draws one of ``(128, 256, 576,
784, 1024)`` per batch (``create_naflex_loader``). A jitted model compiles
once per sequence length, whatever the images' shapes.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from vit_jax.data import preprocessing as pp

KEYS = ("patches", "patch_coord", "patch_valid")
# timm's defaults: evaluation length, training lengths (create_naflex_loader).
EVAL_SEQ_LEN = 576
TRAIN_SEQ_LENS = (128, 256, 576, 784, 1024)


def image_size_for_seq(image_hw: Tuple[int, int], patch_size: int,
                       max_seq_len: int, divisible_by_patch: bool = True,
                       max_ratio: Optional[float] = None, eps: float = 1e-5
                       ) -> Tuple[float, Tuple[int, int]]:
  """``(ratio, (height, width))``: the largest scale of ``image_hw`` whose
  patch grid has at most ``max_seq_len`` patches, by timm's binary search
  (``get_image_size_for_seq``; the same as transformers'
  ``get_image_size_for_max_num_patches``): sides rounded up to whole
  patches, at least one patch each; ``max_ratio`` caps upscaling."""
  if patch_size <= 0 or max_seq_len <= 0:
    raise ValueError(f"patch_size={patch_size}, max_seq_len={max_seq_len}: "
                     f"expected positive values")
  h, w = image_hw
  if h <= 0 or w <= 0:
    raise ValueError(f"image size {h}x{w}: expected a non-empty image")
  p = patch_size

  def target(ratio):
    th, tw = h * ratio, w * ratio
    if divisible_by_patch:
      th, tw = p * math.ceil(th / p), p * math.ceil(tw / p)
    return int(max(th, p)), int(max(tw, p))

  def fits(ratio):
    th, tw = target(ratio)
    return (th // p) * (tw // p) <= max_seq_len

  lb, rb = eps / 10.0, 100.0
  while (rb - lb) >= eps:
    mid = (lb + rb) / 2.0
    if fits(mid):
      lb = mid
    else:
      rb = mid
  ratio = lb if max_ratio is None else min(lb, max_ratio)
  if ratio <= eps:
    raise ValueError(f"image {h}x{w} is too large for {max_seq_len} patches "
                     f"of {p} (timm's search found no scale)")
  if ratio >= 100.0:
    raise ValueError(f"image {h}x{w} is too small for {max_seq_len} patches "
                     f"of {p} (it would be upscaled over 100x)")
  return ratio, target(ratio)


def patchify(image: np.ndarray, patch_size: int
             ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(H, W, C) -> patches (N, P*P*C) in (y, x, channel) order, row-major;
  their (row, column) coordinates (N, 2) int32; all valid (N,) bool. A
  size that is not a multiple of the patch is zero-padded at the bottom
  and right first (timm's ``patchify_image``)."""
  x = np.asarray(image)
  if x.ndim != 3:
    raise ValueError(f"patchify takes one (height, width, channels) image, "
                     f"got shape {x.shape}")
  p = int(patch_size)
  h, w, c = x.shape
  pad_h, pad_w = -h % p, -w % p
  if pad_h or pad_w:
    x = np.pad(x, ((0, pad_h), (0, pad_w), (0, 0)))
  gh, gw = x.shape[0] // p, x.shape[1] // p
  patches = x.reshape(gh, p, gw, p, c).transpose(0, 2, 1, 3, 4).reshape(
      gh * gw, p * p * c)
  ys, xs = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
  coord = np.stack([ys.reshape(-1), xs.reshape(-1)], axis=1).astype(np.int32)
  return patches, coord, np.ones(gh * gw, bool)


def collate(samples: Sequence[Dict[str, np.ndarray]],
            seq_len: Optional[int] = None) -> Dict[str, np.ndarray]:
  """Per-image ``{patches, patch_coord, patch_valid}`` -> one batch padded
  to ``seq_len`` (default: the longest sample): zero patches at (0, 0),
  invalid; longer samples are cut (timm's ``NaFlexCollator``). Patches
  keep their dtype (uint8 pixels, or float32)."""
  if not samples:
    raise ValueError("collate: no samples")
  n = int(seq_len or max(len(s["patches"]) for s in samples))
  first = np.asarray(samples[0]["patches"])
  out = {"patches": np.zeros((len(samples), n, first.shape[-1]), first.dtype),
         "patch_coord": np.zeros((len(samples), n, 2), np.int32),
         "patch_valid": np.zeros((len(samples), n), bool)}
  for i, s in enumerate(samples):
    k = min(len(s["patches"]), n)
    for key in KEYS:
      out[key][i, :k] = np.asarray(s[key])[:k]
  return out


def resize_to_seq(image: np.ndarray, patch_size: int, max_seq_len: int,
                  interpolation: str = "bicubic") -> np.ndarray:
  """One uint8 (H, W, 3) image (:func:`~vit_jax.data.preprocessing.
  check_image`) resized with PIL to :func:`image_size_for_seq` (timm's
  ``ResizeToSequence`` on a PIL image); uint8."""
  from PIL import Image  # pylint: disable=import-outside-toplevel

  x = pp.check_image(image, "resize_to_seq")
  _, (th, tw) = image_size_for_seq(x.shape[:2], patch_size, max_seq_len)
  if (th, tw) == x.shape[:2]:
    return x
  im = Image.fromarray(x).resize((tw, th), pp.pil_filter(interpolation))
  return np.asarray(im)


def preprocess(image: np.ndarray, pre: pp.Preprocessing, patch_size: int
               ) -> Dict[str, np.ndarray]:
  """One image -> its NaFlex sample (float32 patches, coordinates, valid),
  unpadded: resized to ``pre.max_seq_len`` patches (:func:`resize_to_seq`
  with ``pre.interpolation``), scaled to [0, 1], normalised with
  ``pre.mean`` / ``pre.std``, cut into patches."""
  if not pre.max_seq_len:
    raise ValueError("naflex.preprocess: this Preprocessing has no "
                     "max_seq_len (it is a fixed-size recipe)")
  x = resize_to_seq(image, patch_size, int(pre.max_seq_len),
                    pre.interpolation).astype(np.float32) / 255.0
  x = (x - np.asarray(pre.mean, np.float32)) / np.asarray(pre.std, np.float32)
  patches, coord, valid = patchify(x.astype(np.float32), patch_size)
  return {"patches": patches, "patch_coord": coord, "patch_valid": valid}


def batch_images(images: Sequence[np.ndarray], *, patch_size: int,
                 max_seq_len: int = EVAL_SEQ_LEN, mean=pp.HALF, std=pp.HALF,
                 interpolation: str = "bicubic",
                 seq_len: Optional[int] = None) -> Dict[str, np.ndarray]:
  """Images of any shapes (uint8 (H, W, 3) each) -> one NaFlex batch under a
  budget of ``max_seq_len`` patches per image, padded to ``seq_len``
  (default ``max_seq_len``, as timm's collator; a fixed length compiles
  once). See the module docstring."""
  pre = pp.Preprocessing(interpolation=interpolation, mean=tuple(mean),
                         std=tuple(std), max_seq_len=int(max_seq_len))
  samples = [preprocess(im, pre, patch_size) for im in images]
  return collate(samples, seq_len or max_seq_len)


def from_siglip2(pixel_values, pixel_attention_mask, spatial_shapes
                 ) -> Dict[str, np.ndarray]:
  """transformers' Siglip2 inputs -> the NaFlex dict: ``pixel_values``
  (B, N, P*P*C) are the patches, ``pixel_attention_mask`` (B, N) the valid
  ones, and the first ``h * w`` rows of image ``b`` are its ``spatial_
  shapes[b] = (h, w)`` grid in row-major order (what Siglip2's processor
  makes)."""
  pv = np.asarray(pixel_values, np.float32)
  mask = np.asarray(pixel_attention_mask).astype(bool)
  shapes = np.asarray(spatial_shapes).astype(np.int64)
  b, n = pv.shape[:2]
  coord = np.zeros((b, n, 2), np.int32)
  for i, (h, w) in enumerate(shapes):
    k = min(int(h) * int(w), n)
    idx = np.arange(k)
    coord[i, :k, 0], coord[i, :k, 1] = idx // int(w), idx % int(w)
  return {"patches": pv, "patch_coord": coord, "patch_valid": mask}


def to_siglip2(batch: Dict[str, Any]) -> Tuple[np.ndarray, np.ndarray,
                                                np.ndarray]:
  """The NaFlex dict -> transformers' Siglip2 inputs ``(pixel_values,
  pixel_attention_mask, spatial_shapes)``, for batches whose valid patches
  come first in row-major order (what :func:`collate` makes)."""
  valid = np.asarray(batch["patch_valid"]).astype(bool)
  coord = np.asarray(batch["patch_coord"])
  shapes = np.where(valid[..., None], coord, 0).max(axis=1) + 1
  for i, (h, w) in enumerate(shapes):
    k = int(valid[i].sum())
    if k != h * w or not valid[i, :k].all():
      raise ValueError(f"to_siglip2: image {i}'s valid patches are not its "
                       f"whole {h}x{w} grid first (transformers' Siglip2 "
                       f"places positions by sequence index)")
  return (np.asarray(batch["patches"], np.float32),
          valid.astype(np.int64), shapes.astype(np.int64))


__all__ = ["EVAL_SEQ_LEN", "KEYS", "TRAIN_SEQ_LENS", "batch_images",
           "collate", "from_siglip2", "image_size_for_seq", "patchify",
           "preprocess", "resize_to_seq", "to_siglip2"]
