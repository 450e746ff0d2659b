"""Image transforms on the host (TensorFlow): decoding (only a JPEG's crop
window where that suffices), the training augmentations (Inception crop or
padded random crop, flip, RandAugment) with stateless seeds, and the
evaluation resize and center crop. Images leave as uint8, or normalised
float32 where a mean and std are given.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from vit_jax.data import preprocessing

def _decode(image) -> tf.Tensor:
  """Encoded bytes or a uint8 array -> uint8 (H, W, 3)."""
  if image.dtype == tf.string:
    image = tf.io.decode_image(image, channels=3, expand_animations=False)
    image.set_shape([None, None, 3])
    return image
  return _rgb(image)


def _rgb(image) -> tf.Tensor:
  image = tf.cast(image, tf.uint8)
  if image.shape[-1] == 1:
    image = tf.image.grayscale_to_rgb(image)
  return image


def _shape(image) -> tf.Tensor:
  """(H, W, 3) of an encoded image (a JPEG's from its header, without
  decoding it) or of a pixel array."""
  if image.dtype != tf.string:
    return tf.concat([tf.shape(image)[:2], [3]], 0)
  return tf.cond(
      tf.io.is_jpeg(image),
      lambda: tf.concat([tf.image.extract_jpeg_shape(image)[:2], [3]], 0),
      lambda: tf.shape(_decode(image)))


# Pixels decoded around a JPEG crop: libjpeg's chroma upsampling reads
# neighbouring pixels, so a window decoded alone differs from the full decode
# at its edges; one 16-pixel MCU of context makes the two the same.
_JPEG_CROP_MARGIN = 16


def _decode_crop(image, begin, size, shape=None) -> tf.Tensor:
  """The window ``begin``/``size`` ((y, x, 0), (h, w, -1 or 3)) of an image
  of ``shape`` (:func:`_shape`). A JPEG decodes only that window plus a
  16-pixel margin (``tf.image.decode_and_crop_jpeg``): the same pixels as
  decoding all of it and cropping. Anything else is decoded and sliced."""
  h, w = size[0], size[1]
  if image.dtype != tf.string:
    return tf.slice(_rgb(image), begin, tf.stack([h, w, 3]))
  if shape is None:
    shape = _shape(image)

  def jpeg():
    m = _JPEG_CROP_MARGIN
    y0, x0 = tf.maximum(begin[0] - m, 0), tf.maximum(begin[1] - m, 0)
    y1 = tf.minimum(begin[0] + h + m, shape[0])
    x1 = tf.minimum(begin[1] + w + m, shape[1])
    window = tf.stack([y0, x0, y1 - y0, x1 - x0])
    out = tf.image.decode_and_crop_jpeg(image, window, channels=3)
    return tf.slice(out, tf.stack([begin[0] - y0, begin[1] - x0, 0]),
                    tf.stack([h, w, 3]))

  def other():
    return tf.slice(_decode(image), begin, tf.stack([h, w, 3]))

  out = tf.cond(tf.io.is_jpeg(image), jpeg, other)
  out.set_shape([None, None, 3])
  return out


def _normalize(image, mean, std):
  image = tf.cast(image, tf.float32) / 255.0
  return (image - tf.constant(mean, tf.float32)) / tf.constant(std, tf.float32)


def _to_uint8(image) -> tf.Tensor:
  """Resized (float) pixels -> uint8, rounded: what crosses to the device."""
  if image.dtype == tf.uint8:
    return image
  return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)


def _finish(image, image_size, mean, std):
  """uint8 (image_size, image_size, 3); normalised float32 on the host only
  when ``mean``/``std`` are given (see :func:`train_dataset`)."""
  image = tf.reshape(_to_uint8(image), [image_size, image_size, 3])
  if mean is None and std is None:
    return image
  return _normalize(image, mean, std)


def _resize(image, size):
  return tf.image.resize(image, [size, size], method="bilinear", antialias=True)


def preprocess_eval(image, *, image_size: int, resize_size: int, mean=None,
                    std=None):
  """Resize the short side to ``resize_size``, center-crop; uint8, or
  normalised float32 when ``mean`` and ``std`` are given."""
  image = _decode(image)
  shape = tf.cast(tf.shape(image)[:2], tf.float32)
  scale = tf.cast(resize_size, tf.float32) / tf.reduce_min(shape)
  new = tf.cast(tf.round(shape * scale), tf.int32)
  new = tf.maximum(new, image_size)
  image = tf.image.resize(image, new, method="bilinear", antialias=True)
  top = (new[0] - image_size) // 2
  left = (new[1] - image_size) // 2
  image = image[top:top + image_size, left:left + image_size]
  return _finish(image, image_size, mean, std)


def inception_crop_window(shape, seed, pp):
  """(begin, size) of the random resized crop of an image of ``shape``
  (H, W, C): a function of the shape and the stateless ``seed`` only."""
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
      shape, tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
      seed=seed, min_object_covered=0.0,
      aspect_ratio_range=tuple(pp.crop_ratio),
      area_range=tuple(pp.crop_scale), max_attempts=10,
      use_image_if_no_bounding_boxes=True)
  return begin, size


def preprocess_train(image, seed, *, pp, image_size: int, mean=None, std=None):
  """Random crop (``pp.crop``), flip, RandAugment; uint8, or normalised
  float32 when ``mean`` and ``std`` are given. ``seed`` is a (2,) int64
  stateless seed, so the result is a function of it.

  The Inception crop of a JPEG decodes only the crop's window (and a margin:
  :func:`_decode_crop`), with the same pixels as a full decode."""
  seeds = tf.random.experimental.stateless_split(seed, 4)
  if pp.crop == "inception":
    shape = _shape(image)
    begin, size = inception_crop_window(shape, seeds[0], pp)
    image = _resize(_decode_crop(image, begin, size, shape), image_size)
  elif pp.crop == "random_crop":  # resize, zero-pad, crop back: a shift
    image = _resize(_decode(image), image_size)
    pad = int(pp.crop_padding)
    image = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]])
    image = tf.image.stateless_random_crop(
        image, [image_size, image_size, 3], seed=seeds[0])
  elif pp.crop == "resize":
    image = _resize(_decode(image), image_size)
  else:
    raise ValueError(f"config.pp.crop={pp.crop!r}: expected 'inception', "
                     f"'random_crop' or 'resize'.")
  if pp.flip:
    image = tf.image.stateless_random_flip_left_right(image, seeds[1])
  if pp.randaugment_layers:
    from vit_jax.data import randaugment  # pylint: disable=import-outside-toplevel
    image = randaugment.randaugment(
        _to_uint8(image), num_layers=pp.randaugment_layers,
        magnitude=pp.randaugment_magnitude, seed=seeds[2])
  return _finish(image, image_size, mean, std)


def preprocess_tf(image: np.ndarray, pre: preprocessing.Preprocessing
                  ) -> np.ndarray:
  """One uint8 (H, W, 3) image through the training pipeline's eval
  transform, for models trained by ``train.py``: what they saw during
  evaluation."""
  out = preprocess_eval(
      np.asarray(image, np.uint8), image_size=int(pre.crop_size),
      resize_size=int(pre.resize_size), mean=tuple(pre.mean),
      std=tuple(pre.std))
  return np.asarray(out, np.float32)
