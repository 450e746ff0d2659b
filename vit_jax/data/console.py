"""The command line's surface: a clean first screen for the tools, one line
per warning (:func:`one_line_warnings`), and one spelling of their options
(:class:`Parser`).

While its native libraries load, TensorFlow logs INFO lines to stderr (the
oneDNN notice, the CPU feature guard, absl's "before InitializeLog" notice),
whatever ``TF_CPP_MIN_LOG_LEVEL`` says; later INFO lines (tf_record buffer
sizes, ...) obey it. :func:`quiet_native_logs`, called first by every CLI,
sets ``TF_CPP_MIN_LOG_LEVEL=1`` (INFO off; warnings and errors kept) unless
the user chose a level, and makes the first ``import tensorflow`` -- wherever
it happens, so import order is unchanged -- run with file descriptor 2
captured; what it wrote is then replayed without those INFO lines. Python
warnings and errors, and native warnings and errors, are never dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.abc
import importlib.machinery
import os
import re
import sys
import tempfile
import warnings

_INFO = re.compile(rb"^I\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w./-]+:\d+\] ")
_NOTICES = (
    b"WARNING: All log messages before absl::InitializeLog() is called are "
    b"written to STDERR",
    b"To enable the following instructions: ",  # the CPU feature guard's 2nd
)


def is_noise(line: bytes) -> bool:
  """A native INFO line (or one of the notices above)."""
  return bool(_INFO.match(line)) or line.startswith(_NOTICES)


@contextlib.contextmanager
def native_stderr_filtered():
  """Captures file descriptor 2 (native and Python writes alike) in the
  block, then writes it back without :func:`is_noise` lines."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      kept = b"".join(line for line in tmp if not is_noise(line))
      if kept:
        os.write(2, kept)


@contextlib.contextmanager
def held_back():
  """Holds back everything written to stdout and stderr in the block
  (Python and native writes alike: progress bars, notices); it is written
  to stderr only if the block raises, so a failure keeps its context."""
  sys.stdout.flush()
  sys.stderr.flush()
  saved = [os.dup(1), os.dup(2)]
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 1)
    os.dup2(tmp.fileno(), 2)
    failed = False
    try:
      yield
    except BaseException:
      failed = True
      raise
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      for fd, dup in zip((1, 2), saved):
        os.dup2(dup, fd)
        os.close(dup)
      if failed:
        tmp.seek(0)
        os.write(2, tmp.read())


class _QuietLoader(importlib.abc.Loader):
  """Runs the wrapped loader's ``exec_module`` in
  :func:`native_stderr_filtered`."""

  def __init__(self, loader):
    self._loader = loader

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    # Put the real loader back first: nothing should see this wrapper. The
    # finder is done once the module really imports (a library that only
    # asks whether TensorFlow is installed, find_spec without an import,
    # must not use it up).
    module.__loader__ = module.__spec__.loader = self._loader
    for f in [f for f in sys.meta_path if isinstance(f, _FirstImport)]:
      sys.meta_path.remove(f)
    later = _Later()
    sys.meta_path.insert(0, later)
    try:
      with native_stderr_filtered():
        self._loader.exec_module(module)
    finally:
      sys.meta_path.remove(later)


class _Later(importlib.abc.MetaPathFinder):
  """While TensorFlow imports: Keras' optimizers refused, as TensorFlow
  expects when Keras is absent (it imports them eagerly for their
  SavedModel registrations, in a ``try`` that passes on ImportError). They
  load with Keras, if the program imports it: our tools never do. A third
  of TensorFlow's import (7.0 -> 4.7 s of CPU on an AMD Zen 1) in every
  process of train.py and the CLIs that reads a dataset."""

  def find_spec(self, name, path=None, target=None):
    del path, target
    if name == "keras.src.optimizers":
      raise ModuleNotFoundError(f"{name}: loaded with Keras, not with "
                                "TensorFlow (vit_jax.data.console)",
                                name=name)
    return None


class _FirstImport(importlib.abc.MetaPathFinder):
  """Finds ``tensorflow`` with a :class:`_QuietLoader` until it is
  imported."""

  def find_spec(self, name, path=None, target=None):
    del target
    if name != "tensorflow" or "tensorflow" in sys.modules:
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is not None and spec.loader is not None:
      spec.loader = _QuietLoader(spec.loader)
    return spec


def quiet_native_logs():
  """Native INFO lines off, the first screen our own (see the module doc).

  Safe to call more than once; does nothing to an already imported
  TensorFlow.
  """
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
  if "tensorflow" in sys.modules:
    return
  if not any(isinstance(f, _FirstImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _FirstImport())


def _set_aside_survivors(phase, info):
  if phase == "stop" and info.get("generation") == 2:
    gc.freeze()


def lean_start_up():
  """For a program's start-up (every CLI calls it first): what survives
  one of Python's full garbage collections is set aside from the later ones
  (``gc.freeze``), until :func:`start_up_done`.

  Python's cyclic collector examines every live object again each time
  their number has grown by a quarter. A program that imports jax,
  TensorFlow and tfds and prepares its data grows to half a million
  objects that live as long as it does, and examining them again and again
  took an eighth of a short ``train.py`` run's CPU (the digits, 6 steps:
  24.4 s instead of 27.8, medians of three alternated runs, on an AMD Zen
  3). Objects set aside
  are never collected as cyclic garbage; only those alive at a full
  collection during start-up are (the training loop calls
  :func:`start_up_done` before its first step; the other tools are short).
  Safe to call more than once."""
  if _set_aside_survivors not in gc.callbacks:
    gc.callbacks.append(_set_aside_survivors)


def start_up_done():
  """Ends :func:`lean_start_up`: objects made from now on are collected
  as Python's defaults say (nothing if it was not called)."""
  if _set_aside_survivors in gc.callbacks:
    gc.callbacks.remove(_set_aside_survivors)


def one_line_warnings():
  """Python warnings as one line each on stderr, ``warning: <message>``
  (``warning: <Category>: <message>`` for other libraries' warnings),
  instead of Python's ``file.py:80: Category: message`` and a line of the
  source that warned. For the command-line tools (their ``__main__``):
  a library keeps Python's display."""

  def show(message, category, filename, lineno, file=None, line=None):
    del filename, lineno, line
    stream = file if file is not None else sys.stderr
    if stream is None:
      return
    text = " ".join(str(message).split())
    ours = category.__module__.split(".")[0] == "vit_jax"
    try:
      stream.write(f"warning: {text}\n" if ours else
                   f"warning: {category.__name__}: {text}\n")
      stream.flush()
    except (OSError, ValueError):  # a closed or broken stream
      pass

  warnings.showwarning = show


class Parser(argparse.ArgumentParser):
  """``argparse.ArgumentParser`` whose long options take ``_`` or ``-``
  alike (``--image_size`` is ``--image-size``)."""

  def parse_known_args(self, args=None, namespace=None):
    args = list(sys.argv[1:] if args is None else args)
    known = {s for a in self._actions for s in a.option_strings}
    out = []
    for i, a in enumerate(args):
      if a == "--":  # everything after it is positional
        out.extend(args[i:])
        break
      if a.startswith("--") and "_" in a:
        name, eq, value = a.partition("=")
        dashed = name.replace("_", "-")
        if name not in known and dashed in known:
          a = dashed + eq + value
      out.append(a)
    return super().parse_known_args(out, namespace)
