"""StableHLO: one file of ``jax.export`` bytes, run by
``jax.export.deserialize(open(path, 'rb').read()).call(images)`` in any JAX
program, or by :func:`load_stablehlo`, which checks the input first."""

from __future__ import annotations

from typing import Callable

from vit_jax.export.base import Servable, exported
from vit_jax.export.types import InputSpec


def export_stablehlo(s: Servable, out: str, **kwargs) -> str:
  data = exported(s, **kwargs).serialize()
  with open(out, "wb") as f:
    f.write(data)
  return out


class StableHLOArtifact:
  """A deserialized StableHLO artifact that checks its input first."""

  def __init__(self, path: str):
    import jax  # pylint: disable=import-outside-toplevel

    with open(path, "rb") as f:
      self.exported = jax.export.deserialize(bytearray(f.read()))
    aval = self.exported.in_avals[0]
    self.spec = InputSpec(
        tuple(d if isinstance(d, int) else None for d in aval.shape),
        str(aval.dtype))
    self.path = path

  def __call__(self, images):
    self.spec.check(images, f"{self.path}")
    return self.exported.call(images)


def load_stablehlo(path: str) -> Callable:
  """The StableHLO artifact at ``path`` as a callable ``images -> logits``.

  Same as ``jax.export.deserialize(open(path, 'rb').read()).call``, with an
  error naming the expected shape and dtype for other inputs.
  """
  return StableHLOArtifact(path)
