"""Shared helpers for tests that compare against torchvision."""

import numpy as np
import torch
import torchvision

from vit_jax import models
from compare import assert_close_rel  # noqa: F401  (re-exported)

# Sizes torchvision has no builder for (Ti, S) are built from its class.
def torchvision_vit(name: str, *, seed: int = 0, num_classes: int = 1000,
                    image_size: int = 224, representation_size=None,
                    random_head: bool = True, **kwargs) -> torch.nn.Module:
  """A torchvision VisionTransformer with random weights (``manual_seed``).

  torchvision zero-initialises the head; ``random_head`` gives it random
  values so the logits are not all zero.
  """
  v = models.decode_variant(name)
  torch.manual_seed(seed)
  m = torchvision.models.VisionTransformer(
      image_size=image_size, patch_size=v.patch_size, num_layers=v.num_layers,
      num_heads=v.num_heads, hidden_dim=v.hidden_size, mlp_dim=v.mlp_dim,
      num_classes=num_classes, representation_size=representation_size,
      **kwargs)
  if random_head:
    with torch.no_grad():
      torch.nn.init.normal_(m.heads.head.weight, std=0.5)
      torch.nn.init.normal_(m.heads.head.bias, std=0.5)
      if representation_size:
        torch.nn.init.normal_(m.heads.pre_logits.weight, std=0.05)
  return m.eval()


_POOL = []  # one pool of random values per process


def random_torchvision(name: str, num_classes: int) -> torch.nn.Module:
  """torchvision's own builder of ``name`` (``torchvision.models.vit_h_14``
  ...: its depth, widths and heads, not ours) on the meta device, given
  random values where every parameter matters: the registry check's
  (:class:`vit_jax.weights.verify.RandomWeights`: LayerNorm scales
  1 + N(0, 0.2), biases, class token and positions N(0, 0.1), Linear and
  conv weights N(0, 1/fan_in)). Nothing of torchvision's initialisation
  runs: ViT-H/14's 632M parameters in 3 s of CPU instead of 7-8 (Zen 3)."""
  from vit_jax.weights import verify  # pylint: disable=import-outside-toplevel
  if not _POOL:
    _POOL.append(verify.RandomWeights(size=1 << 24))
  with verify.meta_device():
    m = torchvision.models.get_model(name, weights=None,
                                     num_classes=num_classes)
  verify.materialize(m, _POOL[0])
  return m.eval()


def images(batch: int, size: int, seed: int = 0) -> np.ndarray:
  """Normalised-looking random images, NCHW float32."""
  rng = np.random.default_rng(seed)
  return rng.standard_normal((batch, 3, size, size)).astype(np.float32)


def nhwc(x: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(x.transpose(0, 2, 3, 1))
