"""The device mesh and where every array of a training run lives.

One ``Mesh`` over all devices (of every process): axes ``('data',)``, or
``('data', 'fsdp')`` when parameters and optimizer state are sharded. Batches
are split along their leading axis over every mesh axis; the train state is
replicated (data parallel) or split over ``fsdp``. Turning process-local
batches into global arrays is the input pipeline's last step
(:func:`vit_jax.data.batches.start_global`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def make_mesh(devices: Optional[Sequence[Any]] = None, fsdp: int = 1) -> Mesh:
  """All devices as ``('data',)``, or ``('data', 'fsdp')`` for ``fsdp > 1``.

  Args:
    devices: the devices of the mesh (default: all of ``jax.devices()``).
    fsdp: size of the ``fsdp`` axis; ``-1``: it spans every device.

  Returns:
    The mesh.
  """
  devices = list(devices if devices is not None else jax.devices())
  n = len(devices)
  f = n if fsdp == -1 else int(fsdp)
  if f < 1 or n % f:
    raise ValueError(f"config.fsdp={fsdp} must divide the number of devices "
                     f"({n}), or be -1 (all devices) / 1 (data parallel).")
  arr = np.array(devices, dtype=object)
  if f == 1:
    return Mesh(arr, ("data",))
  return Mesh(arr.reshape(n // f, f), ("data", "fsdp"))


def batch_sharding(mesh: Mesh, extra_leading: int = 0) -> NamedSharding:
  """Leading (batch) axis split over every mesh axis (after
  ``extra_leading`` unsplit axes, e.g. the micro-batch axis)."""
  return NamedSharding(mesh, P(*([None] * extra_leading), mesh.axis_names))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def _fsdp_spec(shape: Tuple[int, ...], size: int) -> P:
  """Shards the largest axis divisible by the fsdp size; else replicated."""
  if size <= 1 or not shape:
    return P()
  for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
    if shape[i] % size == 0:
      spec = [None] * len(shape)
      spec[i] = "fsdp"
      return P(*spec)
  return P()


def state_shardings(abstract_state, mesh: Mesh):
  """NamedShardings for every leaf of the state: replicated for data
  parallelism; parameters and optimizer state split over ``fsdp``."""
  size = mesh.shape.get("fsdp", 1)
  return jax.tree_util.tree_map(
      lambda x: NamedSharding(mesh, _fsdp_spec(tuple(x.shape), size)),
      abstract_state)


def with_shardings(abstract, shardings):
  """``jax.ShapeDtypeStruct`` leaves that carry their sharding (what Orbax
  restores onto)."""
  return jax.tree_util.tree_map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract, shardings)


def put_global(tree, shardings):
  """Host numpy tree (identical on all processes) -> global arrays."""
  def put(x, s):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])
  return jax.tree_util.tree_map(put, tree, shardings)


def to_host(tree):
  """Replicated (possibly multi-process) arrays -> host numpy. Blocks until
  they are computed."""
  def get(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      x = x.addressable_data(0)
    return np.asarray(x)
  return jax.tree_util.tree_map(get, tree)
