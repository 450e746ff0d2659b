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
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import threading
from typing import Any, List, Optional, Sequence, Tuple

import tensorflow as tf
import tensorflow_datasets as tfds

import vit_jax.datasets  # noqa: F401  (registers the bundled 'digits' builder)

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
  """Quick reachability probe (DNS + TCP) that never blocks for long."""
  ok = []

  def probe():
    try:
      socket.create_connection((host, 443), timeout=timeout).close()
      ok.append(True)
    except OSError:
      pass

  t = threading.Thread(target=probe, daemon=True)
  t.start()
  t.join(timeout + 1.0)
  return bool(ok)


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
  if builder.name in LOCAL_BUILDERS:
    builder.download_and_prepare()
    return builder
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
                                decoders=decoders)
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
                              decoders=decoders)
  return ds, _count(ds, src_builder, sub)


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
  image = tf.cast(image, tf.uint8)
  if image.shape[-1] == 1:
    image = tf.image.grayscale_to_rgb(image)
  return image


def _normalize(image, mean, std):
  image = tf.cast(image, tf.float32) / 255.0
  return (image - tf.constant(mean, tf.float32)) / tf.constant(std, tf.float32)


def _resize(image, size):
  return tf.image.resize(image, [size, size], method="bilinear", antialias=True)


def eval_resize_size(pp, image_size: int) -> int:
  return int(round(image_size / pp.eval_crop_fraction))


def preprocess_eval(image, *, image_size: int, resize_size: int, mean, std):
  """Resize the short side to ``resize_size``, center-crop, normalise."""
  image = _decode(image)
  shape = tf.cast(tf.shape(image)[:2], tf.float32)
  scale = tf.cast(resize_size, tf.float32) / tf.reduce_min(shape)
  new = tf.cast(tf.round(shape * scale), tf.int32)
  new = tf.maximum(new, image_size)
  image = tf.image.resize(image, new, method="bilinear", antialias=True)
  top = (new[0] - image_size) // 2
  left = (new[1] - image_size) // 2
  image = image[top:top + image_size, left:left + image_size]
  image = tf.reshape(image, [image_size, image_size, 3])
  return _normalize(image, mean, std)


def preprocess_train(image, seed, *, pp, image_size: int, mean, std):
  """Random crop (``pp.crop``), flip, RandAugment, normalise; ``seed`` is a
  (2,) int64 stateless seed, so the result is a function of it."""
  image = _decode(image)
  seeds = tf.random.experimental.stateless_split(seed, 4)
  if pp.crop == "inception":
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image), tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
        seed=seeds[0], min_object_covered=0.0,
        aspect_ratio_range=tuple(pp.crop_ratio),
        area_range=tuple(pp.crop_scale), max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    image = _resize(tf.slice(image, begin, size), image_size)
  elif pp.crop == "random_crop":  # resize, zero-pad, crop back: a shift
    image = _resize(image, image_size)
    pad = int(pp.crop_padding)
    image = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]])
    image = tf.image.stateless_random_crop(
        image, [image_size, image_size, 3], seed=seeds[0])
  elif pp.crop == "resize":
    image = _resize(image, image_size)
  else:
    raise ValueError(f"config.pp.crop={pp.crop!r}: expected 'inception', "
                     f"'random_crop' or 'resize'.")
  if pp.flip:
    image = tf.image.stateless_random_flip_left_right(image, seeds[1])
  if pp.randaugment_layers:
    from vit_jax import randaugment  # pylint: disable=import-outside-toplevel
    image = randaugment.randaugment(
        tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8),
        num_layers=pp.randaugment_layers, magnitude=pp.randaugment_magnitude,
        seed=seeds[2])
  image = tf.reshape(image, [image_size, image_size, 3])
  return _normalize(image, mean, std)


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


def train_dataset(config, src: DataSource, *, local_batch: int,
                  start_step: int, process_index: int, process_count: int,
                  mean: Sequence[float], std: Sequence[float]):
  """Infinite stream of process-local training batches from ``start_step``.

  Yields dicts ``image`` (local_batch, S, S, 3) float32, ``label`` int32.
  """
  raw, n = _process_split(src.builder, src.train_split, process_index,
                          process_count, src.is_folder, drop_remainder=True)
  if n <= 0:
    raise ValueError(
        f"Process {process_index}/{process_count} gets no training examples "
        f"from {src.name!r} split {src.train_split!r} ({src.num_train} in "
        f"total).")
  if config.cache:
    raw = raw.cache()
  buffer = int(max(1, min(config.shuffle_buffer, n)))
  epoch_seed = _mix(config.seed, process_index, 1)
  elem_seed = _mix(config.seed, process_index, 2)

  def epoch(e):
    return raw.shuffle(buffer, seed=epoch_seed + e * 7919,
                       reshuffle_each_iteration=False)

  offset = int(start_step) * int(local_batch)
  first_epoch, skip = divmod(offset, n)
  ds = tf.data.Dataset.range(first_epoch, 1 << 40).flat_map(epoch)
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
                 mean: Sequence[float], std: Sequence[float]
                 ) -> Tuple[tf.data.Dataset, int]:
  """(padded process-local eval batches with ``mask``, number of batches).

  All processes yield the same number of batches; padding examples have
  ``mask == 0`` so every real example is counted exactly once.
  """
  counts = [_process_split(src.builder, src.eval_split, p, process_count,
                           src.is_folder, drop_remainder=False)[1]
            for p in range(process_count)]
  raw, n = _process_split(src.builder, src.eval_split, process_index,
                          process_count, src.is_folder, drop_remainder=False)
  assert n == counts[process_index], (n, counts)
  num_batches = max(1, math.ceil(max(counts) / local_batch))
  if config.cache:
    raw = raw.cache()
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
    blank = {"image": tf.zeros([size, size, 3], tf.float32),
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


def start_global(ds: tf.data.Dataset, sharding):
  """Iterates process-local batches as global ``jax.Array`` batches.

  Args:
    ds: this process's batches (:func:`train_dataset`, :func:`eval_dataset`).
    sharding: where a global batch lives (the batch axis split over every
      mesh axis, :func:`vit_jax.sharding.batch_sharding`); each process
      supplies the rows of its own devices.

  Yields:
    Dicts of global arrays, ``process_count`` times the local batch.
  """
  import jax  # pylint: disable=import-outside-toplevel

  for batch in as_numpy(ds):
    yield jax.make_array_from_process_local_data(sharding, batch)
