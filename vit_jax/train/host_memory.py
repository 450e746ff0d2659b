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
with ``brk`` and keeps what is freed (the process keeps its peak size, as
a training job does anyway). glibc reads these variables when the process
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
