"""StableHLO: one file of ``jax.export`` bytes, run by
``jax.export.deserialize(open(path, 'rb').read()).call(images)`` in any JAX
program, or by :func:`load_stablehlo`, which checks the input first. A
NaFlex model's artifact takes the NaFlex dict; its sequence length is
symbolic (any length runs the one artifact) unless fixed at export."""

from __future__ import annotations

from typing import Callable

from vit_jax.export.base import Servable, exported
from vit_jax.export.types import InputSpec, NaFlexInputSpec


def export_stablehlo(s: Servable, out: str, **kwargs) -> str:
  data = exported(s, **kwargs).serialize()
  with open(out, "wb") as f:
    f.write(data)
  return out


class StableHLOArtifact:
  """A deserialized StableHLO artifact that checks its input first: images,
  or a NaFlex model's dict (its sequence length symbolic or fixed)."""

  def __init__(self, path: str):
    import jax  # pylint: disable=import-outside-toplevel

    with open(path, "rb") as f:
      self.exported = jax.export.deserialize(bytearray(f.read()))
    static = lambda d: d if isinstance(d, int) else None  # noqa: E731
    args, _ = jax.tree_util.tree_unflatten(self.exported.in_tree,
                                           self.exported.in_avals)
    if isinstance(args[0], dict):  # NaFlex
      shape = args[0]["patches"].shape
      self.spec = NaFlexInputSpec(static(shape[0]), static(shape[1]),
                                  int(shape[2]))
    else:
      aval = args[0]
      self.spec = InputSpec(tuple(static(d) for d in aval.shape),
                            str(aval.dtype))
    self.path = path

  def __call__(self, images):
    checked = self.spec.check(images, f"{self.path}")
    return self.exported.call(images if checked is None else checked)


def load_stablehlo(path: str) -> Callable:
  """The StableHLO artifact at ``path`` as a callable ``images -> logits``.

  Same as ``jax.export.deserialize(open(path, 'rb').read()).call``, with an
  error naming the expected shape and dtype for other inputs.
  """
  return StableHLOArtifact(path)
