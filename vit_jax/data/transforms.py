"""Image transforms on the host (TensorFlow): decoding (only a JPEG's crop
window where that suffices), the training augmentations (Inception crop or
padded random crop, flip, RandAugment) with stateless seeds, and the
evaluation resize and center crop. Images leave as uint8, or normalised
float32 where a mean and std are given. NaFlex models' inputs: each image
resized to a token budget keeping its aspect ratio, cut into patches and
padded (:func:`preprocess_train_naflex`, :func:`preprocess_eval_naflex`;
the NumPy twin is :mod:`vit_jax.data.naflex`).
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
  return _finish(_flip_and_randaugment(image, pp, seeds), image_size, mean,
                 std)


def _flip_and_randaugment(image, pp, seeds):
  """The training augmentations after the crop: a random horizontal flip
  (``pp.flip``) and RandAugment (``pp.randaugment_layers``), each from its
  own seed."""
  if pp.flip:
    image = tf.image.stateless_random_flip_left_right(image, seeds[1])
  if pp.randaugment_layers:
    from vit_jax.data import randaugment  # pylint: disable=import-outside-toplevel
    image = randaugment.randaugment(
        _to_uint8(image), num_layers=pp.randaugment_layers,
        magnitude=pp.randaugment_magnitude, seed=seeds[2])
  return image


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


# --------------------------------------------------------------------------- #
# NaFlex (vit_jax.data.naflex's NumPy pipeline, in TensorFlow for tf.data).
# --------------------------------------------------------------------------- #


def _search_steps(eps: float = 1e-5) -> int:
  """timm's budget search halves [eps / 10, 100] until it is narrower than
  ``eps``: a fixed number of steps, whichever way each one goes."""
  width, steps = 100.0 - eps / 10.0, 0
  while width >= eps:
    width, steps = width / 2.0, steps + 1
  return steps


_SEARCH_STEPS = _search_steps()


def image_size_for_seq(hw, patch_size: int, max_seq_len):
  """(2,) int32 (height, width) of :func:`vit_jax.data.naflex.
  image_size_for_seq` for a (2,) image size tensor (``max_seq_len`` an int
  or a tensor): timm's binary search in float64, unrolled (its fixed
  number of steps), so the same sizes."""
  p = tf.constant(float(patch_size), tf.float64)
  hw = tf.cast(hw, tf.float64)

  def target(ratio):
    t = p * tf.math.ceil(hw * ratio / p)
    return tf.maximum(t, p)

  def fits(ratio):
    t = target(ratio)
    return tf.reduce_prod(tf.floor(t / p)) <= tf.cast(max_seq_len,
                                                       tf.float64)

  lb = tf.constant(1e-5 / 10.0, tf.float64)  # timm's eps / 10
  rb = tf.constant(100.0, tf.float64)
  for _ in range(_SEARCH_STEPS):
    mid = (lb + rb) / 2.0
    ok = fits(mid)
    lb, rb = tf.where(ok, mid, lb), tf.where(ok, rb, mid)
  return tf.cast(target(lb), tf.int32)


def patchify(image, patch_size: int, seq_len):
  """(H, W, C) with sides multiples of the patch -> ``{patches (seq_len,
  P*P*C), patch_coord (seq_len, 2) int32, patch_valid (seq_len,) bool}``
  padded with zero patches at (0, 0) (:func:`vit_jax.data.naflex.patchify`
  and ``collate``)."""
  p = int(patch_size)
  shape = tf.shape(image)
  gh, gw, c = shape[0] // p, shape[1] // p, image.shape[-1]
  x = tf.reshape(image, [gh, p, gw, p, c])
  patches = tf.reshape(tf.transpose(x, [0, 2, 1, 3, 4]), [gh * gw, p * p * c])
  ys, xs = tf.meshgrid(tf.range(gh), tf.range(gw), indexing="ij")
  coord = tf.stack([tf.reshape(ys, [-1]), tf.reshape(xs, [-1])], axis=1)
  pad = seq_len - gh * gw
  out = {"patches": tf.pad(patches, [[0, pad], [0, 0]]),
         "patch_coord": tf.pad(coord, [[0, pad], [0, 0]]),
         "patch_valid": tf.pad(tf.ones([gh * gw], tf.bool), [[0, pad]])}
  if isinstance(seq_len, int):  # a static length: a static shape
    out = {k: tf.ensure_shape(v, [seq_len] + v.shape[1:].as_list())
           for k, v in out.items()}
  return out


def _naflex_finish(image, patch_size, seq_len, mean, std):
  """Resized pixels -> uint8 (or normalised float32) patches, padded."""
  image = _to_uint8(image)
  if mean is not None or std is not None:
    image = _normalize(image, mean, std)
  return patchify(image, patch_size, seq_len)


def _resize_to_seq(image, patch_size, seq_len):
  size = image_size_for_seq(tf.shape(image)[:2], patch_size, seq_len)
  return tf.image.resize(image, size, method="bilinear", antialias=True)


def preprocess_eval_naflex(image, *, patch_size: int, seq_len: int,
                           mean=None, std=None):
  """NaFlex evaluation: the whole image resized to the largest size with at
  most ``seq_len`` patches keeping its aspect ratio (timm's
  ``ResizeToSequence``; bilinear with antialiasing, as this pipeline's
  other resizes), cut into patches, padded to ``seq_len``; uint8 patches,
  or normalised float32 with ``mean`` / ``std``."""
  image = _resize_to_seq(_decode(image), patch_size, seq_len)
  return _naflex_finish(image, patch_size, seq_len, mean, std)


def preprocess_train_naflex(image, seed, *, pp, patch_size: int, seq_len,
                            mean=None, std=None):
  """NaFlex training: the Inception crop (``pp.crop='inception'``; else the
  whole image) resized to at most ``seq_len`` patches keeping the crop's
  aspect ratio, flip, RandAugment; patches padded to ``seq_len`` (a
  tensor: the step's length)."""
  seeds = tf.random.experimental.stateless_split(seed, 4)
  if pp.crop == "inception":
    shape = _shape(image)
    begin, size = inception_crop_window(shape, seeds[0], pp)
    image = _decode_crop(image, begin, size, shape)
  else:
    image = _decode(image)
  image = _resize_to_seq(image, patch_size, seq_len)
  return _naflex_finish(_flip_and_randaugment(image, pp, seeds), patch_size,
                        seq_len, mean, std)


def preprocess_naflex_tf(image: np.ndarray, pre: preprocessing.Preprocessing,
                         patch_size: int) -> dict:
  """One uint8 (H, W, 3) image through the training pipeline's NaFlex eval
  transform (normalised float32 patches padded to ``pre.max_seq_len``), for
  NaFlex models trained by ``train.py``: what they saw during evaluation."""
  out = preprocess_eval_naflex(
      np.asarray(image, np.uint8), patch_size=int(patch_size),
      seq_len=int(pre.max_seq_len), mean=tuple(pre.mean), std=tuple(pre.std))
  return {k: v.numpy() for k, v in out.items()}
