"""Keep freed host memory for the next step (glibc on Linux).

XLA:CPU allocates one block for all of a step's temporaries (746 MiB for
a ViT-Ti/16 train step at batch 16) at every execution and frees it at the
end. glibc hands any block over 32 MiB back to the kernel when it is freed
(a worker thread's arena even maps it anew whatever the thresholds), so
every step faults in every page of that block again: about 190,000 page
faults and a sixth of the step's CPU time in the kernel, measured with
``bench/ops.py`` / ``bench/ab.py`` (bench/README.md). torch does not pay
this (its tensors are each under 32 MiB, which glibc keeps).

``MALLOC_ENV`` makes glibc serve every thread from one arena that grows
with ``brk`` and keeps what is freed. Kept memory is not always reused:
glibc now and then splits the freed block for small allocations, and the
next step's block then comes from new memory; left alone, a Ti/16 train
loop grew from 1.3 GiB to 4.3-5.0 GiB resident in 40-270 steps, and a long
benchmark child to 8 GiB, where the OOM killer ended it. :class:`HeapGuard`
bounds it: called once per step, it hands the heap's free pages back
(``malloc_trim``) when the resident size has grown past ``factor`` times
what it was once the steps settled (Ti/16, 400 steps: 2.0 GiB settled,
3.5 GiB at the peak, 2.0 GiB at the end; 200 steps took 90.0 s guarded
and 89.8 s unguarded, on a Zen 5). glibc reads these variables when the process
starts, so :func:`reexec` starts the process again with them set
(``os.execv``: the same PID, arguments and interpreter options), before
anything else runs. ``VIT_JAX_KEEP_HOST_MEMORY=0`` turns it off; a process
that already sets any of the variables is left as it is.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Mapping, Optional

MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "1",  # one arena: it grows with brk, as set below
    "MALLOC_MMAP_MAX_": "0",  # no block of its own mapping
    "MALLOC_TRIM_THRESHOLD_": str(64 * 2 ** 30),  # keep freed memory
}
SWITCH = "VIT_JAX_KEEP_HOST_MEMORY"


def wanted(environ: Optional[Mapping[str, str]] = None) -> bool:
  """Whether :func:`reexec` would start the process again: Linux with
  glibc, not switched off, and none of the variables set by the user."""
  env = os.environ if environ is None else environ
  if env.get(SWITCH, "1") == "0" or not sys.platform.startswith("linux"):
    return False
  if platform.libc_ver()[0] != "glibc":
    return False
  return not any(k in env for k in MALLOC_ENV)


def reexec() -> None:
  """Starts this Python process again with :data:`MALLOC_ENV` (see the
  module's docstring); returns when there is nothing to do."""
  if not wanted():
    return
  argv = list(getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv)
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable] + argv[1:],
            dict(os.environ, **MALLOC_ENV))


def in_effect(environ: Optional[Mapping[str, str]] = None) -> bool:
  """Whether this process runs with :data:`MALLOC_ENV` (glibc keeping
  freed memory)."""
  env = os.environ if environ is None else environ
  return (sys.platform.startswith("linux") and
          platform.libc_ver()[0] == "glibc" and
          all(env.get(k) == v for k, v in MALLOC_ENV.items()))


def resident_bytes() -> int:
  """This process's resident set size (Linux ``/proc/self/statm``); 0
  where there is none."""
  try:
    with open("/proc/self/statm", encoding="ascii") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return 0


def trim() -> bool:
  """Hands the free pages of glibc's heap back to the kernel
  (``malloc_trim(0)``); False where there is no glibc."""
  try:
    import ctypes  # pylint: disable=import-outside-toplevel
    return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
  except (OSError, AttributeError):
    return False


class HeapGuard:
  """Keeps a process that runs with :data:`MALLOC_ENV` from growing without
  bound (see the module's docstring). Call :meth:`step` once per step: after
  ``settle`` calls it records the resident size, and from then on it calls
  :func:`trim` whenever the resident size exceeds ``factor`` times that.
  Does nothing in a process without :data:`MALLOC_ENV` (``active``)."""

  def __init__(self, factor: float = 1.5, settle: int = 3,
               active: Optional[bool] = None):
    self.factor, self.settle = factor, settle
    self.active = in_effect() if active is None else active
    self.calls, self.baseline, self.trims = 0, 0, 0

  def step(self) -> bool:
    """Returns whether this call trimmed the heap."""
    if not self.active:
      return False
    self.calls += 1
    if self.calls < self.settle:
      return False
    rss = resident_bytes()
    if not self.baseline:
      self.baseline = rss
      return False
    if rss > self.factor * self.baseline:
      self.trims += 1
      return trim()
    return False
