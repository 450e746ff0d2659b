r"""Trains a Vision Transformer.

    python train.py --config configs/digits.py --workdir /tmp/digits
    python train.py --config configs/b16.py:cifar100 --workdir /tmp/b16 \
        --config.total_steps=500 --config.batch_size=128

``--config`` is a config file, optionally with a parameter string
(``file.py:arg``); ``--config.field=value`` overrides a field (configs are
locked: a misspelt field is an error). Running the same command again resumes
from the workdir's latest checkpoint.

Several hosts (or local processes) train together with::

    python train.py ... --coordinator_address=10.0.0.1:1234 \
        --num_processes=2 --process_id=0     # and =1 on the other

or ``--distributed`` where a cluster environment (SLURM, TPU pods...) lets
``jax.distributed.initialize()`` find them itself. CPU processes talk through
gloo collectives.
"""

import sys
import traceback

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Training config: configs/<recipe>.py[:arg].",
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Output directory: checkpoints/, config.json, "
    "metrics.jsonl, TensorBoard events, curves.png. Reused to resume.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "host:port of process 0, for multi-process training.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Number of processes (multi-process training).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "Index of this process in [0, num_processes).")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() without "
    "arguments (cluster environments that describe the processes).")
_INIT_TIMEOUT = flags.DEFINE_integer(
    "distributed_timeout", 300, "Seconds to wait for all processes to join.")
_TRACEBACK = flags.DEFINE_bool(
    "traceback", False, "Show the full traceback of configuration errors.")

flags.mark_flags_as_required(["config", "workdir"])


def _init_distributed():
  import jax  # pylint: disable=import-outside-toplevel

  explicit = (_COORDINATOR.value is not None or _NUM_PROCESSES.value is not None
              or _PROCESS_ID.value is not None)
  if not explicit and not _DISTRIBUTED.value:
    return
  if explicit and None in (_COORDINATOR.value, _NUM_PROCESSES.value,
                           _PROCESS_ID.value):
    raise ValueError(
        "Multi-process training needs all of --coordinator_address, "
        "--num_processes and --process_id (or --distributed alone in a "
        f"cluster environment); got coordinator_address={_COORDINATOR.value}, "
        f"num_processes={_NUM_PROCESSES.value}, process_id={_PROCESS_ID.value}.")
  if explicit and not 0 <= _PROCESS_ID.value < _NUM_PROCESSES.value:
    raise ValueError(f"--process_id={_PROCESS_ID.value} must be in "
                     f"[0, {_NUM_PROCESSES.value}).")
  # Several CPU processes exchange gradients through gloo.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=_COORDINATOR.value,
      num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value,
      initialization_timeout=_INIT_TIMEOUT.value)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:  # Orbax logs every save at INFO
    logging.set_verbosity(logging.WARNING)
  if _CONFIG.value.init_weights:
    # torchvision (and the triton it imports) must be loaded before
    # TensorFlow: the other order crashes the process.
    import torch  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import torchvision  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  from vit_jax import input_pipeline  # pylint: disable=import-outside-toplevel

  user_errors = (ValueError, FileNotFoundError, FloatingPointError,
                 input_pipeline.DatasetNotPreparedError)
  try:
    _init_distributed()
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf.config.set_visible_devices([], "GPU")  # tf.data only; JAX owns GPUs
    from vit_jax import train_lib  # pylint: disable=import-outside-toplevel
    train_lib.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except user_errors as e:
    if _TRACEBACK.value:
      traceback.print_exc()
    print(f"train.py: error: {type(e).__name__}: {e}", file=sys.stderr,
          flush=True)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
