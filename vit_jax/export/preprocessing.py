"""The preprocessing inside an exported artifact (``--with-preprocessing``).

uint8 ``(batch, H, W, 3)`` images of any size -> the float32 ``(batch, S, S,
3)`` normalised crops ``model.apply`` takes, as torchvision's ``Resize(size)
-> CenterCrop(crop)`` (the geometry of ``vit_jax.predict``'s PIL path), in a
static-shape program: the resize and the crop are one antialiased resampling
of the input straight into the crop, whose two weight matrices ``(H, S)``
and ``(W, S)`` are computed inside the program from H and W. The distances
between output and input pixels are exact integer ratios, so every runtime
(XLA in JAX and TensorFlow, onnxruntime) computes the same weights to float32
rounding.

One code, :func:`preprocess_with`, runs in any array namespace: JAX here
(:func:`preprocess`, exported by ``jax.export`` for StableHLO and
SavedModel), torch in :mod:`vit_jax.export.onnx` (exported by
``torch.onnx.export``).

Against PIL: the same geometry and filters (bilinear = triangle, bicubic =
Keys a=-0.5, lanczos = Lanczos-3, stretched when shrinking), but one float
resampling clipped to [0, 255], where PIL resamples in two passes and rounds
(and clips) to uint8 after each; rounding here would make an artifact's
output jump between runtimes at ties. docs/export.md has the measured
difference.
"""

from __future__ import annotations

import numpy as np


def crop_geometry(height, width, pre, xp=np):
  """torchvision's ``Resize(size) -> CenterCrop(crop)`` geometry in integer
  arithmetic (``height``/``width``: ints or 0-d integer arrays, traced or
  symbolic): the resized ``(new_h, new_w)`` (short side ``size``, long side
  truncated as ``int()``) and the crop's ``(top, left)`` (``round((new -
  crop) / 2)``, half to even, as Python's ``round``)."""
  c = int(pre.crop_size)
  size = max(int(pre.resize_size), c)
  new_h = xp.maximum(size, size * height // width)
  new_w = xp.maximum(size, size * width // height)

  def offset(n):
    d = n - c
    k = d // 2
    return k + (d % 2) * (k % 2)

  return new_h, new_w, offset(new_h), offset(new_w)


def resize_method(pre) -> str:
  interp = str(pre.interpolation).lower()
  if interp not in RESIZE_KERNELS:
    from vit_jax.export.types import ExportError  # pylint: disable=import-outside-toplevel
    raise ExportError(f"The exported preprocessing supports interpolation "
                      f"{sorted(RESIZE_KERNELS)}, not {pre.interpolation!r}.")
  return interp


# Filters (PIL's BILINEAR, BICUBIC, LANCZOS; jax.image's linear, cubic,
# lanczos3) of a distance x >= 0 in input pixels, written for any array
# namespace ``xp`` (JAX here, torch in vit_jax.export.onnx).
def _triangle(xp, x):
  return xp.relu(1.0 - x)


def _keys_cubic(xp, x):  # a = -0.5
  out = ((1.5 * x - 2.5) * x) * x + 1.0
  out = xp.where(x >= 1.0, ((-0.5 * x + 2.5) * x - 4.0) * x + 2.0, out)
  return xp.where(x >= 2.0, 0.0 * x, out)


def _lanczos3(xp, x):
  r = 3.0
  y = r * xp.sin(np.pi * x) * xp.sin(np.pi * x / r)
  safe = xp.where(x > 1e-3, x, 1.0 + 0.0 * x)
  out = xp.where(x > 1e-3, y / (np.pi ** 2 * safe * safe), 1.0 + 0.0 * x)
  return xp.where(x > r, 0.0 * x, out)


RESIZE_KERNELS = {"bilinear": _triangle, "bicubic": _keys_cubic,
                  "lanczos": _lanczos3}


def resample_weights(xp, n, n_arr, new, offset, out: int, kernel):
  """``(n, out)`` weights taking ``n`` input pixels to the ``out`` pixels
  starting at ``offset`` of the input resized to ``new`` pixels, with the
  antialiased ``kernel`` (stretched by ``n / new`` when shrinking), each
  column normalised to sum 1: ``jax.image.scale_and_translate``'s weights
  (and PIL's), with the distances computed exactly in integers.

  Output pixel i samples the input at ``s = (i + offset + 1/2) n / new -
  1/2``; input pixel j's distance, in kernel units, is ``|s - j| / max(n /
  new, 1) = |(2 (i + offset) + 1) n - (2 j + 1) new| / (2 max(n, new))``.
  """
  i = xp.arange(out)[None, :]
  j = xp.arange(n)[:, None]
  num = (2 * (i + offset) + 1) * n_arr - (2 * j + 1) * new
  x = xp.to_f32(xp.abs(num)) / xp.to_f32(2 * xp.maximum(n_arr, new))
  weights = kernel(xp, x)
  return weights / xp.sum0(weights)


def preprocess_with(xp, images, pre, mean, std):
  """:func:`preprocess` in the array namespace ``xp`` (see ``_JaxOps``)."""
  _, h, w, _ = images.shape
  c = int(pre.crop_size)
  kernel = RESIZE_KERNELS[resize_method(pre)]
  hs, ws = xp.scalar(h), xp.scalar(w)
  new_h, new_w, top, left = crop_geometry(hs, ws, pre, xp)
  wh = resample_weights(xp, h, hs, new_h, top, c, kernel)
  ww = resample_weights(xp, w, ws, new_w, left, c, kernel)
  x = xp.einsum("bhwc,ho->bowc", xp.to_f32(images), wh)
  x = xp.einsum("bowc,wp->bopc", x, ww)
  x = xp.clip(x, 0.0, 255.0) / 255.0
  return (x - mean) / std


class _JaxOps:
  """The few array operations :func:`preprocess_with` needs, in JAX."""

  def __init__(self):
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    self.jnp, self.hi = jnp, jax.lax.Precision.HIGHEST
    self.abs, self.maximum, self.where, self.sin = (
        jnp.abs, jnp.maximum, jnp.where, jnp.sin)

  def arange(self, n):
    return self.jnp.arange(n, dtype=self.jnp.int32)

  def scalar(self, n):
    return self.jnp.asarray(n, self.jnp.int32)

  def to_f32(self, x):
    return x.astype(self.jnp.float32)

  def relu(self, x):
    return self.jnp.maximum(x, 0.0)

  def sum0(self, x):
    return self.jnp.sum(x, axis=0, keepdims=True)

  def clip(self, x, lo, hi):
    return self.jnp.clip(x, lo, hi)

  def einsum(self, spec, a, b):
    return self.jnp.einsum(spec, a, b, precision=self.hi)


def preprocess(images, pre):
  """uint8 ``(batch, H, W, 3)`` -> float32 ``(batch, S, S, 3)``, normalised.

  Resize the short side and center crop (:func:`crop_geometry`) as one
  antialiased resampling of the input straight into the crop, so that any
  H, W give the crop's fixed shape (:func:`resample_weights`: two weight
  matrices computed from H and W), clip to [0, 255], scale to [0, 1],
  normalise with the weights' mean and std.
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from vit_jax.export.types import ExportError  # pylint: disable=import-outside-toplevel
  shape = tuple(images.shape)
  if len(shape) != 4 or shape[-1] != 3 or images.dtype != jnp.uint8:
    hint = (" It looks like NCHW; transpose with images.transpose(0, 2, 3, 1)."
            if len(shape) == 4 and shape[1] == 3 and shape[-1] != 3 else
            " Add the batch axis: images[None]." if len(shape) == 3 else "")
    raise ExportError(
        f"The preprocessing takes decoded RGB images as uint8 (batch, height, "
        f"width, 3), values 0-255; got {images.dtype} {shape}.{hint}")
  return preprocess_with(_JaxOps(), images, pre,
                         jnp.asarray(pre.mean, jnp.float32),
                         jnp.asarray(pre.std, jnp.float32))
