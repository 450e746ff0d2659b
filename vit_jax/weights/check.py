"""The one checker of keys and shapes, with one error format.

The schema is the model's own tree: ``jax.eval_shape(model.init)`` gives
every variable's path and shape without computing anything. Weights in our
layout are compared with it directly; weights in another library's layout
are compared with it mapped through that layout's table
(:mod:`vit_jax.weights.layouts`), so errors name *their* keys.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence, Tuple

import numpy as np

from vit_jax.weights import trees

Shapes = Mapping[str, Tuple[int, ...]]
_SHOWN = 20


def check_keys(have: Shapes, want: Shapes, what: str) -> None:
  """Raises one ValueError listing every missing, unexpected and mis-shaped
  key by name (``have`` and ``want`` map names to shapes)."""
  missing = [k for k in want if k not in have]
  unexpected = [k for k in have if k not in want]
  misshaped = [f"{k}: expected {tuple(want[k])}, got {tuple(have[k])}"
               for k in want if k in have and tuple(have[k]) != tuple(want[k])]
  if not (missing or unexpected or misshaped):
    return
  lines = [f"Weights do not match {what}:"]
  for title, items in (("missing keys", missing),
                       ("unexpected keys", unexpected),
                       ("mis-shaped keys", misshaped)):
    if items:
      shown = items[:_SHOWN] + ([f"... and {len(items) - _SHOWN} more"]
                                if len(items) > _SHOWN else [])
      lines.append(f"  {title} ({len(items)}):")
      lines += [f"    {s}" for s in shown]
  raise ValueError("\n".join(lines))


def shapes(flat: Mapping[str, object]) -> dict:
  return {k: tuple(np.shape(v)) for k, v in flat.items()}


def expected(model, image_size=None) -> dict:
  """Flat ``{path: shape}`` of every variable ``model`` has (per-layer
  layout), for square ``image_size`` inputs (default: the model's own, or
  224). Nothing is computed; one block is traced (the model with
  ``num_layers=1``, 2-5x quicker to trace than a scan of the blocks) and
  its shapes laid out for every layer, so a 40-block model checks as fast
  as a 1-block one."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from vit_jax import models  # pylint: disable=import-outside-toplevel

  h, w = models.pair(image_size or model.image_size or 224)
  x = jax.ShapeDtypeStruct((1, h, w, model.num_channels), jnp.float32)
  # SAM's windowed and global blocks differ: traced one by one.
  one = not (model.window_size or model.rel_pos) and model.num_layers > 1
  ref = model.clone(scan_layers=False, remat_policy=None,
                    **({"num_layers": 1} if one else {}))
  if model.image_size is not None and not model.dynamic_img_size:
    ref = ref.clone(image_size=(h, w))
  tree = jax.eval_shape(lambda x: ref.init(jax.random.key(0), x, train=False),
                        x)
  tree = {k: v for k, v in tree.items() if k != "intermediates"}
  flat = {k: tuple(v.shape) for k, v in trees.flatten(tree).items()}
  if not one:
    return flat
  freqs = "params/Transformer/rope_freqs"  # RoPE-Mixed's: one per layer
  if freqs in flat:
    flat[freqs] = flat[freqs][:1] + (model.num_layers,) + flat[freqs][2:]
  first = "/Transformer/encoderblock_0/"
  result, done = {}, False
  for k, shape in flat.items():
    if first not in k:
      result[k] = shape
    elif not done:  # every layer's, in the first one's place
      done = True
      block = [(b, s) for b, s in flat.items() if first in b]
      for i in range(model.num_layers):
        for b, s in block:
          result[b.replace(first, f"/Transformer/encoderblock_{i}/")] = s
  return result


def check(model, variables, image_size=None,
          what: Optional[str] = None) -> None:
  """Checks ``variables`` (our layout, per-layer or scanned) against what
  ``model`` needs at ``image_size``; raises naming every difference."""
  have = shapes(trees.flatten(trees.wrap(trees.unstack_layers(
      trees.wrap(variables)))))
  check_keys(have, expected(model, image_size),
             what or "the model they are loaded into")


def only(flat: Mapping[str, object], collections: Sequence[str]) -> dict:
  """The entries of a flat tree in the given collections."""
  return {k: v for k, v in flat.items() if k.split("/", 1)[0] in collections}
