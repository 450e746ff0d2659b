"""The XLA flags train.py sets (vit_jax/train/xla_flags.py): appended to
the user's ``XLA_FLAGS`` unless it names them, and accepted by this
jaxlib (XLA ends the process on a flag it does not know)."""

import os
import subprocess

from train_helpers import PYTHON, REPO
from vit_jax.train import xla_flags

TRITON = "--xla_gpu_enable_triton_gemm"


def test_defaults_are_appended_to_the_users_flags():
  assert xla_flags.with_defaults("") == f"{TRITON}=false"
  assert xla_flags.with_defaults(
      " --xla_force_host_platform_device_count=8 ") == (
          f"--xla_force_host_platform_device_count=8 {TRITON}=false")


def test_a_flag_the_user_names_keeps_the_users_value():
  for given in (f"{TRITON}=true", f"-xla_gpu_enable_triton_gemm=true "
                "--xla_cpu_use_thunk_runtime=false"):
    assert xla_flags.with_defaults(given) == given


def test_apply_sets_the_environment_once():
  env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
  xla_flags.apply(env)
  xla_flags.apply(env)
  assert env == {"XLA_FLAGS": f"--xla_dump_to=/tmp/x {TRITON}=false"}
  env = {}
  xla_flags.apply(env)
  assert env == {"XLA_FLAGS": f"{TRITON}=false"}


def test_this_jaxlib_accepts_every_default():
  env = dict(os.environ, PYTHONPATH=REPO,
             XLA_FLAGS=xla_flags.with_defaults(""))
  p = subprocess.run(
      [PYTHON, "-c", "import jax, jax.numpy as jnp; "
       "print(float(jax.jit(lambda x: x @ x)(jnp.eye(4)).sum()))"],
      env=env, capture_output=True, text=True, check=False)
  assert p.returncode == 0 and p.stdout.split()[-1] == "4.0", p.stderr[-2000:]
