"""``--config.dataset=synthetic``: random uint8 images and labels made on the
devices, to measure a machine (the whole training loop against the step
alone) without a dataset, and without TensorFlow: nothing on this path
imports it.

    python train.py --config configs/b16.py --config.dataset=synthetic

Each global batch is a function of ``(seed, step)`` only, made by one
jitted function straight into the batch's sharding (every device makes its
own rows; nothing crosses from the host), so a resumed run sees the very
batches of an uninterrupted one. The labels are uniform over
``SYNTHETIC_CLASSES`` classes (or the config's ``num_classes`` where the
recipe sets one); evaluation is one batch of ``eval_batch_size`` images.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, List, Optional

NAME = "synthetic"
SYNTHETIC_CLASSES = 1000  # ImageNet's number: the head of the real job


@dataclasses.dataclass(frozen=True)
class SyntheticSource:
  """What the training loop reads of a data source (as
  :class:`vit_jax.data.sources.DataSource`)."""

  name: str
  num_classes: int
  num_train: int
  num_eval: int
  label_names: Optional[List[str]] = None
  is_folder: bool = False


def is_synthetic(config) -> bool:
  return str(config.dataset) == NAME


def get_source(config) -> SyntheticSource:
  classes = int(config.get("num_classes", None) or SYNTHETIC_CLASSES)
  return SyntheticSource(
      name=NAME, num_classes=classes,
      num_train=int(config.batch_size) * int(config.total_steps),
      num_eval=int(config.eval_batch_size))


def _make(key, *, batch: int, size: int, classes: int, with_mask: bool):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  k_img, k_lab = jax.random.split(key)
  out = {"image": jax.random.randint(k_img, (batch, size, size, 3), 0, 256,
                                     jnp.int32).astype(jnp.uint8),
         "label": jax.random.randint(k_lab, (batch,), 0, classes, jnp.int32)}
  if with_mask:
    out["mask"] = jnp.ones((batch,), jnp.float32)
  return out


def _maker(config, src: SyntheticSource, sharding, batch: int, eval_: bool):
  import jax  # pylint: disable=import-outside-toplevel
  return jax.jit(functools.partial(
      _make, batch=batch, size=int(config.image_size),
      classes=src.num_classes, with_mask=eval_), out_shardings=sharding)


def train_batches(config, src: SyntheticSource, sharding, *,
                  start_step: int) -> Iterator[dict]:
  """Global training batches from step ``start_step`` on (endless)."""
  import jax  # pylint: disable=import-outside-toplevel
  make = _maker(config, src, sharding, int(config.batch_size), False)
  key = jax.random.fold_in(jax.random.key(int(config.seed)), 1)
  step = int(start_step)
  while True:
    yield make(jax.random.fold_in(key, step))
    step += 1


def eval_batches(config, src: SyntheticSource, sharding) -> Iterator[dict]:
  """The evaluation split: one global batch, the same every time."""
  import jax  # pylint: disable=import-outside-toplevel
  make = _maker(config, src, sharding, int(config.eval_batch_size), True)
  yield make(jax.random.fold_in(jax.random.key(int(config.seed)), 2))
