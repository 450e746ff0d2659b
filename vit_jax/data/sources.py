"""Where the data comes from: a tfds catalogue name or an image folder,
resolved to a prepared builder, and each process's slice of a split.

    src = sources.get_source(config)   # builder, splits, classes, counts

The bundled ``digits`` dataset is generated on first use (one line of
ours); catalogue datasets are downloaded when the machine can reach tfds'
host, else a clear error says how to prepare them elsewhere.

An image folder (``folder:DIR``) is read one of two ways, by where its
images are (:func:`folder_builder`):

* ``DIR/<split>/<label>/*.jpg`` (every image two levels down): a split
  tree, tfds' ``ImageFolder`` (what training needs);
* any other folder of images (flat, or nested at any depth): read whole,
  as the one split ``'all'`` (:class:`ImageFiles`), sorted by path;
  labelled by the first-level subdirectory when every image is one level
  down (``DIR/<label>/*.jpg``), else unlabelled (label -1).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, List, Optional

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from vit_jax.data import console, digits, net  # digits: registers 'digits'

# Builders that are generated locally (no download): safe to prepare offline.
LOCAL_BUILDERS = ("digits",)


def graph_fn(fn):
  """``fn`` for tf.data as written, without AutoGraph: the data functions
  use TensorFlow ops for every branch on a tensor, and AutoGraph's
  conversion of them (and of everything they call) is Python source
  rewriting in each process: about 1 s of CPU of every ``train.py``'s
  start-up (a 20-step run on the bundled digits: 16.2-16.5 -> 15.2-15.6 s,
  alternated, on an AMD Zen 1)."""
  return tf.autograph.experimental.do_not_convert(fn)


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


# What tf.io.decode_image reads (the pipeline's decoder); tfds' ImageFolder
# (a split tree) reads .jpg, .jpeg and .png only.
DECODABLE = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp")
# Image files PIL reads (the tools' other inputs) that TensorFlow cannot.
NOT_DECODABLE = (".tif", ".tiff", ".ppm", ".pgm")
ALL_SPLIT = "all"  # the one split of a folder read whole
IMAGE_FOLDER_EXTS = (".jpg", ".jpeg", ".png")  # what tfds' ImageFolder reads


class ImageFiles:
  """A folder of images read whole (no ``<split>/<label>/`` tree): the
  one split :data:`ALL_SPLIT` of every image under ``root``, sorted by
  path. ``label_names``: the first-level subdirectories when every image is
  in one (``root/<label>/x.jpg``), else None and every label is -1.
  Examples are tfds-like dicts: ``image`` (the encoded bytes), ``label``,
  ``image/filename``."""

  def __init__(self, root: str, paths: List[str],
               label_names: Optional[List[str]] = None):
    self.root = root
    self.paths = list(paths)
    self.label_names = label_names
    self.name = f"folder:{root}"
    self.note = ""  # why it is not a split tree, where that may surprise
    if label_names:
      index = {n: i for i, n in enumerate(label_names)}
      self.labels = np.array([index[os.path.relpath(p, root).split(os.sep)[0]]
                              for p in self.paths], np.int64)
    else:
      self.labels = np.full((len(self.paths),), -1, np.int64)

  def as_dataset(self, split: str = ALL_SPLIT, **unused) -> tf.data.Dataset:
    del unused  # shuffle_files, decoders, read_config: the order is fixed
    if split != ALL_SPLIT:
      raise ValueError(self.split_error(split))
    ds = tf.data.Dataset.from_tensor_slices(
        {"image/filename": self.paths, "label": self.labels})
    read = lambda ex: dict(ex, image=tf.io.read_file(  # noqa: E731
        ex["image/filename"]))
    return ds.map(graph_fn(read))

  def split_error(self, split: str, what: str = "split") -> str:
    return (f"{what}={split!r}: {self.root!r} is a folder of images without "
            f"a <split>/<label>/ tree{self.note}, read whole as the one "
            f"split {ALL_SPLIT!r} (leave the split out). Training needs "
            f"{self.root}/<split>/<label>/<image> directories.")


def _image_files(root: str) -> List[str]:
  """Every image file under ``root`` (hidden files and directories left
  out; linked directories followed, as tfds' ImageFolder does), sorted; a
  clear error for image files the pipeline cannot decode or a folder
  without images."""
  found, unreadable = [], []
  for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    for f in filenames:
      ext = os.path.splitext(f)[1].lower()
      if f.startswith("."):
        continue
      if ext in DECODABLE:
        found.append(os.path.join(dirpath, f))
      elif ext in NOT_DECODABLE:
        unreadable.append(os.path.join(dirpath, f))
  if unreadable:
    raise ValueError(
        f"Image folder {root!r} has {len(unreadable)} image(s) the input "
        f"pipeline (tf.io.decode_image) cannot decode, e.g. "
        f"{unreadable[:3]}: convert them to {', '.join(DECODABLE)}, or move "
        f"them out.")
  if not found:
    raise ValueError(f"Image folder {root!r} has no images "
                     f"({', '.join(DECODABLE)}) at any depth.")
  return sorted(found)


def folder_builder(root: str):
  """The builder of an image folder (see the module docstring): tfds'
  ``ImageFolder`` for a ``<split>/<label>/`` tree, else :class:`ImageFiles`."""
  if not os.path.isdir(root):
    raise FileNotFoundError(
        f"Image folder {root!r} does not exist. Expected a folder of images, "
        f"or a <dir>/<split>/<label>/<image>.(jpg|jpeg|png) tree.")
  paths = _image_files(root)
  parts = [os.path.relpath(p, root).split(os.sep) for p in paths]
  depths = {len(q) - 1 for q in parts}
  if depths == {2}:
    other = [p for p in paths if not p.lower().endswith(IMAGE_FOLDER_EXTS)]
    if other:
      raise ValueError(
          f"Image folder {root!r} is a <split>/<label>/ tree, which tfds' "
          f"ImageFolder reads as {', '.join(IMAGE_FOLDER_EXTS)} only: "
          f"{len(other)} other image(s) would be left out, e.g. "
          f"{other[:3]}. Convert them, or move them out.")
    return tfds.ImageFolder(root)
  names = sorted({q[0] for q in parts}) if depths == {1} else None
  files = ImageFiles(root, paths, names)
  if 2 in depths:  # most likely a split tree with strays: say why it is not
    stray = [p for p, q in zip(paths, parts) if len(q) != 3]
    files.note = (f" ({len(stray)} image(s) are not two levels down, e.g. "
                  f"{stray[:3]})")
  return files


def _folder_path(dataset: str) -> Optional[str]:
  if dataset.startswith("folder:"):
    return os.path.expanduser(dataset[len("folder:"):])
  if os.path.isdir(os.path.expanduser(dataset)):
    return os.path.expanduser(dataset)
  return None


def _online(host: str = "storage.googleapis.com", timeout: float = 4.0) -> bool:
  """Whether tfds' download host answers (a quick probe that never blocks
  for long)."""
  return net.online(host, timeout)


def _download_is_mocked() -> bool:
  """True inside ``tfds.testing.mock_data`` (preparing is a no-op there)."""
  fn = tfds.core.DatasetBuilder.download_and_prepare
  return getattr(fn, "__module__", "").startswith("tensorflow_datasets.testing")


def _not_prepared_message(name: str, data_dir: str, why: str,
                          flags=("--config.data_dir", "config.download is False")
                          ) -> str:
  return (
      f"Dataset {name!r} is not prepared in data_dir={data_dir!r} and {why}.\n"
      f"Prepare it on a machine with internet access and copy it here:\n"
      f"    tfds build {name} --data_dir={data_dir}\n"
      f"(or python -c \"import tensorflow_datasets as tfds; "
      f"tfds.builder('{name}', data_dir='{data_dir}').download_and_prepare()\"),"
      f"\nthen pass {flags[0]}={data_dir}. Datasets that need a manual "
      f"download (e.g. imagenet2012) must first be placed in "
      f"{os.path.join(data_dir, 'downloads', 'manual')}. Offline, the bundled "
      f"'digits' dataset (configs/digits.py) always works.")


def get_builder(dataset: str, data_dir: Optional[str] = None,
                download: bool = True,
                flags=("--config.data_dir", "config.download is False")):
  """A prepared tfds builder for ``dataset`` (catalogue name or image folder).

  ``flags``: the caller's own option for the data directory, and why it
  does not download (train.py's config fields; a CLI's ``--data-dir`` and
  ``--no-download``), as the error names them.
  Fails fast with :class:`DatasetNotPreparedError` when the data is missing
  and cannot be downloaded (offline, or ``download=False``).
  """
  folder = _folder_path(dataset)
  if folder is not None:
    return folder_builder(folder)
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
        _not_prepared_message(dataset, where, flags[1], flags))
  if not _online():
    raise DatasetNotPreparedError(_not_prepared_message(
        dataset, where, "this machine is offline (cannot reach "
        "storage.googleapis.com), so it cannot be downloaded", flags))
  try:
    builder.download_and_prepare()
  except Exception as e:  # network, manual-download and permission errors
    raise DatasetNotPreparedError(_not_prepared_message(
        dataset, where, f"downloading it failed: {type(e).__name__}: "
        f"{str(e)[:300]}", flags)) from e
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
  if isinstance(builder, ImageFiles):
    if split != ALL_SPLIT:
      raise ValueError(builder.split_error(split, what))
    return
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


def process_split(src_builder, split: str, index: int, count: int,
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
# at exit. Caching is ``config.cache``'s decision, made in
# :func:`vit_jax.data.batches.cached`.
_READ_CONFIG = tfds.ReadConfig(try_autocache=False)


def get_source(config, builder=None) -> DataSource:
  """Resolves ``config.dataset`` (+ splits) and reads its metadata
  (``builder``: its :func:`get_builder`, where the caller has it)."""
  if builder is None:
    builder = get_builder(config.dataset, config.data_dir, config.download,
                          flags=tuple(config.get("flags", None) or
                                      ("--config.data_dir",
                                       "config.download is False")))
  _check_split(builder, config.train_split, "config.train_split")
  _check_split(builder, config.eval_split, "config.eval_split")
  if isinstance(builder, ImageFiles):
    names = builder.label_names
    return DataSource(
        name=config.dataset, builder=builder, data_dir=config.data_dir,
        train_split=ALL_SPLIT, eval_split=ALL_SPLIT,
        num_classes=len(names or ()), label_names=names,
        num_train=len(builder.paths), num_eval=len(builder.paths),
        is_folder=True)
  is_folder = isinstance(builder, tfds.ImageFolder)
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
    _, counts[split] = process_split(builder, split, 0, 1, is_folder, False)
  return DataSource(
      name=config.dataset, builder=builder, data_dir=config.data_dir,
      train_split=config.train_split, eval_split=config.eval_split,
      num_classes=num_classes, label_names=names,
      num_train=counts[config.train_split], num_eval=counts[config.eval_split],
      is_folder=is_folder)
