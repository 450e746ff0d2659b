"""The model names vit_jax knows, and the one check of a name where it is
typed.

A name is an architecture, ours (``vit_{size}_{patch}``, big_vision's
``B/16``) or one of timm's that the weights layer maps
(:mod:`vit_jax.models._timm_archs`), optionally with a tag that names
released weights (timm's pretrained tags, :mod:`._pretrained_cfgs`;
torchvision's releases under timm-style tags, :data:`TORCHVISION`).
:func:`check_known` refuses any other name, as timm's ``create_model``
refuses an invalid tag, with the close names or the architecture's tags.
The records of the tags (hub repo, preprocessing, labels) are
:mod:`vit_jax.weights.pretrained`'s.
"""

from __future__ import annotations

import difflib
from typing import List

from vit_jax import models
from vit_jax.models import _timm_archs
from vit_jax.weights import _pretrained_cfgs, layouts

# torchvision's released ViT weights, under timm-style tags (the enum's
# preprocessing is read from torchvision when they are loaded).
TORCHVISION = {
    "vit_b_16.tv_in1k": "IMAGENET1K_V1",
    "vit_b_16.tv_swag_e2e_in1k": "IMAGENET1K_SWAG_E2E_V1",
    "vit_b_16.tv_swag_linear_in1k": "IMAGENET1K_SWAG_LINEAR_V1",
    "vit_b_32.tv_in1k": "IMAGENET1K_V1",
    "vit_l_16.tv_in1k": "IMAGENET1K_V1",
    "vit_l_16.tv_swag_e2e_in1k": "IMAGENET1K_SWAG_E2E_V1",
    "vit_l_16.tv_swag_linear_in1k": "IMAGENET1K_SWAG_LINEAR_V1",
    "vit_l_32.tv_in1k": "IMAGENET1K_V1",
    "vit_h_14.tv_swag_e2e_in1k": "IMAGENET1K_SWAG_E2E_V1",
    "vit_h_14.tv_swag_linear_in1k": "IMAGENET1K_SWAG_LINEAR_V1",
}
# Every architecture.tag with released weights, in the tables' order.
TAGGED = tuple(_pretrained_cfgs.PRETRAINED) + tuple(TORCHVISION)


class UnknownName(ValueError):
  """A name that is neither an architecture nor a pretrained tag."""


def architectures() -> List[str]:
  """Every architecture name vit_jax builds from a timm name (and ours)."""
  return sorted(set(_timm_archs.ARCHS) | set(models.VARIANTS))


def is_variant(base: str) -> bool:
  """Ours: ``vit_{size}_{patch}`` or big_vision's ``B/16`` (sizes only)."""
  try:
    models.decode_variant(base)
  except ValueError:
    return False
  return True


def check_known(name: str) -> None:
  """Raises :class:`UnknownName` unless ``name`` is a model name vit_jax
  knows: an architecture (ours, ``vit_b_16`` / ``B/16``, or timm's) with,
  optionally, one of its pretrained tags (``.lvd1689m``), as timm's
  ``create_model`` refuses an invalid tag with or without ``pretrained``.
  The message lists the close names, or the architecture's tags (a timm
  model vit_jax does not compute is a ValueError saying what it is)."""
  name = str(name)
  base, _, tag = name.partition(".")
  known = set(_timm_archs.ARCHS) | {n.split(".", 1)[0] for n in TAGGED}
  if not (base in known or is_variant(base)):
    layouts.refuse_unsupported_timm(name)  # what it is, where vit_jax knows
    close = difflib.get_close_matches(base, architectures(), n=5, cutoff=0.6)
    raise UnknownName(
        f"{name!r} is not a model name vit_jax knows"
        + (f" (did you mean {', '.join(close)}?)" if close else "")
        + "; vit_jax.list_models('*pattern*') lists the architectures, "
          "vit_jax.list_models(pretrained=True) their tags.")
  if tag and name not in TAGGED:
    tags = sorted(n for n in TAGGED if n.startswith(base + "."))
    close = difflib.get_close_matches(name, tags, n=3, cutoff=0.6)
    raise UnknownName(
        f"{name!r}: invalid pretrained tag {tag!r} for {base}"
        + (f" (did you mean {', '.join(close)}?)" if close else "")
        + f"; its tags: {', '.join(tags) or 'none (no released weights)'}.")
