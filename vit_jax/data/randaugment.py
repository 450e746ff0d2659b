"""RandAugment (Cubuk et al., 2020) in TensorFlow with stateless randomness.

``randaugment(image, num_layers, magnitude, seed)`` applies ``num_layers``
operations drawn uniformly from :data:`OPS`, each at strength
``magnitude / 10`` of its maximum (the paper's scale: 10 is the usual strong
setting, e.g. ``num_layers=2, magnitude=9``; larger values are allowed and
extrapolate). Signed operations (rotate, shear, translate, colour factors)
flip their sign at random. Everything is a function of ``seed``, so the
training stream stays reproducible.
"""

from __future__ import annotations

import math

import tensorflow as tf

_MAX_LEVEL = 10.0


def _blend(a, b, factor):
  """a + factor * (b - a), clipped to uint8 range (factor may exceed 1)."""
  a, b = tf.cast(a, tf.float32), tf.cast(b, tf.float32)
  return tf.cast(tf.clip_by_value(a + factor * (b - a), 0.0, 255.0), tf.uint8)


def _grey(image):
  return tf.image.grayscale_to_rgb(tf.image.rgb_to_grayscale(image))


def _transform(image, matrix):
  """Projective transform (output -> input mapping), grey fill."""
  shape = tf.shape(image)
  out = tf.raw_ops.ImageProjectiveTransformV3(
      images=image[None], transforms=tf.cast(tf.reshape(matrix, [1, 8]),
                                             tf.float32),
      output_shape=shape[:2], fill_value=128.0, interpolation="BILINEAR",
      fill_mode="CONSTANT")
  return out[0]


def _rotate(image, degrees):
  h = tf.cast(tf.shape(image)[0], tf.float32)
  w = tf.cast(tf.shape(image)[1], tf.float32)
  a = degrees * math.pi / 180.0
  cos, sin = tf.cos(a), tf.sin(a)
  cx, cy = (w - 1) / 2, (h - 1) / 2
  return _transform(image, [cos, -sin, cx - cos * cx + sin * cy,
                            sin, cos, cy - sin * cx - cos * cy, 0.0, 0.0])


def _autocontrast(image):
  def channel(c):
    c = tf.cast(c, tf.float32)
    lo, hi = tf.reduce_min(c), tf.reduce_max(c)
    scaled = (c - lo) * 255.0 / tf.maximum(hi - lo, 1.0)
    return tf.where(hi > lo, scaled, c)
  chans = [channel(image[..., i]) for i in range(3)]
  return tf.cast(tf.clip_by_value(tf.stack(chans, -1), 0, 255), tf.uint8)


def _equalize(image):
  def channel(c):
    c = tf.cast(c, tf.int32)
    hist = tf.math.bincount(c, minlength=256, maxlength=256)
    nonzero = tf.boolean_mask(hist, hist > 0)
    step = (tf.reduce_sum(nonzero) - nonzero[-1]) // 255
    lut = (tf.cumsum(hist) + step // 2) // tf.maximum(step, 1)
    lut = tf.clip_by_value(tf.concat([[0], lut[:-1]], 0), 0, 255)
    return tf.where(step > 0, tf.gather(lut, c), c)
  return tf.cast(tf.stack([channel(image[..., i]) for i in range(3)], -1),
                 tf.uint8)


def _sharpness(image, factor):
  img = tf.cast(image, tf.float32)[None]
  k = tf.constant([[1, 1, 1], [1, 5, 1], [1, 1, 1]], tf.float32) / 13.0
  k = tf.tile(k[:, :, None, None], [1, 1, 3, 1])
  smooth = tf.nn.depthwise_conv2d(img, k, [1, 1, 1, 1], "SAME")[0]
  # Keep the border pixels as they are (as PIL does).
  mask = tf.pad(tf.ones(tf.shape(smooth)[:2] - 2), [[1, 1], [1, 1]])[..., None]
  smooth = mask * smooth + (1 - mask) * img[0]
  return _blend(smooth, image, factor)


def _ops(image, level, sign):
  """The operation table; ``level`` in [0, 1+] and ``sign`` in {-1, 1}."""
  h = tf.cast(tf.shape(image)[0], tf.float32)
  w = tf.cast(tf.shape(image)[1], tf.float32)
  factor = 1.0 + sign * 0.9 * level
  return [
      lambda: image,  # identity
      lambda: _autocontrast(image),
      lambda: _equalize(image),
      lambda: _rotate(image, sign * 30.0 * level),
      lambda: tf.where(image < tf.cast(255 - 255 * tf.minimum(level, 1.0),
                                       tf.uint8), image, 255 - image),
      lambda: _blend(_grey(image), image, factor),  # colour
      lambda: tf.bitwise.left_shift(tf.bitwise.right_shift(
          image, tf.cast(4 * tf.minimum(level, 1.0), tf.uint8)),
          tf.cast(4 * tf.minimum(level, 1.0), tf.uint8)),  # posterize
      lambda: _blend(tf.fill(tf.shape(image), tf.cast(tf.reduce_mean(
          tf.cast(tf.image.rgb_to_grayscale(image), tf.float32)), tf.uint8)),
          image, factor),  # contrast
      lambda: _blend(tf.zeros_like(image), image, factor),  # brightness
      lambda: _sharpness(image, factor),
      lambda: _transform(image, [1.0, sign * 0.3 * level, 0.0, 0.0, 1.0, 0.0,
                                 0.0, 0.0]),  # shear x
      lambda: _transform(image, [1.0, 0.0, 0.0, sign * 0.3 * level, 1.0, 0.0,
                                 0.0, 0.0]),  # shear y
      lambda: _transform(image, [1.0, 0.0, sign * 0.45 * level * w, 0.0, 1.0,
                                 0.0, 0.0, 0.0]),  # translate x
      lambda: _transform(image, [1.0, 0.0, 0.0, 0.0, 1.0,
                                 sign * 0.45 * level * h, 0.0, 0.0]),
  ]


OPS = ("identity", "autocontrast", "equalize", "rotate", "solarize", "color",
       "posterize", "contrast", "brightness", "sharpness", "shear_x",
       "shear_y", "translate_x", "translate_y")


def randaugment(image, *, num_layers: int, magnitude: float, seed):
  """uint8 (H, W, 3) -> uint8 (H, W, 3); ``seed`` is a (2,) stateless seed."""
  level = tf.constant(float(magnitude) / _MAX_LEVEL, tf.float32)
  seeds = tf.random.experimental.stateless_split(seed, 2 * num_layers)
  for i in range(num_layers):
    op = tf.random.stateless_uniform([], seeds[2 * i], 0, len(OPS), tf.int32)
    sign = tf.where(tf.random.stateless_uniform([], seeds[2 * i + 1]) < 0.5,
                    -1.0, 1.0)
    branches = _ops(image, level, sign)
    image = tf.switch_case(op, branches)
    image = tf.ensure_shape(image, [None, None, 3])
  return image
