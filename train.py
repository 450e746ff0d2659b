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

import difflib
import os
import sys
import traceback

if __name__ == "__main__":
  # First of all: glibc keeps the step's freed temporaries for the next
  # step (vit_jax/train/host_memory.py; the process starts again once).
  from vit_jax.train import host_memory
  host_memory.reexec()
  # Before JAX starts a backend: XLA reads its flags once.
  from vit_jax.train import xla_flags
  xla_flags.apply()

from absl import app, flags, logging
from ml_collections import config_dict, config_flags

from vit_jax.data import console
from vit_jax.train import multihost

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


def _fields(config, prefix=""):
  """Every field of a ConfigDict, nested ones as 'model.dtype'."""
  out = []
  for k in sorted(config.keys()):
    v = config[k]
    if isinstance(v, config_dict.ConfigDict):
      out += _fields(v, f"{prefix}{k}.")
    else:
      out.append(prefix + k)
  return out


def _unknown_field(argv):
  """(the first ``--config.x`` override naming no field, the config file,
  its fields), or None."""
  files = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
  files += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
  if not files:
    return None
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=fv, sys_argv=argv[:1])
  try:
    fv([argv[0], f"--config={files[-1]}"])
    config = fv.config
  except Exception:  # pylint: disable=broad-except
    return None  # the file itself fails to load: main() says so
  names = _fields(config)
  for a in argv:
    if not a.startswith("--config."):
      continue
    path = a[len("--config."):].split("=", 1)[0].split("[", 1)[0]
    node = config
    for part in path.split("."):
      if not isinstance(node, config_dict.ConfigDict) or part not in node:
        return path, files[-1].split(":", 1)[0], names
      node = node[part]
  return None


def _parse_flags(argv):
  """absl's flag parsing, with every error as one ``train.py: error:`` line
  (a misspelt ``--config.field`` with the fields it could have meant)."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError) as e:
    unknown = None if isinstance(e, flags.Error) else _unknown_field(argv)
    if unknown is None:
      msg = " ".join(str(e).split())
      hint = " (train.py --helpshort lists the flags)"
    else:
      name, path, names = unknown
      close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
      close += [n for n in names if n.rsplit(".", 1)[-1] == name and
                n not in close]
      msg = f"unknown config field {name!r}"
      hint = (f" (did you mean {' or '.join(repr(c) for c in close)}?)"
              if close else "")
      hint += f"; the fields of {path} are: {', '.join(names)}"
    print(f"train.py: error: {msg}{hint}", file=sys.stderr, flush=True)
    sys.exit(2)


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
  # SIGTERM stops every process at one step through vit_jax.train.multihost, not
  # JAX's preemption service (whose sync point Orbax's commit thread moves).
  jax.config.update("jax_enable_preemption_service", False)
  peer_timeout = int(_CONFIG.value.get("peer_timeout_seconds", 300))
  limits = {} if peer_timeout <= 0 else dict(  # <= 0: JAX's defaults
      heartbeat_timeout_seconds=peer_timeout + 60,
      shutdown_timeout_seconds=peer_timeout)
  waits = multihost.Waits(
      _INIT_TIMEOUT.value, process_index=_PROCESS_ID.value,
      process_count=_NUM_PROCESSES.value, limit="--distributed_timeout")
  with waits.waiting(f"every process to join the coordinator at "
                     f"{_COORDINATOR.value or '(from the cluster)'}"):
    # JAX's own limits lie beyond ours, so ours speak first: a dead peer
    # (heartbeats) or a process that never joins ends with our message.
    jax.distributed.initialize(
        coordinator_address=_COORDINATOR.value,
        num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value,
        initialization_timeout=_INIT_TIMEOUT.value + 30, **limits)
  waits.close()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    _CONFIG.value.get("init_weights")  # ml_collections loads it lazily
  except OSError as e:  # a missing or unreadable config file
    why = " ".join(str(e.__cause__ or e).split())
    print(f"train.py: error: cannot load the --config file: {why}",
          file=sys.stderr, flush=True)
    sys.exit(2)
  if not flags.FLAGS["verbosity"].present:  # Orbax logs every save at INFO
    logging.set_verbosity(logging.WARNING)
  from vit_jax.train import checkpoint  # pylint: disable=import-outside-toplevel
  from vit_jax.data import synthetic  # pylint: disable=import-outside-toplevel

  # (A dataset that is not prepared raises a FileNotFoundError.)
  user_errors = (ValueError, FileNotFoundError, FloatingPointError,
                 checkpoint.CheckpointSaveError)
  try:
    _init_distributed()
    if not synthetic.is_synthetic(_CONFIG.value):  # synthetic: no TensorFlow
      import tensorflow as tf  # pylint: disable=import-outside-toplevel
      tf.config.set_visible_devices([], "GPU")  # tf.data only; JAX owns GPUs
    from vit_jax.train import loop as train_loop  # pylint: disable=import-outside-toplevel
    # The fields set on this command line: fine-tuning, the weights decide
    # the architecture, and only the model fields given here are applied
    # over them (or refused); the recipe's are used where they fit.
    stated = sorted(config_flags.get_override_values(flags.FLAGS["config"]))
    result = train_loop.train_and_evaluate(_CONFIG.value, _WORKDIR.value,
                                           stated=stated)
  except KeyboardInterrupt:
    # A second Ctrl-C (the first asks for a checkpoint after the step), or
    # one before the loop: one line, no traceback. A save in flight is left
    # as Orbax's temporary directory, which the next run removes.
    from vit_jax.train import loop as train_loop  # pylint: disable=import-outside-toplevel
    hint = train_loop.resume_hint(os.path.join(os.path.abspath(
        _WORKDIR.value), "checkpoints"))
    sys.stdout.flush()
    print(f"\ntrain.py: stopped by Ctrl-C. {hint}", file=sys.stderr,
          flush=True)
    os._exit(130)  # pylint: disable=protected-access
  except user_errors as e:
    if _TRACEBACK.value:
      traceback.print_exc()
    print(f"train.py: error: {type(e).__name__}: {e}", file=sys.stderr,
          flush=True)
    if isinstance(e, checkpoint.CheckpointSaveError):
      # The checkpoint manager is closed; Orbax's writer threads that ran
      # into the full disk can still be unwinding, and at interpreter
      # teardown they print "Event loop is closed" tracebacks under the
      # message above. Nothing is left to flush: leave without teardown.
      sys.stdout.flush()
      os._exit(1)  # pylint: disable=protected-access
    sys.exit(1)
  if result.get("stopped_by") == "Ctrl-C":
    sys.exit(130)  # stopped by the user, with a checkpoint


if __name__ == "__main__":
  # A notice (or a first Ctrl-C) during start-up counts too.
  multihost.install_sigterm_handler(ctrl_c=True)
  console.lean_start_up()
  console.quiet_native_logs()
  console.one_line_warnings()
  app.run(main, flags_parser=_parse_flags)
