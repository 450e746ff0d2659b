"""Image files a user hands the tools: decoded to uint8 RGB with PIL (a
clear error per file that cannot be read), directories expanded."""

from __future__ import annotations

import os
from typing import List, Sequence

import numpy as np

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif",
                    ".tiff", ".ppm", ".pgm")


class ImageError(ValueError):
  """An image file that cannot be read or decoded."""


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


def missing(paths: Sequence[str]) -> List[str]:
  """The error of each path that names no file (checked before a model is
  loaded, so a mistyped path is reported at once)."""
  return [f"{p}: no such file" for p in paths if not os.path.exists(p)]
