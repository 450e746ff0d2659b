"""The ResNet stem of the ViT paper's hybrids (R50+ViT-B/16, R26+ViT-S/32,
R50+ViT-L/32, R+ViT-Ti/16): BiT's ResNet (weight-standardised
convolutions, GroupNorm of 32 groups) without pre-activation, as
google-research/vision_transformer's ``models_resnet.py`` and the root
block of its ``models_vit.py`` build it, and timm's ``ResNetV2(preact=
False, stem_type='same')`` (``vision_transformer_hybrid._resnetv2``).

Its parameters are Google's names, at the top of the ViT's tree::

    conv_root/kernel (7, 7, C, W)   gn_root/{scale,bias}
    block{s}/unit{u}/conv1, gn1, conv2, gn2, conv3, gn3   (s, u from 1)
    block{s}/unit1/conv_proj, gn_proj   (the shortcut's projection)

The root is a 7x7 stride-2 convolution, GroupNorm, ReLU and a 3x3 stride-2
max pool ('SAME' padding everywhere: TensorFlow's, which timm's
``StdConv2dSame`` / ``MaxPool2dSame`` compute too); stage ``s`` has
``num_layers[s - 1]`` bottleneck units of width ``W * 2**(s - 1)`` (output
4x that), the first unit of every stage after the first striding by 2 in
its 3x3 convolution. ``num_layers=()`` is the root alone (R+ViT-Ti/16).

The two libraries standardise weights and normalise groups with different
constants; each set is a field of :class:`ResNetConfig` (the layout the
weights come from sets it: :data:`GOOGLE` for Google's ``.npz`` and our own
tree, :data:`TIMM` for timm's state dicts), so both load exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

Dtype = Any

__all__ = ["GOOGLE", "TIMM", "ResNetConfig", "ResNetStage", "ResNetStem",
           "ResidualUnit", "StdConv", "as_config", "standardize"]


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  """A hybrid's ResNet stem (Google's ``config.resnet``), and its numerics.

  Attributes:
    num_layers: bottleneck units per stage: ``(3, 4, 9)`` (R50+ViT-B/16),
      ``(2, 2, 2, 2)`` (R26), ``(3, 4, 6, 3)`` (R50+ViT-L/32), ``()``: the
      root block alone.
    width_factor: widths are ``int(64 * width_factor)`` times 1, 2, 4, 8.
    std_eps: epsilon of the weight standardisation.
    std_eps_in_sqrt: ``False``: ``(w - mean) / (std + eps)`` (Google's
      ``weight_standardize``, eps 1e-5); ``True``: ``(w - mean) /
      sqrt(var + eps)`` (timm's ``StdConv2dSame`` through
      ``F.batch_norm``, eps 1e-8 in its hybrids).
    gn_eps: epsilon of every GroupNorm (flax's default 1e-6 in Google's
      module; timm's ``GroupNormAct`` 1e-5).
  """

  num_layers: Tuple[int, ...] = (3, 4, 9)
  width_factor: float = 1
  std_eps: float = 1e-5
  std_eps_in_sqrt: bool = False
  gn_eps: float = 1e-6

  def __post_init__(self):
    object.__setattr__(self, "num_layers",
                       tuple(int(n) for n in self.num_layers))
    if any(n < 1 for n in self.num_layers):
      raise ValueError(f"resnet num_layers={self.num_layers}: every stage "
                       f"needs at least one unit")
    if self.width < 32 or self.width % 32:
      raise ValueError(f"resnet width_factor={self.width_factor}: the root's "
                       f"width int(64 * width_factor) = {self.width} must be "
                       f"a multiple of GroupNorm's 32 groups")

  @property
  def width(self) -> int:
    """The root's output channels (and the first stage's bottleneck)."""
    return int(64 * self.width_factor)

  @property
  def stride(self) -> int:
    """The stem's reduction: 4 for the root, 2 for every stage after the
    first."""
    return 4 * 2 ** max(len(self.num_layers) - 1, 0)

  @property
  def out_channels(self) -> int:
    n = len(self.num_layers)
    return self.width * 4 * 2 ** (n - 1) if n else self.width

  def record(self) -> dict:
    """As JSON-able data (the architecture record's ``resnet``)."""
    d = dataclasses.asdict(self)
    d["num_layers"] = list(self.num_layers)
    return d


# The constants each library computes with (a layout sets them).
GOOGLE = dict(std_eps=1e-5, std_eps_in_sqrt=False, gn_eps=1e-6)
TIMM = dict(std_eps=1e-8, std_eps_in_sqrt=True, gn_eps=1e-5)


def as_config(value) -> ResNetConfig:
  """A :class:`ResNetConfig` from itself, its record (a mapping, e.g. read
  back from JSON) or a stage tuple (Google's numerics)."""
  if isinstance(value, ResNetConfig):
    return value
  if isinstance(value, Mapping):
    fields = [f.name for f in dataclasses.fields(ResNetConfig)]
    unknown = sorted(set(value) - set(fields))
    if unknown:
      raise ValueError(f"resnet: unknown field(s) {unknown}; a ResNetConfig "
                       f"has {fields}")
    return ResNetConfig(**value)
  if isinstance(value, Sequence) and not isinstance(value, str):
    return ResNetConfig(num_layers=tuple(value))
  raise TypeError(f"resnet: expected a ResNetConfig, its dict or a tuple of "
                  f"stage depths, got {type(value).__name__}")


def standardize(w, eps: float, eps_in_sqrt: bool):
  """Weight standardisation of a conv kernel (kh, kw, in, out) per output
  channel, over (kh, kw, in)."""
  axes = (0, 1, 2)
  w = w - jnp.mean(w, axis=axes)
  if eps_in_sqrt:  # torch's batch_norm in timm's StdConv2d(Same)
    return w * jax.lax.rsqrt(jnp.var(w, axis=axes) + eps)
  return w / (jnp.std(w, axis=axes) + eps)  # Google's weight_standardize


class StdConv(nn.Conv):
  """``nn.Conv`` whose kernel is standardised where it is read (Google's
  ``models_resnet.StdConv``; the stored parameter is the raw kernel)."""

  std_eps: float = 1e-5
  std_eps_in_sqrt: bool = False

  def param(self, name: str, init_fn: Callable[..., Any], *init_args,
            **init_kwargs):
    p = super().param(name, init_fn, *init_args, **init_kwargs)
    if name == "kernel":
      p = standardize(p, self.std_eps, self.std_eps_in_sqrt)
    return p


class _Numerics(nn.Module):
  """The constants and dtypes every layer of the stem shares."""

  config: ResNetConfig
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32

  def conv(self, features: int, kernel: int, strides: int = 1, name=None):
    c = self.config
    return StdConv(features, (kernel, kernel), (strides, strides),
                   padding="SAME", use_bias=False, std_eps=c.std_eps,
                   std_eps_in_sqrt=c.std_eps_in_sqrt, dtype=self.dtype,
                   param_dtype=self.param_dtype, name=name)

  def gn(self, name, zero_scale: bool = False):
    # The two-pass variance (torch's): flax's default E[x^2] - E[x]^2 (in
    # Google's module) agrees with it to float32 rounding here, and is the
    # one that loses digits where a group's mean dwarfs its spread.
    return nn.GroupNorm(num_groups=32, epsilon=self.config.gn_eps,
                        use_fast_variance=False,
                        dtype=self.dtype, param_dtype=self.param_dtype,
                        scale_init=(nn.initializers.zeros if zero_scale
                                    else nn.initializers.ones), name=name)


class ResidualUnit(_Numerics):
  """Google's ``ResidualUnit``: a bottleneck (1x1, 3x3 with the stride,
  1x1 to 4x the width), its last GroupNorm's scale initialised to zero, and
  a projected shortcut where the shape changes (timm's ``Bottleneck`` with
  ``DownsampleConv``)."""

  features: int = 64
  strides: int = 1

  @nn.compact
  def __call__(self, x):
    f = self.features
    residual = x
    if x.shape[-1] != f * 4 or self.strides != 1:
      residual = self.conv(f * 4, 1, self.strides, "conv_proj")(residual)
      residual = self.gn("gn_proj")(residual)
    y = nn.relu(self.gn("gn1")(self.conv(f, 1, name="conv1")(x)))
    y = nn.relu(self.gn("gn2")(self.conv(f, 3, self.strides, "conv2")(y)))
    y = self.gn("gn3", zero_scale=True)(self.conv(f * 4, 1, name="conv3")(y))
    return nn.relu(residual + y)


class ResNetStage(_Numerics):
  """``depth`` units (``unit1`` ...), the first one striding."""

  depth: int = 1
  features: int = 64
  first_stride: int = 1

  @nn.compact
  def __call__(self, x):
    for u in range(self.depth):
      x = ResidualUnit(config=self.config, dtype=self.dtype,
                       param_dtype=self.param_dtype, features=self.features,
                       strides=self.first_stride if u == 0 else 1,
                       name=f"unit{u + 1}")(x)
    return x


class ResNetStem(_Numerics):
  """Images (B, H, W, C) -> the stem's features (B, H/s, W/s, C'), s =
  ``config.stride`` ('SAME' padding: ``ceil`` for other sizes). Its
  parameters are ``conv_root``, ``gn_root``, ``block{s}``: the ViT puts
  them at the top of its own tree (``nn.share_scope``), where Google's
  module has them."""

  @nn.compact
  def __call__(self, x):
    c = self.config
    x = self.conv(c.width, 7, 2, "conv_root")(x)
    x = nn.relu(self.gn("gn_root")(x))
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for s, depth in enumerate(c.num_layers):
      x = ResNetStage(config=c, dtype=self.dtype,
                      param_dtype=self.param_dtype, depth=depth,
                      features=c.width * 2 ** s,
                      first_stride=2 if s else 1, name=f"block{s + 1}")(x)
    return x
