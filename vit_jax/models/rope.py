"""2-D rotary position embeddings (RoPE) of the patch tokens, as timm's.

Three variants, matching ``timm/layers/pos_embed_sincos.py`` to float32
rounding:

* ``'dinov3'`` (``RotaryEmbeddingDinoV3``; DINOv3): patch centres
  ``(i + 0.5 + offset) / size`` per axis mapped to [-1, 1], angles
  ``2 pi c / period`` with periods ``T ** (4k / head_dim)`` (T = 100), the
  *rotate-half* layout (dimension ``j`` pairs with ``j + head_dim / 2``).
* ``'cat'`` (``RotaryEmbeddingCat`` with ``in_pixels=False``; EVA-02,
  Perception Encoder): integer positions ``i + offset``, rescaled onto a
  reference grid (``(i + offset) * ref / size``) when one is given, angles
  ``c / T ** (k / (head_dim / 4))`` (T = 1e4), the *interleaved* layout
  (dimensions ``2k`` and ``2k + 1`` pair up).

* ``'mixed'`` (``RotaryEmbeddingMixed``; Naver's RoPE-Mixed, rope-vit):
  learned frequencies, a (2, depth, heads, head_dim / 2) parameter (timm's
  ``rope.freqs``): block ``l``'s head ``h`` rotates pair ``k`` by
  ``c0 f[0, l, h, k] + c1 f[1, l, h, k]`` over integer positions ``c``
  (no offset, no reference grid), interleaved; initialised as timm's
  ``init_random_2d_freqs`` (magnitudes ``1 / T ** (4k / head_dim)``,
  T = 10, turned by a random angle per block and head). The tables are
  built from the parameter on every forward pass, one per block.

For 'dinov3' and 'cat' the first quarter-head of frequencies rotates by
the first coordinate channel (y for ``indexing='ij'``, x for ``'xy'``) and
the second by the other; patches are in row-major order. The prefix tokens (class
token, registers) are not rotated: their rows are the identity (cos 1,
sin 0), which leaves them exactly as they are.

The tables depend only on the patch grid, so they are numpy constants built
at trace time (any input size, ``dynamic_img_size`` included). DINOv3's
train-time coordinate augmentations (a random shift, per-axis jitter and a
shared rescale, one draw per forward pass as timm) are computed in JAX from
a key.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("dinov3", "cat", "mixed")
# The base of the frequencies when a model does not state it (timm's
# defaults for the variants; 'mixed': of its initial frequencies).
DEFAULT_TEMPERATURE = {"dinov3": 100.0, "cat": 10000.0, "mixed": 10.0}


def _coords(kind: str, grid: Tuple[int, int], offset: float, indexing: str,
            ref_grid: Optional[Tuple[int, int]]) -> np.ndarray:
  """(gh * gw, 2) float32 positions, row-major; channel 0 is y ('ij') or x
  ('xy'), as timm's ``_build_grid``."""
  f32 = np.float32
  sizes, refs = list(grid), (list(ref_grid) if ref_grid else None)
  if indexing == "xy":  # timm swaps the shape and then meshgrids 'xy'
    sizes = sizes[::-1]
    refs = refs[::-1] if refs else None
  if kind == "dinov3":  # centred, each axis normalised by its own size
    t = [(np.arange(0.5, s, dtype=f32) + f32(offset)) / f32(s) for s in sizes]
  else:
    t = [np.arange(s).astype(f32) + f32(offset) for s in sizes]
    if refs:  # EVA's rescale onto the pretraining grid
      t = [x / f32(s) * f32(r) for x, s, r in zip(t, sizes, refs)]
  mesh = np.stack(np.meshgrid(t[0], t[1], indexing=indexing), axis=-1)
  if kind == "dinov3":
    mesh = f32(2.0) * mesh - f32(1.0)
  return mesh.reshape(-1, 2).astype(f32)


def _frequencies(kind: str, head_dim: int, temperature: float) -> np.ndarray:
  """(head_dim // 4,) float32: DINOv3's periods, or the 'cat' bands."""
  f32 = np.float32
  d4 = head_dim // 4
  if kind == "dinov3":
    exponents = f32(2.0) * np.arange(d4, dtype=f32) / f32(head_dim // 2)
    return (f32(temperature) ** exponents).astype(f32)
  exponents = np.arange(d4).astype(f32) / f32(d4)
  return (f32(1.0) / (f32(temperature) ** exponents)).astype(f32)


def _angles(kind: str, coords, freqs, xp):
  """(N, 2) coordinates -> (N, head_dim // 2) angles, channel-major."""
  c = coords[:, :, None]
  if kind == "dinov3":
    ang = xp.float32(2 * math.pi) * c / freqs[None, None, :]
  else:
    ang = c * freqs[None, None, :]
  return ang.reshape(ang.shape[0], -1)


def _layout(x, kind: str, xp):
  """Per-frequency values (N, hd/2) -> (N, hd): ``[f0..f_{n-1}, f0..]``
  (rotate-half, DINOv3) or ``[f0, f0, f1, f1, ...]`` (interleaved)."""
  if kind == "dinov3":
    return xp.concatenate([x, x], axis=-1)
  return xp.repeat(x, 2, axis=-1)


def sincos(kind: str, grid: Tuple[int, int], head_dim: int, *,
           num_prefix_tokens: int = 0, temperature: Optional[float] = None,
           offset: float = 0.0, indexing: str = "ij",
           ref_grid: Optional[Tuple[int, int]] = None,
           augment: Optional[dict] = None, key=None):
  """``(sin, cos)``, each (prefix + gh * gw, head_dim) float32: numpy
  constants, or JAX arrays when ``augment`` (``{'shift', 'jitter',
  'rescale'}``, timm's ``*_coords``) is given with a ``key``.

  The ``num_prefix_tokens`` leading rows are the identity (sin 0, cos 1).
  """
  check(kind, head_dim, indexing)
  if kind == "mixed":
    raise ValueError("rope='mixed': its tables come from its learned "
                     "frequencies (positions() and mixed_sincos())")
  temperature = DEFAULT_TEMPERATURE[kind] if temperature is None else temperature
  coords = _coords(kind, tuple(grid), offset, indexing, ref_grid)
  freqs = _frequencies(kind, head_dim, temperature)
  xp = np
  if augment and any(v is not None for v in augment.values()):
    coords = augment_coords(jnp.asarray(coords), key, **augment)
    freqs, xp = jnp.asarray(freqs), jnp
  ang = _angles(kind, coords, freqs, xp)
  sin = _layout(xp.sin(ang), kind, xp).astype(np.float32)
  cos = _layout(xp.cos(ang), kind, xp).astype(np.float32)
  if num_prefix_tokens:
    zeros = xp.zeros((num_prefix_tokens, head_dim), np.float32)
    sin = xp.concatenate([zeros, sin], axis=0)
    cos = xp.concatenate([zeros + 1, cos], axis=0)
  return sin, cos


def positions(grid: Tuple[int, int], *, num_prefix_tokens: int = 0,
              indexing: str = "ij", augment: Optional[dict] = None,
              key=None):
  """The token positions of ``'mixed'``: (prefix + gh * gw, 2) float32,
  integer patch positions row-major (channel 0 y for ``'ij'``, x for
  ``'xy'``; timm's ``get_mixed_grid``), the prefix rows zero (angle 0:
  the identity). Train-time ``augment`` as :func:`sincos`."""
  coords = _coords("cat", tuple(grid), 0.0, indexing, None)
  xp = np
  if augment and any(v is not None for v in augment.values()):
    coords, xp = augment_coords(jnp.asarray(coords), key, **augment), jnp
  if num_prefix_tokens:
    coords = xp.concatenate(
        [xp.zeros((num_prefix_tokens, 2), np.float32), coords], axis=0)
  return coords


def mixed_init(temperature: Optional[float] = None):
  """The initializer of ``'mixed'``'s frequencies (2, depth, heads,
  head_dim // 2), as timm's ``init_random_2d_freqs``: magnitudes
  ``1 / T ** (4k / head_dim)``, each block's head turned by its own random
  angle a, the x frequencies ``[m cos a, m cos(a + pi/2)]``, the y ones
  ``[m sin a, m sin(a + pi/2)]``."""
  t = DEFAULT_TEMPERATURE["mixed"] if temperature is None else temperature

  def init(key, shape, dtype=jnp.float32):
    _, depth, heads, half = shape
    head_dim = 2 * half
    mag = 1.0 / (jnp.float32(t) ** (
        jnp.arange(0, head_dim, 4, dtype=jnp.float32) / head_dim))
    angles = jax.random.uniform(key, (depth, heads, 1), jnp.float32,
                                0.0, 2 * math.pi)
    fx = jnp.concatenate([mag * jnp.cos(angles),
                          mag * jnp.cos(angles + math.pi / 2)], axis=-1)
    fy = jnp.concatenate([mag * jnp.sin(angles),
                          mag * jnp.sin(angles + math.pi / 2)], axis=-1)
    return jnp.stack([fx, fy], axis=0).astype(dtype)
  return init


def mixed_sincos(coords, freqs):
  """``'mixed'``'s tables from the positions (T, 2) and the frequencies
  (2, depth, heads, head_dim // 2): ``(sin, cos)``, each (depth, T, heads,
  head_dim) float32, interleaved (timm's ``get_mixed_freqs``: the angle
  ``c0 f0 + c1 f1`` in float32)."""
  f = jnp.asarray(freqs, jnp.float32)
  c = jnp.asarray(coords, jnp.float32)
  ang = (c[None, :, 0, None, None] * f[0][:, None]
         + c[None, :, 1, None, None] * f[1][:, None])  # (L, T, H, hd/2)
  return (_layout(jnp.sin(ang), "mixed", jnp),
          _layout(jnp.cos(ang), "mixed", jnp))


def augment_coords(coords, key, shift: Optional[float] = None,
                   jitter: Optional[float] = None,
                   rescale: Optional[float] = None):
  """timm's ``_apply_coord_augs`` (DINOv3's order): ``c + U(-s, s)`` per
  axis, ``* exp(U(-log J, log J))`` per axis, ``* exp(U(-log R, log R))``
  shared; one draw for the whole batch."""
  k_shift, k_jitter, k_rescale = jax.random.split(key, 3)
  if shift is not None:
    coords = coords + jax.random.uniform(k_shift, (2,), jnp.float32,
                                         -shift, shift)[None, :]
  if jitter is not None:
    m = math.log(jitter)
    coords = coords * jnp.exp(jax.random.uniform(k_jitter, (2,), jnp.float32,
                                                 -m, m))[None, :]
  if rescale is not None:
    m = math.log(rescale)
    coords = coords * jnp.exp(jax.random.uniform(k_rescale, (1,), jnp.float32,
                                                 -m, m))
  return coords


def rotate(x, kind: str):
  """The rotation partner of every dimension: rotate-half
  ``[-x2, x1]`` (DINOv3) or interleaved ``[-x1, x0, -x3, x2, ...]``."""
  if kind == "dinov3":
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  pairs = jnp.stack([-x[..., 1::2], x[..., 0::2]], axis=-1)
  return pairs.reshape(x.shape)


def apply(x, sin, cos, kind: str):
  """Rotates ``x`` (B, T, heads, head_dim) by the (T, head_dim) tables
  (or ``'mixed'``'s per-head (T, heads, head_dim)): ``x cos + rotate(x)
  sin`` in float32 (timm promotes to the tables' float32), returned in x's
  dtype."""
  xf = x.astype(jnp.float32)
  s, c = (jnp.asarray(t, jnp.float32) for t in (sin, cos))
  s, c = ((t[None] if t.ndim == 3 else t[None, :, None, :]) for t in (s, c))
  return (xf * c + rotate(xf, kind) * s).astype(x.dtype)


def check(kind: str, head_dim: int, indexing: str = "ij") -> None:
  """Raises a clear error for an unknown variant or an unusable head."""
  if kind not in KINDS:
    raise ValueError(f"rope={kind!r}: expected None or one of {KINDS} "
                     f"(DINOv3's, EVA-02 / Perception Encoder's, or "
                     f"RoPE-Mixed's learned frequencies)")
  if head_dim % 4:
    raise ValueError(f"rope={kind!r} needs a head width divisible by 4 (two "
                     f"axes x sin/cos pairs), got {head_dim}")
  if indexing not in ("ij", "xy"):
    raise ValueError(f"rope_grid_indexing={indexing!r}: expected 'ij' (the "
                     f"first frequencies rotate by y) or 'xy' (by x)")
