"""XLA flags the training job sets unless ``XLA_FLAGS`` names them already.

XLA reads ``XLA_FLAGS`` once, when JAX starts its first backend, so
:func:`apply` runs first of all in ``train.py`` (and in
``bench/accelerator.py``, which measures the same step), before any array
is made. Each flag here was measured where it acts, and none changes what
a CPU computes:

* ``--xla_gpu_enable_triton_gemm=false``: XLA:GPU's dense layers as
  cuBLAS GEMMs rather than Triton ones. ViT-B/16's bfloat16 train step at
  batch 256 on one H200, alternated in one call: 3,574 / 3,573 to 3,693
  img/s (+3.3 %) on main, 3,663 / 3,661 to 3,768 / 3,765 (+2.9 %) with
  the GELU change; on an H100 on 2026-11-26, 2,797 / 2,783 to 2,829
  (+1.1 to +1.7 %). ViT-L/16 at batch 128 ran the same with either
  (1,167 img/s). docs/accelerators.md.

A flag the user's ``XLA_FLAGS`` names keeps the user's value
(``XLA_FLAGS=--xla_gpu_enable_triton_gemm=true`` brings Triton back).
"""

from __future__ import annotations

import os
from typing import MutableMapping, Optional, Sequence

DEFAULTS: Sequence[str] = ("--xla_gpu_enable_triton_gemm=false",)


def _name(flag: str) -> str:
  return flag.split("=", 1)[0].lstrip("-")


def with_defaults(flags: str) -> str:
  """``flags`` (an ``XLA_FLAGS`` value) with each of :data:`DEFAULTS` it
  does not name appended."""
  named = {_name(f) for f in flags.split()}
  extra = [d for d in DEFAULTS if _name(d) not in named]
  return " ".join([f for f in [flags.strip()] if f] + extra)


def apply(environ: Optional[MutableMapping[str, str]] = None) -> None:
  """Sets ``XLA_FLAGS`` in ``environ`` (this process's by default) to
  :func:`with_defaults` of its value."""
  env = os.environ if environ is None else environ
  env["XLA_FLAGS"] = with_defaults(env.get("XLA_FLAGS", ""))
