"""What every exporter shares, at the bottom of the export room: the error
and the images an artifact takes. Nothing here imports the rest of
:mod:`vit_jax.export`."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

FORMATS = ("stablehlo", "savedmodel", "onnx")
DTYPES = ("float32", "bfloat16")


class ExportError(ValueError):
  """A model, option or artifact that cannot be exported or served."""


@dataclasses.dataclass(frozen=True)
class InputSpec:
  """The images an artifact takes; ``None`` in ``shape`` is dynamic."""

  shape: tuple
  dtype: str

  def describe(self) -> str:
    names = ("batch", "height", "width")
    dims = [names[i] if d is None else str(d) for i, d in enumerate(self.shape)]
    return f"{self.dtype} ({', '.join(dims)})"

  def jax(self):
    import jax  # pylint: disable=import-outside-toplevel
    names = ("b", "h", "w")
    dims = [names[i] if d is None else str(d) for i, d in enumerate(self.shape)]
    return jax.ShapeDtypeStruct(jax.export.symbolic_shape(", ".join(dims)),
                                np.dtype(self.dtype))

  def check(self, images, what: str = "The artifact"):
    """Raises ExportError unless ``images`` fits this spec."""
    shape, dtype = tuple(np.shape(images)), np.dtype(images.dtype)
    ok = len(shape) == 4 and all(
        want is None or want == got for want, got in zip(self.shape, shape))
    if ok and 0 not in shape and dtype == np.dtype(self.dtype):
      return
    hint = ""
    if len(shape) == 4 and shape[1] == 3 and shape[-1] != 3:
      hint = " It looks like NCHW; transpose with images.transpose(0, 2, 3, 1)."
    raise ExportError(f"{what} takes {self.describe()} NHWC images, got "
                      f"{dtype} {shape}.{hint}")
