"""The convolutional stem of ViTamin (Chen et al., CVPR 2024; timm's
``vitamin_*``): timm's ``MbConvStages`` inside a ``HybridEmbed`` without a
projection, before a ViT's blocks.

A 3x3 stride-2 convolution, a channel LayerNorm with GELU, a 3x3
convolution (timm's ``Stem``); two stages of pre-norm inverted bottlenecks
(``MbConvLNBlock``: channel LayerNorm, 1x1 expansion to
``make_divisible(width * expand_ratio)``, GELU, depthwise 3x3 (stride 2 in
a stage's first block), GELU, 1x1 projection; the shortcut of a stage's
first block a 3x3 stride-2 average pool (padding not counted) and, where
the width changes, a 1x1 convolution: ``Downsample2d``); then a channel
LayerNorm and a 3x3 stride-2 convolution to the ViT's width (timm's
``StridedConv``, ``pool``). Every convolution has a bias and pads by 1,
every norm's epsilon is 1e-6, GELU is exact (erf): what timm's
``vitamin.py`` builds whatever its ``VitConvCfg`` says. The stem reduces
by 16 (``ceil`` at each stride: any size runs).

Its parameters, under ``mbconv_stem`` at the top of the ViT's tree::

    stem_conv1, stem_norm1, stem_conv2
    stage{s}_block{u}/pre_norm, conv1, conv2, conv3, shortcut   (s, u from 0)
    pool_norm, pool_proj

(``shortcut``: the stride-2 block's 1x1 convolution where the width
changes; none otherwise.)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Tuple

import flax.linen as nn
import jax.numpy as jnp

Dtype = Any

__all__ = ["MbConvConfig", "MbConvStem", "as_config", "make_divisible"]

EPS = 1e-6  # every norm of timm's stem (its VitConvCfg's norm_eps is unused)


def make_divisible(v: float, divisor: int = 8, round_limit: float = 0.9
                   ) -> int:
  """timm's ``make_divisible``: ``v`` to a multiple of ``divisor``, not
  below 90 % of it (the bottleneck widths)."""
  new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
  if new_v < round_limit * v:
    new_v += divisor
  return new_v


@dataclasses.dataclass(frozen=True)
class MbConvConfig:
  """ViTamin's stem (timm's ``VitCfg``: ``stem_width``, ``embed_dim[:2]``,
  ``depths[:2]``; the third width is the ViT's).

  Attributes:
    stem_width: channels of the first two convolutions.
    widths: the two stages' widths.
    depths: the two stages' blocks.
    expand_ratio: the bottlenecks' expansion (of their output width).
  """

  stem_width: int = 64
  widths: Tuple[int, int] = (64, 128)
  depths: Tuple[int, int] = (2, 4)
  expand_ratio: float = 4.0

  def __post_init__(self):
    for f in ("widths", "depths"):
      object.__setattr__(self, f, tuple(int(n) for n in getattr(self, f)))
    if len(self.widths) != 2 or len(self.depths) != 2:
      raise ValueError(f"mbconv: ViTamin's stem has two stages; got widths="
                       f"{self.widths}, depths={self.depths}")
    if any(n < 1 for n in self.depths):
      raise ValueError(f"mbconv depths={self.depths}: every stage needs at "
                       f"least one block")

  stride = 16  # the stem's reduction: 2 (stem) x 2 x 2 (stages) x 2 (pool)

  def record(self) -> dict:
    """As JSON-able data (the architecture record's ``mbconv``)."""
    d = dataclasses.asdict(self)
    d["widths"], d["depths"] = list(self.widths), list(self.depths)
    return d


def as_config(value) -> MbConvConfig:
  """A :class:`MbConvConfig` from itself or its record (a mapping)."""
  if isinstance(value, MbConvConfig):
    return value
  if isinstance(value, Mapping):
    fields = [f.name for f in dataclasses.fields(MbConvConfig)]
    unknown = sorted(set(value) - set(fields))
    if unknown:
      raise ValueError(f"mbconv: unknown field(s) {unknown}; a MbConvConfig "
                       f"has {fields}")
    return MbConvConfig(**value)
  raise TypeError(f"mbconv: expected a MbConvConfig or its dict, got "
                  f"{type(value).__name__}")


class _Layers(nn.Module):
  """The convolutions and norms every part of the stem builds."""

  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  def conv(self, features: int, kernel: int = 3, strides: int = 1,
           groups: int = 1, name=None):
    pad = (kernel - 1) // 2
    return nn.Conv(features, (kernel, kernel), (strides, strides),
                   padding=((pad, pad), (pad, pad)),
                   feature_group_count=groups, dtype=self.dtype,
                   param_dtype=self.param_dtype, name=name)

  def norm(self, name):
    # A channel LayerNorm (timm's LayerNorm2d) of NHWC maps: over the last
    # axis; torch's two-pass variance.
    return nn.LayerNorm(epsilon=EPS, use_fast_variance=False,
                        dtype=self.dtype, param_dtype=self.param_dtype,
                        name=name)


def _gelu(x):
  return nn.gelu(x, approximate=False)


class MbConvBlock(_Layers):
  """timm's ``MbConvLNBlock``: x -> shortcut(x) + conv3(gelu(dw(gelu(
  conv1(LN(x)))))), striding by ``strides`` in the depthwise 3x3."""

  features: int = 64
  strides: int = 1
  expand_ratio: float = 4.0

  @nn.compact
  def __call__(self, x):
    f, mid = self.features, make_divisible(self.features * self.expand_ratio)
    shortcut = x
    if self.strides == 2:  # Downsample2d: pool, then a 1x1 where needed
      shortcut = nn.avg_pool(shortcut, (3, 3), (2, 2),
                             padding=((1, 1), (1, 1)),
                             count_include_pad=False)
    if x.shape[-1] != f:
      shortcut = self.conv(f, 1, name="shortcut")(shortcut)
    y = self.norm("pre_norm")(x)
    y = _gelu(self.conv(mid, 1, name="conv1")(y))
    y = _gelu(self.conv(mid, 3, self.strides, groups=mid, name="conv2")(y))
    return shortcut + self.conv(f, 1, name="conv3")(y)


class MbConvStem(_Layers):
  """Images (B, H, W, C) -> (B, H/16, W/16, ``features``) tokens' map
  (``ceil`` at each stride)."""

  config: MbConvConfig = MbConvConfig()
  features: int = 384

  @nn.compact
  def __call__(self, x):
    c = self.config
    x = self.conv(c.stem_width, 3, 2, name="stem_conv1")(x)
    x = _gelu(self.norm("stem_norm1")(x))
    x = self.conv(c.stem_width, 3, name="stem_conv2")(x)
    for s, (width, depth) in enumerate(zip(c.widths, c.depths)):
      for u in range(depth):
        x = MbConvBlock(dtype=self.dtype, param_dtype=self.param_dtype,
                        features=width, strides=2 if u == 0 else 1,
                        expand_ratio=c.expand_ratio,
                        name=f"stage{s}_block{u}")(x)
    x = self.norm("pool_norm")(x)
    return self.conv(self.features, 3, 2, name="pool_proj")(x)


def check(config: Any, patch_size: int) -> None:
  """Raises unless the stem's reduction is ``patch_size`` (the pixels per
  token)."""
  if not isinstance(config, MbConvConfig):
    raise TypeError(f"mbconv: expected a vit_jax.models.mbconv.MbConvConfig "
                    f"(get_model also takes its dict), got "
                    f"{type(config).__name__}")
  if patch_size != config.stride:
    raise ValueError(f"mbconv: ViTamin's stem reduces by {config.stride}, "
                     f"the pixels per token: patch_size must be "
                     f"{config.stride}, not {patch_size}")

