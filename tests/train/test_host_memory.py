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
