"""Running a loaded ViT on image files: decoding, batching, probabilities.

Loading is :func:`vit_jax.weights.load` (re-exported here as :func:`load`):
any checkpoint, with the preprocessing its weights expect.
"""

from __future__ import annotations

import os
from typing import Callable, List, Sequence

import numpy as np

from vit_jax.data.preprocessing import preprocess_pil  # noqa: F401
from vit_jax.weights import (  # noqa: F401  (the loader, re-exported)
    SUPPORTED, CheckpointError, Loaded, load)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif",
                    ".tiff", ".ppm", ".pgm")


class ImageError(ValueError):
  """An image file that cannot be read or decoded."""


# --------------------------------------------------------------------------- #
# Images.
# --------------------------------------------------------------------------- #


def read_image(path: str) -> np.ndarray:
  """Decodes an image file (JPEG, PNG, ...) to uint8 RGB (H, W, 3)."""
  from PIL import Image, UnidentifiedImageError  # pylint: disable=import-outside-toplevel

  if not os.path.exists(path):
    raise ImageError(f"{path}: no such file")
  if os.path.isdir(path):
    raise ImageError(f"{path}: is a directory, not an image")
  try:
    with Image.open(path) as im:
      im.load()
      return np.asarray(im.convert("RGB"), dtype=np.uint8)
  except UnidentifiedImageError:
    raise ImageError(f"{path}: not an image PIL can decode (expected JPEG, "
                     f"PNG, BMP, GIF, WebP, TIFF...)") from None
  except (OSError, SyntaxError, ValueError) as e:
    raise ImageError(f"{path}: cannot decode the image ({e}); is the file "
                     f"truncated or corrupt?") from None


def expand_image_paths(paths: Sequence[str]) -> List[str]:
  """Files as given; directories expand to their image files (sorted)."""
  out = []
  for p in paths:
    if os.path.isdir(p):
      found = sorted(os.path.join(p, n) for n in os.listdir(p)
                     if n.lower().endswith(IMAGE_EXTENSIONS))
      out.extend(found if found else [p])  # an empty dir reports an error
    else:
      out.append(p)
  return out


# --------------------------------------------------------------------------- #
# Running.
# --------------------------------------------------------------------------- #


def make_probabilities_fn(model) -> Callable:
  """jit(variables, images) -> softmax probabilities (float32)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  @jax.jit
  def fn(variables, images):
    logits = model.apply(variables, images, train=False)
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)

  return fn


def run_batches(fn, variables, images: np.ndarray, batch_size: int) -> np.ndarray:
  """Applies ``fn`` to ``images`` (N, H, W, 3) in batches of one fixed
  shape (the last one padded), so it compiles once."""
  n = len(images)
  if n == 0:
    return np.zeros((0,), np.float32)
  b = max(1, min(int(batch_size), n))
  outs = []
  for start in range(0, n, b):
    chunk = images[start:start + b]
    k = len(chunk)
    if k < b:
      chunk = np.concatenate([chunk, np.zeros((b - k,) + chunk.shape[1:],
                                              chunk.dtype)])
    outs.append(np.asarray(fn(variables, chunk))[:k])
  return np.concatenate(outs)
