"""Test-session setup shared by all test files."""

# torch/torchvision must be imported before TensorFlow: importing torchvision
# (which loads triton) after TensorFlow crashes the process on this stack.
# Test files import both, in an order pytest chooses, so fix it here.
try:
  import torch  # noqa: F401
  import torchvision  # noqa: F401
except ImportError:  # the torch-free parts of the suite still run
  pass
