"""Analytic FLOP counts of a ViT (one multiply-add = 2 FLOPs).

Only matmul-like work is counted (patch embedding, q/k/v/out projections,
the two attention products, the MLP, the head); LayerNorm, softmax, GELU
and adds are a few percent and left out, as is usual. A training step is 3x
the forward pass (backward = 2x forward); the optimizer is ignored.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class FlopBreakdown:
  """Forward FLOPs of one image, and of its attention products."""
  tokens: int       # N (patches + class token)
  total: float
  attention: float  # QK^T and AV: 2 * N^2 * D each, quadratic in N

  @property
  def attention_fraction(self) -> float:
    """Share of the quadratic (N^2) attention term in the forward FLOPs."""
    return self.attention / self.total


def vit_forward_flops(*, hidden_size: int, num_layers: int, mlp_dim: int,
                      patch_size: int, image_size: int, num_classes: int = 1000,
                      channels: int = 3, class_token: bool = True,
                      **unused) -> FlopBreakdown:
  """Forward FLOPs of one ``image_size`` x ``image_size`` image."""
  del unused
  d, m, p, layers = hidden_size, mlp_dim, patch_size, num_layers
  patches = (image_size // p) ** 2
  n = patches + (1 if class_token else 0)
  attention = layers * 2 * (2 * n * n * d)
  return FlopBreakdown(n, float(
      2 * patches * (p * p * channels) * d  # patch embedding
      + layers * 2 * n * d * (4 * d)  # q/k/v/out projections: linear in N
      + attention + layers * 2 * (2 * n * d * m)  # the MLP
      + 2 * d * (num_classes or 0)), float(attention))  # the head


def step_flops(variant, image_size: int, mode: str, num_classes: int = 1000):
  """FLOPs per image of one ``mode`` ('infer' or 'train') step."""
  fwd = vit_forward_flops(image_size=image_size, num_classes=num_classes,
                          **dataclasses.asdict(variant)).total
  return fwd * (3.0 if mode == "train" else 1.0)
