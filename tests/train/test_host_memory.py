"""train.py starts itself again with glibc's malloc set to keep freed
memory (vit_jax/train/host_memory.py): the step's temporaries are then
not faulted in anew at every step. The same process (PID), arguments and
interpreter options; the user's own settings and the switch are kept."""

import os
import platform
import subprocess
import sys

import pytest

from train_helpers import PYTHON, REPO
from vit_jax.train import host_memory

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

PROBE = r"""
import os, sys
if __name__ == "__main__":
  from vit_jax.train import host_memory
  print("before", os.getpid(), flush=True)
  host_memory.reexec()
  print("after", os.getpid(), sys.argv[1:], sys.flags.optimize,
        [os.environ.get(k) for k in sorted(host_memory.MALLOC_ENV)])
"""


def _run(tmp_path, env):
  script = tmp_path / "probe.py"
  script.write_text(PROBE)
  clean = {k: v for k, v in os.environ.items()
           if k not in host_memory.MALLOC_ENV and k != host_memory.SWITCH}
  clean.update(env, PYTHONPATH=REPO)
  out = subprocess.run([PYTHON, "-O", str(script), "a", "--b=1"], env=clean,
                       capture_output=True, text=True, check=True).stdout
  return out.splitlines()


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_reexec_sets_the_malloc_environment_once(tmp_path):
  lines = _run(tmp_path, {})
  pids = [l.split()[1] for l in lines]
  assert [l.split()[0] for l in lines] == ["before", "before", "after"]
  assert len(set(pids)) == 1  # exec: the same process
  want = [host_memory.MALLOC_ENV[k] for k in sorted(host_memory.MALLOC_ENV)]
  assert lines[-1].endswith(f"['a', '--b=1'] 1 {want}")


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
@pytest.mark.parametrize("env", [{host_memory.SWITCH: "0"},
                                 {"MALLOC_ARENA_MAX": "4"}])
def test_switch_and_users_own_settings_are_kept(tmp_path, env):
  lines = _run(tmp_path, env)
  assert [l.split()[0] for l in lines] == ["before", "after"]
  assert not host_memory.wanted(dict(env))


def test_not_wanted_off_glibc(monkeypatch):
  monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
  assert not host_memory.wanted({})


GROWN = r"""
import ctypes, sys
from vit_jax.train import host_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
guard = host_memory.HeapGuard(settle=1)
print(guard.active, guard.step(), flush=True)  # the settled size
size = 256 * 2 ** 20  # a step's temporaries, kept by the heap once freed
p = libc.malloc(size)
ctypes.memset(p, 1, size)
libc.free(p)
kept = host_memory.resident_bytes()
trimmed = guard.step()
print(trimmed, kept // 2 ** 20, host_memory.resident_bytes() // 2 ** 20)
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_the_heap_guard_hands_a_grown_heap_back(tmp_path):
  """With MALLOC_ENV glibc keeps a freed 256 MiB block resident (the heap
  that grew to 8 GiB); HeapGuard, once the resident size has grown past
  1.5x its settled size, hands the free pages back."""
  script = tmp_path / "grown.py"
  script.write_text(GROWN)
  env = {k: v for k, v in os.environ.items()
         if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
  env.update(host_memory.MALLOC_ENV, PYTHONPATH=REPO)
  first, second = subprocess.run(
      [PYTHON, str(script)], env=env, capture_output=True, text=True,
      check=True).stdout.splitlines()
  assert first == "True False"
  trimmed, kept, after = second.split()
  assert trimmed == "True" and int(kept) - int(after) > 200, second


def test_the_heap_guard_is_off_without_the_environment():
  assert not host_memory.in_effect({})
  assert host_memory.in_effect(dict(host_memory.MALLOC_ENV)) == GLIBC
  guard = host_memory.HeapGuard(active=False)
  assert not any(guard.step() for _ in range(5)) and guard.baseline == 0
