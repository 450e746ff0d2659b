"""Class names for predictions: ImageNet-1k's, or a label file's.

``imagenet_categories()`` returns the copy of torchvision's
``_IMAGENET_CATEGORIES`` (the ``categories`` of its weights' meta) generated
in :mod:`vit_jax.data._imagenet_categories`: looking them up needs no torchvision
(whose import crashes a process that imported TensorFlow first). A test keeps
the copy equal to torchvision's. Regenerate it with::

    python -m vit_jax.data.labels --write
"""

from __future__ import annotations

import json
import os
import sys
from typing import List, Optional, Sequence

IMAGENET_NUM_CLASSES = 1000
_GENERATED = os.path.join(os.path.dirname(__file__), "_imagenet_categories.py")


def imagenet_categories() -> List[str]:
  """The 1000 ImageNet-1k class names in index order (torchvision's, which
  is also tfds ``imagenet2012``'s: sorted WordNet ids)."""
  from vit_jax.data._imagenet_categories import CATEGORIES  # pylint: disable=import-outside-toplevel
  return list(CATEGORIES)


def read_label_file(path: str) -> List[str]:
  """One class name per line (blank lines kept as empty names), or a JSON
  list of strings."""
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except OSError as e:
    raise FileNotFoundError(f"Cannot read the label file {path!r}: {e}") from None
  if text.lstrip().startswith("["):
    names = json.loads(text)
    if not all(isinstance(n, str) for n in names):
      raise ValueError(f"{path!r}: expected a JSON list of strings")
    return names
  return text.rstrip("\n").split("\n")


def check_labels(names: Optional[Sequence[str]], num_classes: int,
                 what: str) -> Optional[List[str]]:
  """``names`` if there is one per class, else a ValueError saying so."""
  if names is None:
    return None
  if len(names) != num_classes:
    raise ValueError(f"{what} has {len(names)} class names but the model "
                     f"has {num_classes} classes.")
  return list(names)


def default_labels(num_classes: int, *, imagenet: bool) -> Optional[List[str]]:
  """ImageNet-1k names for 1000-class ImageNet weights, else None."""
  if imagenet and num_classes == IMAGENET_NUM_CLASSES:
    return imagenet_categories()
  return None


def _generated_source(categories: Sequence[str]) -> str:
  body = "\n".join(f"    {json.dumps(c)}," for c in categories)
  return (
      '"""ImageNet-1k class names, in torchvision\'s (= tfds imagenet2012\'s) '
      'order.\n\nGenerated from ``torchvision.models._meta._IMAGENET_CATEGORIES'
      '`` by\n``python -m vit_jax.data.labels --write``; do not edit. '
      ':func:`vit_jax.data.labels.imagenet_categories` returns it.\n"""\n\nCATEGORIES = (\n' + body + "\n)\n")


def write_generated(path: str = _GENERATED) -> str:
  """(Re)writes :mod:`vit_jax.data._imagenet_categories` from torchvision."""
  from torchvision.models._meta import _IMAGENET_CATEGORIES  # pylint: disable=import-outside-toplevel

  with open(path, "w", encoding="utf-8") as f:
    f.write(_generated_source(_IMAGENET_CATEGORIES))
  return path


if __name__ == "__main__":
  if sys.argv[1:] != ["--write"]:
    sys.exit("usage: python -m vit_jax.data.labels --write")
  print(f"wrote {write_generated()}")
