"""Test-session setup shared by all test files."""

import atexit
import os
import shutil
import tempfile

# The suite compiles hundreds of small XLA programs and runs each a few
# times: compiling is half its time. XLA's LLVM backend at -O0 compiles them
# about 30 % faster (tests/models/test_naflex_model.py: 44.7 s -> 32.1 s on
# an Intel Xeon) and runs these sizes about as fast; the programs (HLO) are
# XLA's, unchanged (no fast-math either way). XLA's CPU code for fused
# elementwise ops from its older emitters, in one LLVM module per program
# instead of parallel pieces, takes another third less CPU to compile (the
# same file: 59.0 -> 38.4 s of CPU on an AMD Zen 1) and runs as fast; its
# exp / erf / tanh differ from the new emitters' in the last bits (1e-6 of
# a gradient's scale), and timm parity is the same to three digits either
# way (vit_jax.weights.verify on eight families). Set in the environment,
# so that the CLIs and train.py the tests start get them too;
# VIT_JAX_TEST_XLA_OPT=1 keeps XLA's defaults, and so does a machine with
# an accelerator plugin for JAX (CUDA, ROCm, TPU) unless JAX_PLATFORMS=cpu:
# the optimisation level applies to every backend's code (on an H200,
# 2026-11-27, tests/models/test_gpu.py under these flags finished no test
# within 150 s; before they were added it passed in 129 s).
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0",
                  "--xla_cpu_use_fusion_emitters=false",
                  "--xla_cpu_parallel_codegen_split_count=1")


def _accelerator_plugin() -> bool:
  """Whether JAX may run on an accelerator here: a plugin package
  (``jax_plugins.*``: CUDA, ROCm) or libtpu installed, and JAX_PLATFORMS
  not ``cpu``."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
    return False
  return any(importlib.util.find_spec(m) is not None
             for m in ("jax_plugins", "libtpu"))


if os.environ.get("VIT_JAX_TEST_XLA_OPT") != "1" and not _accelerator_plugin():
  os.environ["XLA_FLAGS"] = " ".join(f for f in (
      os.environ.get("XLA_FLAGS", ""), *TEST_XLA_FLAGS) if f)

def _run_folder(name: str) -> str:
  """The run's temporary folder ``os.environ[name]``: made by the first
  process to load this file (the controller, or a plain run) and removed
  at its exit; the workers and children inherit its path."""
  if name not in os.environ:
    os.environ[name] = tempfile.mkdtemp(prefix=name.lower() + "_")
    atexit.register(shutil.rmtree, os.environ[name], ignore_errors=True)
  return os.environ[name]


# One persistent XLA compilation cache per test run, in a temporary folder
# (never the user's), shared by pytest-xdist's workers and every process the
# tests start: the same small programs are compiled by many tests in each
# process and by both workers. The cache keys on the program and XLA's
# flags, so the numbers are those of a fresh compile.
os.environ["JAX_COMPILATION_CACHE_DIR"] = _run_folder("VIT_JAX_TEST_XLA_CACHE")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


# Python's byte code written as Python does by default (``__pycache__``
# beside the sources, which git ignores), for the test processes and every
# process they start. Where the environment says not to write it
# (PYTHONDONTWRITEBYTECODE, set on the machines this suite runs on), each of
# the ~100 processes the tests start compiled vit_jax's 22,000 lines from
# source again (0.2-0.3 s each, 21 s of the suite's CPU in a py-spy
# census). A temporary PYTHONPYCACHEPREFIX would keep the sources' folders
# clean but hides the installed packages' own byte code: the run's first
# processes compiled torch, jax, TensorFlow, timm ... again (importing
# them took 40 s of CPU instead of 14-16 on an AMD Zen 3, in each worker
# starting at once). VIT_JAX_TEST_PYCACHE=off keeps the environment's
# choice.
if os.environ.get("VIT_JAX_TEST_PYCACHE") != "off":
  os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
  import sys  # pylint: disable=g-import-not-at-top
  sys.dont_write_bytecode = False


def _one_mlir_context_per_thread():
  """JAX makes a new MLIR context for every program it lowers, loading
  every dialect into it: 5 ms each, a fifth of an op's compile when a
  model runs eagerly (each op its own program; the suite compiles
  thousands). Here one context per thread is made once and reused; the
  programs, and so what XLA compiles, are the same (contexts only intern
  types and attributes). Tests only: a library should not patch JAX.
  VIT_JAX_TEST_MLIR_CONTEXT=new keeps JAX's own."""
  import threading  # pylint: disable=import-outside-toplevel
  if os.environ.get("VIT_JAX_TEST_MLIR_CONTEXT") == "new":
    return
  try:
    from jax._src.interpreters import mlir  # pylint: disable=import-outside-toplevel
  except ImportError:
    return
  make = getattr(mlir, "make_ir_context", None)
  if make is None or getattr(make, "reused", False):
    return
  local = threading.local()

  def make_ir_context():
    context = getattr(local, "context", None)
    if context is None:
      context = local.context = make()
    return context
  make_ir_context.reused = True
  mlir.make_ir_context = make_ir_context


_one_mlir_context_per_thread()


def _one_onnx_registry_per_opset():
  """``torch.onnx.export`` builds its table of ONNX functions anew on every
  call, parsing the source of each of torchlib's ~500 functions: 1.8 s of
  an ONNX export's 7.3 s of CPU (a ViT-Ti, AMD Zen 3), and the suite
  exports to ONNX a few dozen times. Here each opset's table is built once
  per process and every export gets a copy of it (a custom translation
  table adds to the copy); the graph, and so the ONNX file, are the same.
  Tests only, as the MLIR contexts above. VIT_JAX_TEST_ONNX_REGISTRY=new
  keeps torch's own."""
  if os.environ.get("VIT_JAX_TEST_ONNX_REGISTRY") == "new":
    return
  try:
    from torch.onnx._internal.exporter import _registration  # pylint: disable=import-outside-toplevel
  except ImportError:
    return
  registry = getattr(_registration, "ONNXRegistry", None)
  build = getattr(registry, "from_torchlib", None)
  if build is None or getattr(build, "reused", False):
    return
  built = {}

  def from_torchlib(cls, *args, **kwargs):
    key = (cls, args, tuple(sorted(kwargs.items())))
    if key not in built:
      built[key] = build.__func__(cls, *args, **kwargs)
    one = built[key]
    copy = cls()
    copy.__dict__.update(one.__dict__)
    copy.functions = {k: list(v) for k, v in one.functions.items()}
    return copy
  from_torchlib.reused = True
  registry.from_torchlib = classmethod(from_torchlib)


_one_onnx_registry_per_opset()

# Freed memory kept for the next test (this process only: the processes the
# tests start keep their own settings, train.py its vit_jax.train.host_memory).
# glibc hands every freed block over 32 MiB back to the kernel, and on the
# VMs this suite runs on a page touched for the first time costs more than
# the copy into it (a 320 MB copy into new memory 0.4-0.6 GB/s, into memory
# touched before 12 GB/s): the large models' weights, copied between timm,
# ours and back, and the large programs' buffers were faulted in anew each
# time. Here glibc serves large blocks from its heap and keeps up to
# ``TRIM_BYTES`` of freed memory on top of it; :func:`pytest_runtest_teardown`
# hands free pages back to the kernel when a worker's resident size passes
# ``RESIDENT_LIMIT`` between tests. VIT_JAX_TEST_MALLOC=default keeps glibc's.
TRIM_BYTES = 2 ** 31 - 1  # mallopt takes an int
RESIDENT_LIMIT = 6 * 2 ** 30


def _keep_freed_memory() -> bool:
  import ctypes  # pylint: disable=import-outside-toplevel
  import platform  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  if (os.environ.get("VIT_JAX_TEST_MALLOC") == "default" or
      not sys.platform.startswith("linux") or
      platform.libc_ver()[0] != "glibc"):
    return False
  try:
    libc = ctypes.CDLL("libc.so.6")
  except OSError:
    return False
  m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
  return bool(libc.mallopt(m_mmap_max, 0) and
              libc.mallopt(m_trim_threshold, TRIM_BYTES))


_KEEPS_FREED_MEMORY = _keep_freed_memory()

# numpy asks the kernel for transparent huge pages for its large arrays
# (``madvise``); with these VMs' ``defrag=madvise`` the first touch of such
# an array waits while the kernel compacts memory for them. Converting the
# largest names' weights (timm's ViT-7B, AIMv2-3B, PE-G, DINOv2-g and
# giant, EVA-02-E at two blocks) took 5.6-6.0 s of CPU with them and 2.3-2.4
# s without (1.5-2.4 s less wall over the six checks, alternated in one
# command on an AMD Zen 3); torchvision's ViT-H/14 scanned, 9.4 s against
# 2.1 s. The test processes and every process they start, unless set:
# NUMPY_MADVISE_HUGEPAGE=1 keeps numpy's default.
os.environ.setdefault("NUMPY_MADVISE_HUGEPAGE", "0")


def _numpy_hugepages():
  """The setting for this process too, where numpy came before it."""
  import sys  # pylint: disable=import-outside-toplevel
  if "numpy" not in sys.modules:
    return  # numpy reads the environment when it is imported
  try:
    from numpy._core import multiarray  # pylint: disable=import-outside-toplevel
  except ImportError:
    return
  setter = getattr(multiarray, "_set_madvise_hugepage", None)
  if setter is not None:
    setter(os.environ["NUMPY_MADVISE_HUGEPAGE"] != "0")


_numpy_hugepages()

# torch on one thread in the test processes and the processes they start
# (unless OMP_NUM_THREADS is set): pytest-xdist runs one worker per core,
# so the cores are busy already, and torch's idle OpenMP threads spin
# between the suite's many small ops. The parity tests take 11 % less wall
# time (tests/weights/test_families.py, test_parity.py, test_hybrid.py on
# two workers: 227 / 227 s -> 203 / 199 s on an AMD Zen 1, alternated in one
# command, all 81 passing either way).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# torch/torchvision must be imported before TensorFlow: importing torchvision
# (which loads triton) after TensorFlow crashes the process on this stack.
# Test files import both, in an order pytest chooses, so fix it here.
try:
  import torch  # noqa: F401
  import torchvision  # noqa: F401
except ImportError:  # the torch-free parts of the suite still run
  pass


import pytest  # noqa: E402


@pytest.fixture
def record_property(request):
  """pytest's ``record_property``, the value kept as a plain float (a
  relative error: :class:`compare.Closeness` gives its ``rel``) or str, so
  that pytest-xdist's workers can send it to the controller."""
  def record(name, value):
    value = getattr(value, "rel", value)
    try:
      value = float(value)
    except (TypeError, ValueError):
      value = str(value)
    request.node.user_properties.append((name, value))
  return record


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
  """One seconds-long training run on the bundled digits (``tiny_config()``,
  an Orbax workdir), shared by every test that only reads it."""
  import jax  # pylint: disable=import-outside-toplevel
  from train_helpers import tiny_config  # pylint: disable=import-outside-toplevel
  from vit_jax import train as train_lib  # pylint: disable=import-outside-toplevel

  workdir = tmp_path_factory.mktemp("digits_run")
  cfg = tiny_config()
  train_lib.train_and_evaluate(cfg, str(workdir), devices=jax.devices()[:1])
  return str(workdir), cfg


def _xla_cpu_threads(config):
  """XLA's CPU threads per process: the cores over pytest-xdist's workers
  (``PJRT_NPROC``, the size of XLA's CPU client's thread pool; unless set),
  as torch's above: the workers (one per core) and the processes they
  start share the cores already. Alone on a 2-core AMD Zen 3, the same 54
  registry checks took 58.0 / 60.6 s of CPU on one thread against 66.5 /
  67.3 on two (alternated), and less wall time; in the whole suite the
  tests' own CPU stayed the same (1,938 -> 1,959 s, docs/development.md):
  there the cores were never idle for a second thread to spin on. A run
  without workers keeps XLA's default."""
  workers = len(getattr(config.option, "tx", None) or ())
  if (workers < 2 or "PJRT_NPROC" in os.environ or
      hasattr(config, "workerinput")):
    return
  try:
    cpus = len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    cpus = os.cpu_count() or 1
  os.environ["PJRT_NPROC"] = str(max(1, cpus // workers))


def pytest_configure(config):
  """``VIT_JAX_SUITE_PROFILE=FILE``: where each test's time goes, one JSON
  line per test (tests/suite_profile.py). XLA's threads per worker
  (:func:`_xla_cpu_threads`)."""
  _xla_cpu_threads(config)
  path = os.environ.get("VIT_JAX_SUITE_PROFILE")
  if path:
    import suite_profile  # pylint: disable=import-outside-toplevel
    config.pluginmanager.register(suite_profile.SuiteProfile(path),
                                  "suite_profile")


def _slow_list():
  """The node ids of tests/slow_tests.txt (``seconds node-id`` lines)."""
  path = os.path.join(os.path.dirname(__file__), "slow_tests.txt")
  with open(path) as f:
    return {line.split(maxsplit=1)[1].strip() for line in f
            if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(config, items):
  """Marks ``slow`` the tests tests/slow_tests.txt lists (measured: each
  took 2 s or more), so that ``pytest -m "not slow"`` is a first answer in
  minutes that still runs every test file; the README's command runs all."""
  slow = _slow_list()
  for item in items:
    if item.nodeid in slow:
      item.add_marker(pytest.mark.slow)
  _xdist_groups(config, items)


def _xdist_groups(config, items):
  """``--dist loadgroup``'s ``xdist_group`` marks, as pytest-xdist 3.8 means
  them: it appends ``@group`` to each marked test's node id on the workers
  (which the controller's scheduler groups by) by setting ``_nodeid``, which
  pytest 9 no longer reads (a node's id is its ``_id``), so every marked
  test went to any worker (the sharding file's shared run was computed by
  both). Done here through ``_id`` where pytest has it."""
  if not getattr(config.option, "loadgroup", False):
    return
  try:
    from _pytest.nodeid import NodeId  # pylint: disable=import-outside-toplevel
  except ImportError:  # pytest < 9: pytest-xdist's own renaming works
    return
  for item in items:
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name",
                                                                 "default"))
                    for m in item.iter_markers("xdist_group")})
    if names and "@" not in item.nodeid and hasattr(item, "_id"):
      item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")  # pylint: disable=protected-access


def pytest_collection_finish(session):  # pylint: disable=unused-argument
  """Python's cyclic garbage collector in the test processes: the modules,
  classes and collected tests (half a million objects) set aside from its
  later passes (``gc.freeze``), and its youngest generation collected every
  10,000 new objects rather than 700. It took 3.6 % of a registry run's CPU
  (91 names: 4.5 s of 126) and 1.9 s with these settings; every object
  made by the tests is still collected. VIT_JAX_TEST_GC=default keeps
  Python's. (The programs the tests start set their own:
  ``vit_jax.data.console.lean_start_up``.)"""
  if os.environ.get("VIT_JAX_TEST_GC") == "default":
    return
  import gc  # pylint: disable=import-outside-toplevel
  gc.collect()
  gc.freeze()
  gc.set_threshold(10_000, 10, 10)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):  # pylint: disable=unused-argument
  """Bounds what this process keeps of freed memory (``_keep_freed_memory``):
  past ``RESIDENT_LIMIT`` resident after a test, glibc's free pages go back
  to the kernel."""
  if not _KEEPS_FREED_MEMORY:
    return
  from vit_jax.train import host_memory  # pylint: disable=import-outside-toplevel
  if host_memory.resident_bytes() > RESIDENT_LIMIT:
    host_memory.trim()
