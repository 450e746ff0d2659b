"""Shared helpers of the training tests (tiny configs, subprocess runners).

Training tests that need several host devices, several processes or a real
``kill`` run in subprocesses (XLA_FLAGS must be set before JAX starts).
"""

from __future__ import annotations

# No torch here: the test processes import torch and torchvision before
# TensorFlow (conftest.py: triton, which torchvision loads, crashes after
# TensorFlow), and the processes the tests start that import this file
# (the sharding run, the input pipeline's) need neither: 3.5-7 s of CPU each.

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
if REPO not in sys.path:
  sys.path.insert(0, REPO)

_DATA_DIR = None
# Subprocesses share a persistent XLA compilation cache: the runs of one test
# compile the same programs (it also makes no difference to the numbers).
# Under pytest, the test run's (conftest.py), shared with the test processes.
_JAX_CACHE = os.environ.get("VIT_JAX_TEST_XLA_CACHE")
if _JAX_CACHE is None:
  _JAX_CACHE = tempfile.mkdtemp(prefix="vit_jax_xla_cache_")
  atexit.register(shutil.rmtree, _JAX_CACHE, ignore_errors=True)
# Keys of metrics.jsonl rows that depend on wall time, not on the numbers.
TIMING_KEYS = {"img_per_sec", "eval_seconds", "time"}


def digits_data_dir() -> str:
  """A TFDS data_dir with the digits dataset prepared (once per session)."""
  global _DATA_DIR
  if _DATA_DIR is None:
    import tensorflow_datasets as tfds

    import vit_jax.data.digits  # noqa: F401

    path = tempfile.mkdtemp(prefix="vit_jax_tfds_")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    tfds.builder("digits", data_dir=path).download_and_prepare()
    _DATA_DIR = path
  return _DATA_DIR


def tiny_overrides(**kw) -> dict:
  """Overrides turning configs/digits.py into a seconds-long run."""
  o = {
      "data_dir": digits_data_dir(),
      "image_size": 8,
      "model_name": "vit_ti_4",
      "model.hidden_size": 32,
      "model.num_layers": 1,
      "model.num_heads": 2,
      "model.mlp_dim": 64,
      "batch_size": 16,
      "eval_batch_size": 64,
      "total_steps": 6,
      "warmup_steps": 2,
      "log_every": 2,
      "eval_every": 3,
      "checkpoint_every": 3,
      "learning_rate": 3e-3,
      "shuffle_buffer": 256,
      "write_plots": False,
      "tensorboard": False,
  }
  o.update(kw)
  return o


def tiny_config(**kw):
  """configs/digits.py with :func:`tiny_overrides` applied (and locked)."""
  from configs import digits

  return apply_overrides(digits.get_config(), tiny_overrides(**kw))


def apply_overrides(config, overrides: dict):
  """``config`` with ``{'a.b': value}`` overrides set, then locked."""
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  config.lock()
  return config


def cli_flags(overrides: dict) -> list:
  out = []
  for k, v in overrides.items():
    out.append(f"--config.{k}={v}")
  return out


def env(devices: int = 1, compile_cache: bool = True) -> dict:
  e = dict(os.environ)
  e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
  e["XLA_FLAGS"] = " ".join(f for f in (  # the session's (conftest.py) too
      os.environ.get("XLA_FLAGS", ""),
      f"--xla_force_host_platform_device_count={devices}") if f)
  e["TF_CPP_MIN_LOG_LEVEL"] = "2"
  if compile_cache:
    e["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE
    e["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  else:
    e.pop("JAX_COMPILATION_CACHE_DIR", None)
  e.setdefault("JAX_PLATFORMS", "cpu")
  return e


def train_cmd(workdir: str, overrides: dict, config: str = "configs/digits.py"):
  return [PYTHON, os.path.join(REPO, "train.py"), f"--config={config}",
          f"--workdir={workdir}"] + cli_flags(overrides)


def run(cmd, devices: int = 1, timeout: float = 300, check: bool = True,
        compile_cache: bool = True):
  p = subprocess.run(cmd, cwd=REPO, env=env(devices, compile_cache),
                     capture_output=True, text=True, timeout=timeout)
  if check and p.returncode != 0:
    raise AssertionError(f"{cmd} failed ({p.returncode}):\n{p.stdout[-3000:]}"
                         f"\n{p.stderr[-5000:]}")
  return p


def run_python(code: str, devices: int = 1, timeout: float = 600):
  """Runs ``code`` in a fresh interpreter; returns the JSON it prints last."""
  p = run([PYTHON, "-c", code], devices=devices, timeout=timeout)
  return json.loads(p.stdout.strip().splitlines()[-1])


def metric_rows(workdir: str) -> dict:
  """{step: merged numeric metrics} without start rows and timing keys."""
  from vit_jax.train import metrics

  out = {}
  for r in metrics.read_metrics(workdir):
    if r.get("event") == "start":
      continue
    row = {k: v for k, v in r.items() if k not in TIMING_KEYS and k != "step"}
    out.setdefault(r["step"], {}).update(row)
  return out


def start_rows(workdir: str) -> list:
  from vit_jax.train import metrics

  return [r for r in metrics.read_metrics(workdir) if r.get("event") == "start"]
