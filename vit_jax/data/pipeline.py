"""Input pipeline: tfds datasets -> tf.data on the host -> global arrays.

Every process reads its own slice of a split (``tfds.split_for_jax_process``)
into *process-local* numpy batches; :func:`start_global` turns them into
global arrays with ``jax.make_array_from_process_local_data``, the input of
the jitted steps.

Determinism (what makes resume exact): the training stream of a process is a
function of ``(seed, process_index, step)`` only. Epoch ``e`` is the process's
slice shuffled with a seed derived from ``(seed, process, e)``; the stream is
the concatenation of epochs; a run that starts at ``step`` skips straight to
element ``step * local_batch`` (at most one epoch of raw records is skipped).
The random augmentation of element ``i`` uses stateless ops seeded with
``(seed, process, i)``, so neither parallelism nor restarts change the data.

Evaluation visits every example exactly once: each process pads its slice to
a common number of batches with ``mask == 0`` examples.

Speed (what keeps an accelerator fed): images cross to the devices as uint8
and are normalised inside the jitted steps; the Inception crop of a JPEG
decodes only the crop (``tf.image.decode_and_crop_jpeg``); the next epoch's
shuffle buffer fills in the background while this epoch is read; global
batches are double-buffered on the devices (:func:`start_global`).
``bench/input_pipeline.py`` measures the host side alone.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from vit_jax.data import console
import vit_jax.data.digits  # noqa: F401  (registers the bundled 'digits' builder)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)
# Builders that are generated locally (no download): safe to prepare offline.
LOCAL_BUILDERS = ("digits",)


class DatasetNotPreparedError(FileNotFoundError):
  """The dataset is not in ``data_dir`` and cannot be downloaded here."""


@dataclasses.dataclass(frozen=True)
class DataSource:
  """A dataset resolved against its builder (shared by all processes)."""

  name: str
  builder: Any
  data_dir: Optional[str]
  train_split: str
  eval_split: str
  num_classes: int
  label_names: Optional[List[str]]
  num_train: int
  num_eval: int
  is_folder: bool = False


# --------------------------------------------------------------------------- #
# Builders.
# --------------------------------------------------------------------------- #


def _folder_path(dataset: str) -> Optional[str]:
  if dataset.startswith("folder:"):
    return os.path.expanduser(dataset[len("folder:"):])
  if os.path.isdir(os.path.expanduser(dataset)):
    return os.path.expanduser(dataset)
  return None


def _online(host: str = "storage.googleapis.com", timeout: float = 4.0) -> bool:
  """Whether tfds' download host answers (a quick probe that never blocks
  for long; :func:`vit_jax.weights.files.online`)."""
  from vit_jax.weights import files  # pylint: disable=import-outside-toplevel
  return files.online(host, timeout)


def _download_is_mocked() -> bool:
  """True inside ``tfds.testing.mock_data`` (preparing is a no-op there)."""
  fn = tfds.core.DatasetBuilder.download_and_prepare
  return getattr(fn, "__module__", "").startswith("tensorflow_datasets.testing")


def _not_prepared_message(name: str, data_dir: str, why: str) -> str:
  return (
      f"Dataset {name!r} is not prepared in data_dir={data_dir!r} and {why}.\n"
      f"Prepare it on a machine with internet access and copy it here:\n"
      f"    tfds build {name} --data_dir={data_dir}\n"
      f"(or python -c \"import tensorflow_datasets as tfds; "
      f"tfds.builder('{name}', data_dir='{data_dir}').download_and_prepare()\"),"
      f"\nthen pass --config.data_dir={data_dir}. Datasets that need a manual "
      f"download (e.g. imagenet2012) must first be placed in "
      f"{os.path.join(data_dir, 'downloads', 'manual')}. Offline, the bundled "
      f"'digits' dataset (configs/digits.py) always works.")


def get_builder(dataset: str, data_dir: Optional[str] = None,
                download: bool = True):
  """A prepared tfds builder for ``dataset`` (catalogue name or image folder).

  Fails fast with :class:`DatasetNotPreparedError` when the data is missing
  and cannot be downloaded (offline, or ``download=False``).
  """
  folder = _folder_path(dataset)
  if folder is not None:
    if not os.path.isdir(folder):
      raise FileNotFoundError(
          f"Image folder {folder!r} (from dataset={dataset!r}) does not exist. "
          f"Expected <dir>/<split>/<label>/<image>.(jpg|jpeg|png).")
    builder = tfds.ImageFolder(folder)
    if not builder.info.splits:
      raise ValueError(f"Image folder {folder!r} has no split directories: "
                       f"expected <dir>/<split>/<label>/<image>.(jpg|png).")
    return builder
  if dataset in LOCAL_BUILDERS:
    return _bundled_builder(dataset, data_dir)
  try:
    builder = tfds.builder(dataset, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise ValueError(
        f"Unknown dataset {dataset!r}: not a TFDS catalogue name (see "
        f"https://www.tensorflow.org/datasets/catalog) and not an image folder "
        f"(pass 'folder:/path/to/dir' for <dir>/<split>/<label>/*.jpg). "
        f"({str(e).splitlines()[0]})") from None
  if builder.is_prepared() or _download_is_mocked():
    if not builder.is_prepared():
      builder.download_and_prepare()  # mock_data: a no-op
    return builder
  where = data_dir or str(builder.data_dir_root)
  if not download:
    raise DatasetNotPreparedError(
        _not_prepared_message(dataset, where, "config.download is False"))
  if not _online():
    raise DatasetNotPreparedError(_not_prepared_message(
        dataset, where, "this machine is offline (cannot reach "
        "storage.googleapis.com), so it cannot be downloaded"))
  try:
    builder.download_and_prepare()
  except Exception as e:  # network, manual-download and permission errors
    raise DatasetNotPreparedError(_not_prepared_message(
        dataset, where, f"downloading it failed: {type(e).__name__}: "
        f"{str(e)[:300]}")) from e
  return builder


def _bundled_builder(name: str, data_dir: Optional[str]):
  """The builder of a dataset vit_jax ships (generated here, no download),
  prepared on first use with one line of ours. tfds' own output while it
  looks for and generates the data (a missing-folder warning, progress
  bars, "Downloading and preparing ... Unknown size") says nothing true
  about a bundled dataset: it is held back, and shown only on failure."""
  with console.held_back():
    builder = tfds.builder(name, data_dir=data_dir)
    prepared = builder.is_prepared()
  if not prepared:
    print(f"Preparing the bundled {name!r} dataset in {builder.data_dir} "
          f"(once; nothing is downloaded).", flush=True)
    with console.held_back():
      builder.download_and_prepare()
  return builder


def _check_split(builder, split: str, what: str):
  known = list(builder.info.splits.keys())
  base = split.split("[")[0]
  if known and base not in known:
    raise ValueError(f"{what}={split!r}: dataset {builder.name!r} has splits "
                     f"{known}.")


def _count(ds: tf.data.Dataset, builder, split) -> int:
  n = int(ds.cardinality())
  if n >= 0:
    return n
  return int(builder.info.splits[split].num_examples)


def _process_split(src_builder, split: str, index: int, count: int,
                   is_folder: bool, drop_remainder: bool):
  """(raw dataset, num examples) of process ``index``'s slice of ``split``.

  Raw = image not decoded yet (decoding happens after shuffling, cheaper)."""
  decoders = {"image": tfds.decode.SkipDecoding()}
  if is_folder:  # ImageFolder has no sub-split API: shard the file list.
    ds = src_builder.as_dataset(split=split, shuffle_files=False,
                                decoders=decoders, read_config=_READ_CONFIG)
    total = _count(ds, src_builder, split)
    if drop_remainder:
      ds = ds.take(total // count * count)
      total = total // count * count
    ds = ds.shard(count, index)
    return ds, len(range(index, total, count))
  sub = tfds.split_for_jax_process(split, process_index=index,
                                   process_count=count,
                                   drop_remainder=drop_remainder)
  ds = src_builder.as_dataset(split=sub, shuffle_files=False,
                              decoders=decoders, read_config=_READ_CONFIG)
  return ds, _count(ds, src_builder, sub)


# tfds would otherwise ``.cache()`` a small split by itself ("auto-cache"),
# and an iterator stopped before the end of its first pass (a run shorter
# than an epoch) makes TensorFlow discard that partial cache with a warning
# at exit. Caching is ``config.cache``'s decision, made in :func:`_cached`.
_READ_CONFIG = tfds.ReadConfig(try_autocache=False)


def _cached(ds: tf.data.Dataset) -> tf.data.Dataset:
  """``ds.cache()`` (in memory), filled now by one complete pass: every
  later iterator only reads it, so one that stops early (the end of a run)
  leaves no partly written cache behind."""
  ds = ds.cache()
  ds.reduce(np.int64(0), lambda n, _: n + 1)
  return ds


def get_source(config) -> DataSource:
  """Resolves ``config.dataset`` (+ splits) and reads its metadata."""
  builder = get_builder(config.dataset, config.data_dir, config.download)
  is_folder = isinstance(builder, tfds.ImageFolder)
  _check_split(builder, config.train_split, "config.train_split")
  _check_split(builder, config.eval_split, "config.eval_split")
  feats = builder.info.features
  for key in ("image", "label"):
    if key not in feats:
      raise ValueError(
          f"Dataset {config.dataset!r} has features {list(feats.keys())}; "
          f"expected an image classification dataset with 'image' and "
          f"'label'.")
  names = list(feats["label"].names) if feats["label"].names else None
  num_classes = int(feats["label"].num_classes)
  counts = {}
  for split in (config.train_split, config.eval_split):
    _, counts[split] = _process_split(builder, split, 0, 1, is_folder, False)
  return DataSource(
      name=config.dataset, builder=builder, data_dir=config.data_dir,
      train_split=config.train_split, eval_split=config.eval_split,
      num_classes=num_classes, label_names=names,
      num_train=counts[config.train_split], num_eval=counts[config.eval_split],
      is_folder=is_folder)


# --------------------------------------------------------------------------- #
# Preprocessing.
# --------------------------------------------------------------------------- #


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


def eval_resize_size(pp, image_size: int) -> int:
  return int(round(image_size / pp.eval_crop_fraction))


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


# --------------------------------------------------------------------------- #
# Datasets.
# --------------------------------------------------------------------------- #


def _options() -> tf.data.Options:
  opts = tf.data.Options()
  opts.deterministic = True
  return opts


def _mix(*ints) -> int:
  """A stable 62-bit seed from small integers (no Python hash())."""
  h = 0x243F6A8885A308D3
  for v in ints:
    h = (h * 0x100000001B3 + int(v) + 0x9E3779B9) % (1 << 62)
  return h


def _epochs_in_sequence(epoch_fn):
  """``flat_map(epoch_fn)`` over epoch numbers, the same elements in the same
  order, but the next epoch's iterator (its shuffle buffer) is filled by a
  background thread while this one is read: no stall at epoch boundaries.
  At most two epochs' buffers exist at a time."""
  logger = tf.get_logger()
  level = logger.level
  logger.setLevel("ERROR")  # its deprecation note: nothing else does this
  try:
    return tf.data.experimental.parallel_interleave(
        epoch_fn, cycle_length=1, block_length=1, sloppy=False,
        buffer_output_elements=1, prefetch_input_elements=1)
  finally:
    logger.setLevel(level)


def train_dataset(config, src: DataSource, *, local_batch: int,
                  start_step: int, process_index: int, process_count: int,
                  mean: Optional[Sequence[float]] = None,
                  std: Optional[Sequence[float]] = None):
  """Infinite stream of process-local training batches from ``start_step``.

  Yields dicts ``image`` (local_batch, S, S, 3) and ``label`` int32. Images
  are uint8 (a quarter of float32's bytes to the device), normalised inside
  the jitted step (:func:`vit_jax.train.step.normalize_images`); with
  ``mean`` and ``std`` they are normalised float32 here instead (the same
  numbers), for host-side consumers.
  """
  raw, n = _process_split(src.builder, src.train_split, process_index,
                          process_count, src.is_folder, drop_remainder=True)
  if n <= 0:
    raise ValueError(
        f"Process {process_index}/{process_count} gets no training examples "
        f"from {src.name!r} split {src.train_split!r} ({src.num_train} in "
        f"total).")
  if config.cache:
    raw = _cached(raw)
  buffer = int(max(1, min(config.shuffle_buffer, n)))
  epoch_seed = _mix(config.seed, process_index, 1)
  elem_seed = _mix(config.seed, process_index, 2)

  def epoch(e):
    return raw.shuffle(buffer, seed=epoch_seed + e * 7919,
                       reshuffle_each_iteration=False)

  offset = int(start_step) * int(local_batch)
  first_epoch, skip = divmod(offset, n)
  ds = tf.data.Dataset.range(first_epoch, 1 << 40).apply(
      _epochs_in_sequence(epoch))
  ds = ds.skip(skip).enumerate(start=offset)

  pp, size = config.pp, config.image_size

  def process(i, ex):
    seed = tf.stack([tf.constant(elem_seed, tf.int64), i])
    image = preprocess_train(ex["image"], seed, pp=pp, image_size=size,
                             mean=mean, std=std)
    return {"image": image, "label": tf.cast(ex["label"], tf.int32)}

  ds = ds.map(process, num_parallel_calls=tf.data.AUTOTUNE)
  ds = ds.batch(local_batch, drop_remainder=True)
  ds = ds.prefetch(config.prefetch)
  return ds.with_options(_options())


def eval_dataset(config, src: DataSource, *, local_batch: int,
                 process_index: int, process_count: int,
                 mean: Optional[Sequence[float]] = None,
                 std: Optional[Sequence[float]] = None
                 ) -> Tuple[tf.data.Dataset, int]:
  """(padded process-local eval batches with ``mask``, number of batches).

  All processes yield the same number of batches; padding examples have
  ``mask == 0`` (and zero pixels) so every real example is counted exactly
  once. Images are uint8, or normalised float32 with ``mean`` and ``std``
  (as in :func:`train_dataset`).
  """
  counts = [_process_split(src.builder, src.eval_split, p, process_count,
                           src.is_folder, drop_remainder=False)[1]
            for p in range(process_count)]
  raw, n = _process_split(src.builder, src.eval_split, process_index,
                          process_count, src.is_folder, drop_remainder=False)
  assert n == counts[process_index], (n, counts)
  num_batches = max(1, math.ceil(max(counts) / local_batch))
  if config.cache:
    raw = _cached(raw)
  size = config.image_size
  resize = eval_resize_size(config.pp, size)

  def process(ex):
    return {"image": preprocess_eval(ex["image"], image_size=size,
                                     resize_size=resize, mean=mean, std=std),
            "label": tf.cast(ex["label"], tf.int32),
            "mask": tf.constant(1.0, tf.float32)}

  ds = raw.map(process, num_parallel_calls=tf.data.AUTOTUNE)
  pad = num_batches * local_batch - n
  if pad:
    image = ds.element_spec["image"]
    blank = {"image": tf.zeros(image.shape, image.dtype),
             "label": tf.constant(0, tf.int32),
             "mask": tf.constant(0.0, tf.float32)}
    ds = ds.concatenate(tf.data.Dataset.from_tensors(blank).repeat(pad))
  ds = ds.batch(local_batch, drop_remainder=True).prefetch(config.prefetch)
  return ds.with_options(_options()), num_batches


def normalization(config, init_preprocessing=None):
  """(mean, std) in [0, 1] pixel units: the config's, else the initial
  weights' (torchvision: ImageNet statistics), else 0.5 / 0.5."""
  if init_preprocessing is not None:
    mean, std = tuple(init_preprocessing.mean), tuple(init_preprocessing.std)
  else:
    mean, std = HALF, HALF
  if config.pp.mean is not None:
    mean = tuple(config.pp.mean)
  if config.pp.std is not None:
    std = tuple(config.pp.std)
  for what, v in (("mean", mean), ("std", std)):
    if len(v) != 3 or not all(0.0 <= float(x) <= 1.0 for x in v):
      raise ValueError(f"config.pp.{what}={v}: expected 3 floats in [0, 1] "
                       f"(per-channel, in [0, 1]-scaled pixel units).")
  if min(std) <= 0:
    raise ValueError(f"config.pp.std={std}: must be positive.")
  return tuple(float(x) for x in mean), tuple(float(x) for x in std)


def as_numpy(ds: tf.data.Dataset):
  """Iterates a dataset as dicts of numpy arrays."""
  return ds.as_numpy_iterator()


def start_global(ds: tf.data.Dataset, sharding, ahead: int = 1):
  """Iterates process-local batches as global ``jax.Array`` batches.

  Args:
    ds: this process's batches (:func:`train_dataset`, :func:`eval_dataset`).
    sharding: where a global batch lives (the batch axis split over every
      mesh axis, :func:`vit_jax.train.sharding.batch_sharding`); each process
      supplies the rows of its own devices.
    ahead: global batches whose host-to-device copies are started before
      the one yielded is used (1: double-buffered, the next batch is copied
      while the step computes on this one; 0: none).

  Yields:
    Dicts of global arrays, ``process_count`` times the local batch, in the
    order of ``ds``.
  """
  import collections  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  queue = collections.deque()
  for batch in as_numpy(ds):
    # Dispatches the copies and returns: they overlap with the running step.
    queue.append(jax.make_array_from_process_local_data(sharding, batch))
    if len(queue) > ahead:
      yield queue.popleft()
  while queue:
    yield queue.popleft()
