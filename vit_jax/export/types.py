"""What every exporter shares, at the bottom of the export room: the error
and the images an artifact takes. Nothing here imports the rest of
:mod:`vit_jax.export`."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

FORMATS = ("stablehlo", "savedmodel", "onnx")
DTYPES = ("float32", "bfloat16")
# What an artifact returns: the logits, or forward_features (the tokens
# after the final norm; SAM's neck's (B, h, w, C) map).
OUTPUTS = ("logits", "features")


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


@dataclasses.dataclass(frozen=True)
class NaFlexInputSpec:
  """The NaFlex dict a NaFlex model's artifact takes (``patches`` (B, N,
  P*P*C) float32, ``patch_coord`` (B, N, 2) int32, ``patch_valid`` (B, N)
  bool); ``None`` for ``batch`` / ``seq_len`` is dynamic (symbolic)."""

  batch: Optional[int]
  seq_len: Optional[int]
  patch_dim: int

  def describe(self) -> str:
    b = "batch" if self.batch is None else str(self.batch)
    n = "seq_len" if self.seq_len is None else str(self.seq_len)
    return (f"NaFlex dict: patches float32 ({b}, {n}, {self.patch_dim}), "
            f"patch_coord int32 ({b}, {n}, 2), patch_valid bool ({b}, {n})")

  def jax(self):
    import jax  # pylint: disable=import-outside-toplevel
    b, n = jax.export.symbolic_shape(
        f"{'b' if self.batch is None else self.batch}, "
        f"{'n' if self.seq_len is None else self.seq_len}")
    return {"patches": jax.ShapeDtypeStruct((b, n, self.patch_dim),
                                            np.float32),
            "patch_coord": jax.ShapeDtypeStruct((b, n, 2), np.int32),
            "patch_valid": jax.ShapeDtypeStruct((b, n), np.bool_)}

  def check(self, inputs, what: str = "The artifact"):
    """Raises ExportError unless ``inputs`` fits this spec; returns them
    with the spec's dtypes."""
    keys = ("patches", "patch_coord", "patch_valid")
    if not isinstance(inputs, dict) or sorted(inputs) != sorted(keys):
      raise ExportError(f"{what} takes a {self.describe()}; got "
                        f"{type(inputs).__name__}"
                        + (f" with keys {sorted(inputs)}"
                           if isinstance(inputs, dict) else ""))
    p = np.asarray(inputs["patches"])
    c, v = np.asarray(inputs["patch_coord"]), np.asarray(inputs["patch_valid"])
    b, n = p.shape[:2] if p.ndim == 3 else (None, None)
    ok = (p.ndim == 3 and p.shape[2] == self.patch_dim and
          c.shape == (b, n, 2) and v.shape == (b, n) and
          self.batch in (None, b) and self.seq_len in (None, n) and
          p.dtype == np.float32 and np.issubdtype(c.dtype, np.integer))
    if not ok:
      raise ExportError(f"{what} takes a {self.describe()}; got patches "
                        f"{p.dtype} {p.shape}, patch_coord {c.dtype} "
                        f"{c.shape}, patch_valid {v.dtype} {v.shape}.")
    return {"patches": p, "patch_coord": c.astype(np.int32),
            "patch_valid": v.astype(bool)}
