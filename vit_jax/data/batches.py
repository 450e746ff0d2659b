"""Batches: tfds datasets -> tf.data on the host -> global arrays.

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

No autotuning (``tf.data.Options().autotune``): deleting an iterator waits
for tf.data's autotuning thread, which in TensorFlow 2.21 can first sleep out
its optimisation period (up to 60 s). Measured on a loaded 2-core machine
(AMD EPYC Zen 3; pairs of short training runs beside two busy loops): with
autotuning, 3 of the 48 train and eval iterators of 16 runs took 2.4, 3.0
and 19.5 s to delete, each a stall of its run (at the end of a two-process
run, one longer than JAX's shutdown barrier waits); without it, none took
over 0.13 s. The maps run one call per core instead.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from vit_jax.data import preprocessing, sources, transforms
from vit_jax.data.sources import DataSource

def cached(ds: tf.data.Dataset) -> tf.data.Dataset:
  """``ds.cache()`` (in memory), filled now by one complete pass: every
  later iterator only reads it, so one that stops early (the end of a run)
  leaves no partly written cache behind."""
  ds = ds.cache()
  ds.reduce(np.int64(0), lambda n, _: n + 1)
  return ds


def _options() -> tf.data.Options:
  opts = tf.data.Options()
  opts.deterministic = True
  opts.autotune.enabled = False  # see the module docstring
  return opts


def parallel_calls() -> int:
  """Parallel calls of the per-example maps: one per core this process may
  run on (what autotuning converges to for CPU-bound decoding)."""
  try:
    return max(1, len(os.sched_getaffinity(0)))
  except AttributeError:  # not on Linux
    return max(1, os.cpu_count() or 1)


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
        sources.graph_fn(epoch_fn), cycle_length=1, block_length=1,
        sloppy=False, buffer_output_elements=1, prefetch_input_elements=1)
  finally:
    logger.setLevel(level)


def naflex_seq_len(seq_lens: Sequence[int], seed: int, step):
  """The sequence length of training step ``step`` (a tensor): one of
  ``seq_lens``, a function of ``(seed, step)`` only, so a resumed run
  draws the same lengths."""
  pick = tf.random.stateless_uniform(
      [], seed=tf.stack([tf.constant(_mix(seed, 3), tf.int64),
                         tf.cast(step, tf.int64)]),
      maxval=len(seq_lens), dtype=tf.int32)
  return tf.gather(tf.constant(list(seq_lens), tf.int32), pick)


def train_dataset(config, src: DataSource, *, local_batch: int,
                  start_step: int, process_index: int, process_count: int,
                  mean: Optional[Sequence[float]] = None,
                  std: Optional[Sequence[float]] = None,
                  naflex: Optional[Tuple[int, Sequence[int]]] = None):
  """Infinite stream of process-local training batches from ``start_step``.

  Yields dicts ``image`` (local_batch, S, S, 3) and ``label`` int32. Images
  are uint8 (a quarter of float32's bytes to the device), normalised inside
  the jitted step (:func:`vit_jax.train.step.normalize_images`); with
  ``mean`` and ``std`` they are normalised float32 here instead (the same
  numbers), for host-side consumers.

  ``naflex=(patch_size, seq_lens)``: NaFlex batches instead of images,
  ``patches`` (local_batch, L, P*P*3) uint8, ``patch_coord``,
  ``patch_valid``: each step draws one length ``L`` of ``seq_lens``
  (:func:`naflex_seq_len`) and every image of the batch keeps its crop's
  aspect ratio within ``L`` patches (:func:`vit_jax.data.transforms.
  preprocess_train_naflex`). A jitted step compiles once per length.
  """
  raw, n = sources.process_split(src.builder, src.train_split, process_index,
                          process_count, src.is_folder, drop_remainder=True)
  if n <= 0:
    raise ValueError(
        f"Process {process_index}/{process_count} gets no training examples "
        f"from {src.name!r} split {src.train_split!r} ({src.num_train} in "
        f"total).")
  if config.cache:
    raw = cached(raw)
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
    label = tf.cast(ex["label"], tf.int32)
    if naflex is not None:
      patch, seq_lens = naflex
      seq = naflex_seq_len(seq_lens, config.seed, i // int(local_batch))
      out = transforms.preprocess_train_naflex(
          ex["image"], seed, pp=pp, patch_size=patch, seq_len=seq, mean=mean,
          std=std)
      return dict(out, label=label)
    image = transforms.preprocess_train(ex["image"], seed, pp=pp, image_size=size,
                             mean=mean, std=std)
    return {"image": image, "label": label}

  ds = ds.map(sources.graph_fn(process), num_parallel_calls=parallel_calls())
  ds = ds.batch(local_batch, drop_remainder=True)
  ds = ds.prefetch(config.prefetch)
  return ds.with_options(_options())


def eval_dataset(config, src: DataSource, *, local_batch: int,
                 process_index: int, process_count: int,
                 mean: Optional[Sequence[float]] = None,
                 std: Optional[Sequence[float]] = None,
                 naflex: Optional[Tuple[int, int]] = None,
                 with_paths: bool = False
                 ) -> Tuple[tf.data.Dataset, int]:
  """(padded process-local eval batches with ``mask``, number of batches).

  All processes yield the same number of batches; padding examples have
  ``mask == 0`` (and zero pixels) so every real example is counted exactly
  once. Images are uint8, or normalised float32 with ``mean`` and ``std``
  (as in :func:`train_dataset`). ``naflex=(patch_size, seq_len)``: NaFlex
  batches of one length (:func:`vit_jax.data.transforms.
  preprocess_eval_naflex`: the whole image within ``seq_len`` patches).
  ``with_paths``: each example's file (``path``, bytes; ``b''`` for
  padding) where the dataset names it (image folders, tfds datasets with a
  file name feature).
  """
  counts = [sources.process_split(src.builder, src.eval_split, p, process_count,
                           src.is_folder, drop_remainder=False)[1]
            for p in range(process_count)]
  raw, n = sources.process_split(src.builder, src.eval_split, process_index,
                          process_count, src.is_folder, drop_remainder=False)
  assert n == counts[process_index], (n, counts)
  num_batches = max(1, math.ceil(max(counts) / local_batch))
  if config.cache:
    raw = cached(raw)
  size = config.image_size
  resize = preprocessing.eval_resize_size(config.pp.eval_crop_fraction, size)
  path_key = path_feature(raw) if with_paths else None

  def process(ex):
    if naflex is not None:
      out = transforms.preprocess_eval_naflex(
          ex["image"], patch_size=naflex[0], seq_len=int(naflex[1]),
          mean=mean, std=std)
    else:
      out = {"image": transforms.preprocess_eval(
          ex["image"], image_size=size, resize_size=resize, mean=mean,
          std=std)}
    if path_key is not None:
      out["path"] = ex[path_key]
    return dict(out, label=tf.cast(ex["label"], tf.int32),
                mask=tf.constant(1.0, tf.float32))

  ds = raw.map(sources.graph_fn(process), num_parallel_calls=parallel_calls())
  pad = num_batches * local_batch - n
  if pad:
    blank = {k: tf.zeros([int(naflex[1]) if d is None else d
                          for d in spec.shape], spec.dtype)
             for k, spec in ds.element_spec.items()}
    blank["mask"] = tf.constant(0.0, tf.float32)
    ds = ds.concatenate(tf.data.Dataset.from_tensors(blank).repeat(pad))
  ds = ds.batch(local_batch, drop_remainder=True).prefetch(config.prefetch)
  return ds.with_options(_options()), num_batches


# Features that name an example's file: image folders' (tfds' ImageFolder
# and sources.ImageFiles), and the file-name features of tfds datasets.
PATH_FEATURES = ("image/filename", "file_name", "filename")


def path_feature(raw: tf.data.Dataset) -> Optional[str]:
  """The feature of ``raw``'s examples that names their file, or None."""
  spec = raw.element_spec
  return next((k for k in PATH_FEATURES if isinstance(spec, dict) and
               k in spec and spec[k].dtype == tf.string), None)


# The run's (mean, std): in preprocessing (no TensorFlow), named here too.
normalization = preprocessing.run_normalization


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
