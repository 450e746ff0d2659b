"""How images must be prepared for a set of weights.

One record, :class:`Preprocessing`, says it: resize (the short side to
``resize_size``, or both sides for ``crop_mode='squash'``), center-crop
``crop_size``, scale to [0, 1], normalise with ``mean`` / ``std``, NHWC. The
weights layer fills it from what each source publishes (torchvision's weights
enums, timm's ``pretrained_cfg``, a Hugging Face ``preprocessor_config.json``,
a training run's config); :func:`preprocess_pil` applies it with PIL, as
torchvision's and timm's eval transforms do.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple

import numpy as np

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)  # Inception / Google / SigLIP: inputs in [-1, 1]
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

CROP_MODES = ("center", "squash")


@dataclasses.dataclass(frozen=True)
class Preprocessing:
  """Resize -> center crop -> [0, 1] -> (x - mean) / std.

  ``crop_mode='center'`` resizes the short side to ``resize_size`` keeping
  the aspect ratio (torchvision's ``Resize(int)``, timm's default);
  ``'squash'`` resizes both sides to ``resize_size`` (Hugging Face's
  ``ViTImageProcessor``, timm's ``crop_mode='squash'``). Then the center
  ``crop_size`` square is cut out. ``interpolation`` is PIL's filter name.

  ``max_seq_len`` (NaFlex models: SigLIP 2, timm's NaFlexVit): no crop;
  each image is resized to the largest size that keeps its aspect ratio
  and has at most that many patches, and cut into patches
  (:mod:`vit_jax.data.naflex`); ``crop_size`` / ``resize_size`` are unused.
  """

  crop_size: int = 224
  resize_size: int = 256
  interpolation: str = "bilinear"
  mean: Tuple[float, float, float] = IMAGENET_MEAN
  std: Tuple[float, float, float] = IMAGENET_STD
  crop_mode: str = "center"
  max_seq_len: Optional[int] = None

  def resized(self, crop: int) -> "Preprocessing":
    """The same recipe for another crop size (the resize keeps its ratio)."""
    crop = int(crop)
    if crop == self.crop_size or self.max_seq_len:
      return self
    ratio = self.resize_size / self.crop_size
    return dataclasses.replace(self, crop_size=crop,
                               resize_size=int(round(crop * ratio)))

  def summary(self) -> str:
    if self.max_seq_len:
      return (f"NaFlex: resize to at most {self.max_seq_len} patches keeping "
              f"the aspect ratio ({self.interpolation}), "
              f"mean {tuple(round(m, 4) for m in self.mean)}, "
              f"std {tuple(round(s, 4) for s in self.std)}")
    how = "squash" if self.crop_mode == "squash" else "short side"
    return (f"resize {self.resize_size} ({how}, {self.interpolation}), "
            f"center crop {self.crop_size}, "
            f"mean {tuple(round(m, 4) for m in self.mean)}, "
            f"std {tuple(round(s, 4) for s in self.std)}")

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Preprocessing":
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v
                  for k, v in d.items() if k in fields})


def eval_resize_size(crop_fraction: float, image_size: int) -> int:
  """The evaluation resize of a crop that covers ``crop_fraction`` of the
  short side (``config.pp.eval_crop_fraction``: 0.875 -> 256 for 224)."""
  return int(round(image_size / float(crop_fraction)))


def torchvision_classic(crop: int) -> Preprocessing:
  """torchvision's IMAGENET1K_V1 recipe: resize 256 -> crop 224, bilinear."""
  return Preprocessing(crop, int(round(crop * 256 / 224)), "bilinear")


def google(crop: int) -> Preprocessing:
  """timm's config for Google's ViT weights (AugReg, i21k): crop_pct 0.9,
  bicubic, inputs scaled to [-1, 1]."""
  return Preprocessing(crop, int(crop / 0.9), "bicubic", HALF, HALF)


def from_timm_cfg(cfg: Mapping[str, Any]) -> Preprocessing:
  """From a timm ``pretrained_cfg`` (``input_size``, ``interpolation``,
  ``crop_pct``, ``crop_mode``, ``mean``, ``std``), as timm's
  ``resolve_data_config`` + ``create_transform(is_training=False)`` do."""
  size = cfg.get("test_input_size") or cfg.get("input_size") or (3, 224, 224)
  crop = int(size[-1])
  pct = float(cfg.get("test_crop_pct") or cfg.get("crop_pct") or 0.875)
  mode = cfg.get("crop_mode") or "center"
  if mode not in CROP_MODES:
    raise ValueError(f"timm crop_mode {mode!r} is not supported; expected one "
                     f"of {CROP_MODES}")
  seq = cfg.get("max_seq_len")  # ours, for timm's NaFlex models
  return Preprocessing(
      crop_size=crop, resize_size=int(np.floor(crop / pct)),
      interpolation=str(cfg.get("interpolation") or "bicubic"),
      mean=tuple(cfg.get("mean") or IMAGENET_MEAN),
      std=tuple(cfg.get("std") or IMAGENET_STD), crop_mode=mode,
      max_seq_len=int(seq) if seq else None)


_HF_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic",
                4: "box", 5: "hamming"}


def from_hf_processor(cfg: Mapping[str, Any],
                      default_size: int = 224) -> Preprocessing:
  """From a Hugging Face ``preprocessor_config.json`` (``ViTImageProcessor``:
  resize to ``size`` exactly; ``CLIPImageProcessor``: shortest edge, then
  ``crop_size``)."""
  size = cfg.get("size") or {}
  if isinstance(size, int):
    size = {"shortest_edge": size}
  crop = cfg.get("crop_size") or {}
  if isinstance(crop, int):
    crop = {"height": crop, "width": crop}
  interp = _HF_RESAMPLE.get(int(cfg.get("resample", 2)), "bilinear")
  mean = tuple(cfg.get("image_mean") or HALF)
  std = tuple(cfg.get("image_std") or HALF)
  if cfg.get("max_num_patches"):  # Siglip2ImageProcessor: NaFlex
    return Preprocessing(default_size, default_size, interp, mean, std,
                         "squash", max_seq_len=int(cfg["max_num_patches"]))
  if "shortest_edge" in size:
    resize = int(size["shortest_edge"])
    c = int(crop.get("height", resize)) if cfg.get("do_center_crop", True) else resize
    return Preprocessing(c, resize, interp, mean, std, "center")
  h = int(size.get("height", default_size))
  c = int(crop.get("height", h)) if cfg.get("do_center_crop") else h
  return Preprocessing(c, h, interp, mean, std, "squash")


_PIL_FILTERS = {"bilinear": "BILINEAR", "bicubic": "BICUBIC",
                "nearest": "NEAREST", "lanczos": "LANCZOS", "box": "BOX",
                "hamming": "HAMMING"}


def pil_filter(interpolation: str):
  """PIL's resampling filter for a name (``'bicubic'``, ``'bilinear'``...)."""
  from PIL import Image  # pylint: disable=import-outside-toplevel

  interp = str(interpolation).lower()
  if interp not in _PIL_FILTERS:
    raise ValueError(f"interpolation {interpolation!r}: expected one of "
                     f"{sorted(_PIL_FILTERS)}")
  return getattr(Image.Resampling, _PIL_FILTERS[interp])


def check_image(image, what: str = "preprocess") -> np.ndarray:
  """One decoded image as uint8 (H, W, 3), or a ValueError that says what
  was expected and what came.

  Takes uint8 (or integer / float values in [0, 255]) RGB (H, W, 3), and
  grey-scale (H, W) or (H, W, 1) (repeated to RGB, as PIL's
  ``convert('RGB')`` does). Refuses floats in [0, 1] (they would all be
  black after normalisation), CHW and batched arrays, and other channel
  counts, naming the fix."""
  x = np.asarray(image)
  expected = (f"{what} takes one decoded image: uint8 (height, width, 3) RGB "
              f"with values 0-255 (or floats in [0, 255])")
  if x.ndim == 2 or (x.ndim == 3 and x.shape[-1] == 1):
    x = np.repeat(x.reshape(x.shape[0], x.shape[1], 1), 3, axis=-1)
  if x.ndim == 4:
    raise ValueError(f"{expected}; got a batch of shape {x.shape}: call it "
                     f"on each image (for image in batch).")
  if x.ndim != 3:
    raise ValueError(f"{expected}; got an array of shape {x.shape}.")
  if x.shape[-1] != 3:
    if x.shape[0] in (1, 3):
      hint = " It looks like CHW (PyTorch's layout): image.transpose(1, 2, 0)."
    elif x.shape[-1] == 4:
      hint = " It looks like RGBA: drop the alpha channel, image[..., :3]."
    else:
      hint = ""
    raise ValueError(f"{expected}; got shape {x.shape} ({x.shape[-1]} "
                     f"channels).{hint}")
  if x.dtype == np.uint8:
    return x
  if x.dtype.kind not in "iuf":
    raise ValueError(f"{expected}; got dtype {x.dtype}.")
  if x.size and not np.all(np.isfinite(x)):
    raise ValueError(f"{expected}; got non-finite values.")
  lo, hi = (float(x.min()), float(x.max())) if x.size else (0.0, 0.0)
  if lo < 0 or hi > 255:
    raise ValueError(f"{expected}; got {x.dtype} values from {lo:g} to "
                     f"{hi:g}, outside [0, 255].")
  if x.dtype.kind == "f" and 0 < hi <= 1.0:
    raise ValueError(f"{expected}; got {x.dtype} values in [0, 1] (max "
                     f"{hi:g}), which would be treated as almost black: scale "
                     f"them to [0, 255] first ((image * 255).round()).")
  return np.clip(np.round(x), 0, 255).astype(np.uint8)


def preprocess_pil(image: np.ndarray, pre: Preprocessing) -> np.ndarray:
  """Applies ``pre`` to one image (:func:`check_image`: uint8 (H, W, 3) or
  [0, 255] values) with PIL (antialiased, as torchvision and timm do on PIL
  images); returns float32 (S, S, 3)."""
  from PIL import Image  # pylint: disable=import-outside-toplevel

  resample = pil_filter(pre.interpolation)
  if pre.max_seq_len:
    raise ValueError("preprocess_pil: this is a NaFlex recipe (max_seq_len "
                     "patches, no crop): use vit_jax.data.naflex.preprocess")
  im = Image.fromarray(check_image(image))
  w, h = im.size
  size = max(int(pre.resize_size), int(pre.crop_size))
  if pre.crop_mode == "squash":
    new = (size, size)
  elif w <= h:  # torchvision: the short side becomes `size`, the long one int()
    new = (size, int(size * h / w))
  else:
    new = (int(size * w / h), size)
  if new != (w, h):
    im = im.resize(new, resample)
  w, h = im.size
  c = int(pre.crop_size)
  top, left = int(round((h - c) / 2.0)), int(round((w - c) / 2.0))
  im = im.crop((left, top, left + c, top + c))
  x = np.asarray(im, np.float32) / 255.0
  return ((x - np.asarray(pre.mean, np.float32)) /
          np.asarray(pre.std, np.float32)).astype(np.float32)


def default_for(crop: Optional[int], kind: str) -> Preprocessing:
  """A sensible recipe when the weights carry none: torchvision's classic
  for torchvision layouts, Google's for everything else."""
  crop = int(crop or 224)
  return torchvision_classic(crop) if kind == "torchvision" else google(crop)


def run_normalization(config, init_preprocessing=None):
  """A training run's (mean, std) in [0, 1] pixel units: the config's
  (``config.pp.mean`` / ``std``), else the initial weights' (torchvision:
  ImageNet statistics), else 0.5 / 0.5."""
  if init_preprocessing is not None:
    mean, std = tuple(init_preprocessing.mean), tuple(init_preprocessing.std)
  else:
    mean, std = HALF, HALF
  if config.pp.mean is not None:
    mean = tuple(config.pp.mean)
  if config.pp.std is not None:
    std = tuple(config.pp.std)
  for what, v in (("mean", mean), ("std", std)):
    if len(v) != 3 or not all(0.0 <= float(x) <= 1.0 for x in v):
      raise ValueError(f"config.pp.{what}={v}: expected 3 floats in [0, 1] "
                       f"(per-channel, in [0, 1]-scaled pixel units).")
  if min(std) <= 0:
    raise ValueError(f"config.pp.std={std}: must be positive.")
  return tuple(float(x) for x in mean), tuple(float(x) for x in std)
