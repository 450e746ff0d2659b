"""Test-session setup shared by all test files."""

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


def pytest_configure(config):
  """``VIT_JAX_SUITE_PROFILE=FILE``: where each test's time goes, one JSON
  line per test (tests/suite_profile.py)."""
  import os  # pylint: disable=import-outside-toplevel
  path = os.environ.get("VIT_JAX_SUITE_PROFILE")
  if path:
    import suite_profile  # pylint: disable=import-outside-toplevel
    config.pluginmanager.register(suite_profile.SuiteProfile(path),
                                  "suite_profile")
