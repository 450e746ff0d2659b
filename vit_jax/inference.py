"""Using weights: load any supported checkpoint, prepare images the way those
weights expect, run them in batches.

:func:`load` accepts

* a training workdir, its ``checkpoints/`` directory or one step directory
  (Orbax, written by ``train.py``; read with
  :func:`vit_jax.checkpoint.load_for_inference`);
* a ``.pth`` / ``.pt`` / ``.bin`` state dict of torchvision's or timm's ViT
  (``torch.load(weights_only=True)``: no pickled code runs);
* a Google ``.npz`` (vision_transformer / big_vision; ``allow_pickle=False``);
* a ``.safetensors`` file (ours, timm's or torchvision's layout);
* ``torchvision:WEIGHTS`` (e.g. ``torchvision:IMAGENET1K_V1`` with
  ``model_name='vit_b_16'``): torchvision's released weights, downloaded and
  hash-checked by torch.hub.

``model_name`` (``vit_b_16``, ``B/16`` or timm's ``vit_base_patch16_224``) is
needed only where the weights cannot tell (a torchvision conv stem, a timm
model of non-standard width); when given it is checked, so weights of another
architecture are an error that names both.

Preprocessing: our own runs use the training pipeline's eval transform
(:func:`vit_jax.input_pipeline.preprocess_eval`, TensorFlow); converted
weights use their library's transform (resize the short side, center crop,
normalise) with PIL, as torchvision's ``ImageClassification`` does.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from vit_jax import convert, labels
from vit_jax.formats_arch import check_name, describe_arch

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif",
                    ".tiff", ".ppm", ".pgm")
SUPPORTED = (
    "a training workdir / its checkpoints/ dir / a step dir (Orbax), a .pth, "
    ".pt or .bin state dict (torchvision or timm), a Google .npz, a "
    ".safetensors file, or torchvision:WEIGHTS (e.g. torchvision:IMAGENET1K_V1 "
    "with --model vit_b_16)")


class ImageError(ValueError):
  """An image file that cannot be read or decoded."""


class CheckpointError(ValueError):
  """A checkpoint that cannot be used (missing, unreadable, other model)."""


@dataclasses.dataclass
class Loaded:
  """A model ready for inference and what goes with its weights."""

  model: Any
  variables: Any
  preprocessing: convert.Preprocessing
  label_names: Optional[List[str]]
  description: str
  kind: str  # 'orbax' | 'torchvision' | 'timm' | 'npz' | 'safetensors'
  use_training_pipeline: bool = False  # TF eval transform of vit_jax runs
  info: dict = dataclasses.field(default_factory=dict)  # training run facts

  @property
  def num_classes(self) -> int:
    return int(self.model.num_classes or 0)

  @property
  def image_size(self) -> int:
    return int(self.preprocessing.crop_size)

  def label(self, index: int) -> str:
    if self.label_names is not None:
      return self.label_names[index]
    return f"class {index}"

  def preprocess(self, image: np.ndarray) -> np.ndarray:
    """uint8 (H, W, 3) -> float32 (S, S, 3), normalised."""
    if self.use_training_pipeline:
      return _preprocess_tf(image, self.preprocessing)
    return preprocess_pil(image, self.preprocessing)

  def preprocessing_summary(self) -> str:
    p = self.preprocessing
    how = ("the training pipeline's eval transform" if
           self.use_training_pipeline else f"{p.interpolation} (PIL)")
    return (f"resize {p.resize_size}, center crop {p.crop_size}, {how}, "
            f"mean {tuple(round(m, 4) for m in p.mean)}, "
            f"std {tuple(round(s, 4) for s in p.std)}")


# --------------------------------------------------------------------------- #
# Images.
# --------------------------------------------------------------------------- #


def read_image(path: str) -> np.ndarray:
  """Decodes an image file (JPEG, PNG, ...) to uint8 RGB (H, W, 3)."""
  from PIL import Image, UnidentifiedImageError  # pylint: disable=import-outside-toplevel

  if not os.path.exists(path):
    raise ImageError(f"{path}: no such file")
  if os.path.isdir(path):
    raise ImageError(f"{path}: is a directory, not an image")
  try:
    with Image.open(path) as im:
      im.load()
      return np.asarray(im.convert("RGB"), dtype=np.uint8)
  except UnidentifiedImageError:
    raise ImageError(f"{path}: not an image PIL can decode (expected JPEG, "
                     f"PNG, BMP, GIF, WebP, TIFF...)") from None
  except (OSError, SyntaxError, ValueError) as e:
    raise ImageError(f"{path}: cannot decode the image ({e}); is the file "
                     f"truncated or corrupt?") from None


def expand_image_paths(paths: Sequence[str]) -> List[str]:
  """Files as given; directories expand to their image files (sorted)."""
  out = []
  for p in paths:
    if os.path.isdir(p):
      found = sorted(os.path.join(p, n) for n in os.listdir(p)
                     if n.lower().endswith(IMAGE_EXTENSIONS))
      out.extend(found if found else [p])  # an empty dir reports an error
    else:
      out.append(p)
  return out


_PIL_FILTERS = {"bilinear": "BILINEAR", "bicubic": "BICUBIC",
                "nearest": "NEAREST", "lanczos": "LANCZOS", "box": "BOX",
                "hamming": "HAMMING"}


def preprocess_pil(image: np.ndarray, pre: convert.Preprocessing) -> np.ndarray:
  """torchvision's ``Resize(resize_size) -> CenterCrop(crop_size) ->
  ToTensor -> Normalize(mean, std)`` on a uint8 (H, W, 3) array, with PIL
  (antialiased, as torchvision on PIL images); returns float32 NHWC-ready."""
  from PIL import Image  # pylint: disable=import-outside-toplevel

  interp = str(pre.interpolation).lower()
  if interp not in _PIL_FILTERS:
    raise ValueError(f"interpolation {pre.interpolation!r}: expected one of "
                     f"{sorted(_PIL_FILTERS)}")
  im = Image.fromarray(np.asarray(image, np.uint8))
  w, h = im.size
  size = max(int(pre.resize_size), int(pre.crop_size))
  if w <= h:  # torchvision: the short side becomes `size`, the long one int()
    new = (size, int(size * h / w))
  else:
    new = (int(size * w / h), size)
  if new != (w, h):
    im = im.resize(new, getattr(Image.Resampling, _PIL_FILTERS[interp]))
  w, h = im.size
  c = int(pre.crop_size)
  top, left = int(round((h - c) / 2.0)), int(round((w - c) / 2.0))
  im = im.crop((left, top, left + c, top + c))
  x = np.asarray(im, np.float32) / 255.0
  return ((x - np.asarray(pre.mean, np.float32)) /
          np.asarray(pre.std, np.float32)).astype(np.float32)


def _preprocess_tf(image: np.ndarray, pre: convert.Preprocessing) -> np.ndarray:
  from vit_jax import input_pipeline  # pylint: disable=import-outside-toplevel

  out = input_pipeline.preprocess_eval(
      np.asarray(image, np.uint8), image_size=int(pre.crop_size),
      resize_size=int(pre.resize_size), mean=tuple(pre.mean),
      std=tuple(pre.std))
  return np.asarray(out, np.float32)


# --------------------------------------------------------------------------- #
# Checkpoints.
# --------------------------------------------------------------------------- #


def _google_preprocessing(crop: int) -> convert.Preprocessing:
  # timm's pretrained config for Google's ViT weights (AugReg, i21k):
  # crop_pct 0.9, bicubic, inputs scaled to [-1, 1].
  return convert.Preprocessing(crop_size=crop, resize_size=int(crop / 0.9),
                               interpolation="bicubic", mean=HALF, std=HALF)


def _torchvision_preprocessing(crop: int) -> convert.Preprocessing:
  # torchvision's classic recipe (IMAGENET1K_V1): resize 256 -> crop 224.
  return convert.Preprocessing(crop_size=crop,
                               resize_size=int(round(crop * 256 / 224)),
                               interpolation="bilinear", mean=IMAGENET_MEAN,
                               std=IMAGENET_STD)


def _grid_image_size(model, variables) -> int:
  from vit_jax.formats_arch import arch_of  # pylint: disable=import-outside-toplevel

  size = arch_of(convert.unstack_layers(dict(variables)),
                 conv_stem=model.conv_stem)["image_size"]
  if size is None:
    raise CheckpointError("The position embedding is not a square grid; "
                          "pass image_size.")
  return int(size)


def _arch_of_model(model) -> dict:
  return {k: getattr(model, k) for k in
          ("patch_size", "hidden_size", "num_layers", "num_heads", "mlp_dim",
           "num_classes", "representation_size", "classifier", "conv_stem")}


def load(checkpoint: str, *, model_name: Optional[str] = None,
         image_size: Optional[int] = None, num_heads: Optional[int] = None,
         label_file: Optional[str] = None) -> Loaded:
  """Loads ``checkpoint`` (see the module docstring) for inference.

  Raises:
    CheckpointError: the path does not exist, cannot be read, or holds
      weights of another architecture (the message says what and why).
  """
  try:
    loaded = _load(str(checkpoint), model_name, image_size, num_heads)
    if label_file:
      names = labels.read_label_file(label_file)
      loaded.label_names = labels.check_labels(
          names, loaded.num_classes, f"The label file {label_file!r}")
  except CheckpointError:
    raise
  except (FileNotFoundError, ValueError, TypeError, KeyError) as e:
    raise CheckpointError(f"{checkpoint}: {e}") from e
  return loaded


def _load(path: str, model_name, image_size, num_heads) -> Loaded:
  m = re.fullmatch(r"torchvision:(\w+)", path)
  if m:
    if not model_name:
      raise CheckpointError(f"{path}: torchvision weights need the variant: "
                            f"pass --model (e.g. vit_b_16).")
    tv = convert.load_torchvision(model_name, m.group(1), image_size=image_size)
    return Loaded(tv.model, tv.variables, tv.preprocessing,
                  list(tv.categories) if tv.categories else None,
                  f"torchvision {model_name} {m.group(1)}", "torchvision")
  if not os.path.exists(path):
    raise CheckpointError(
        f"{path}: no such file or directory. Expected {SUPPORTED}.")
  if os.path.isdir(path):
    return _load_orbax(path, model_name, image_size)
  ext = os.path.splitext(path)[1].lower()
  if ext == ".npz":
    from vit_jax import formats_google  # pylint: disable=import-outside-toplevel
    model, variables = formats_google.load_npz(path, model_name,
                                               image_size=image_size)
    crop = _grid_image_size(model, variables)
    return Loaded(model, variables, _google_preprocessing(crop),
                  labels.default_labels(model.num_classes or 0, imagenet=True),
                  f"Google .npz: {describe_arch(dict(_arch_of_model(model), image_size=crop))}",
                  "npz")
  if ext == ".safetensors":
    from vit_jax import formats_io  # pylint: disable=import-outside-toplevel
    model, variables, meta = formats_io.load_safetensors(
        path, model_name, image_size=image_size, num_heads=num_heads)
    crop = _grid_image_size(model, variables)
    layout = meta.get("layout")
    if isinstance(meta.get("preprocessing"), dict):
      fields = {f.name for f in dataclasses.fields(convert.Preprocessing)}
      pre = convert.Preprocessing(**{k: (tuple(v) if isinstance(v, list) else v)
                                     for k, v in meta["preprocessing"].items()
                                     if k in fields})
      if image_size is not None:
        pre = dataclasses.replace(pre, crop_size=crop, resize_size=int(round(
            crop * pre.resize_size / pre.crop_size)))
    elif layout == "torchvision":
      pre = _torchvision_preprocessing(crop)
    else:
      pre = _google_preprocessing(crop)
    names = meta.get("label_names")
    names = (labels.check_labels(names, model.num_classes or 0, path)
             if isinstance(names, list) else
             labels.default_labels(model.num_classes or 0,
                                   imagenet=layout in ("timm", "torchvision")))
    return Loaded(model, variables, pre, names,
                  f"safetensors ({layout or 'unknown'} layout): "
                  f"{describe_arch(dict(_arch_of_model(model), image_size=crop))}",
                  "safetensors")
  if ext in (".pth", ".pt", ".bin", ".ckpt"):
    from vit_jax import formats_io  # pylint: disable=import-outside-toplevel
    sd = convert.load_state_dict_file(path)
    layout = formats_io.state_dict_layout(list(sd))
    model, variables = formats_io.from_state_dict(
        sd, model_name, image_size=image_size, num_heads=num_heads)
    crop = _grid_image_size(model, variables)
    pre = (_torchvision_preprocessing(crop) if layout == "torchvision"
           else _google_preprocessing(crop))
    return Loaded(model, variables, pre,
                  labels.default_labels(model.num_classes or 0, imagenet=True),
                  f"{layout} state dict: "
                  f"{describe_arch(dict(_arch_of_model(model), image_size=crop))}",
                  layout)
  raise CheckpointError(f"{path}: unknown checkpoint type {ext or '(none)'!r}. "
                        f"Expected {SUPPORTED}.")


def _load_orbax(path: str, model_name, image_size) -> Loaded:
  from vit_jax import checkpoint  # pylint: disable=import-outside-toplevel
  from vit_jax import input_pipeline  # pylint: disable=import-outside-toplevel

  model, variables, info = checkpoint.load_for_inference(path)
  if model_name:
    check_name(_arch_of_model(model), model_name)
  crop = int(info["image_size"])
  pp = ((info.get("config") or {}).get("pp") or {})
  fraction = float(pp.get("eval_crop_fraction", 0.875))
  resize = input_pipeline.eval_resize_size(
      types.SimpleNamespace(eval_crop_fraction=fraction), crop)
  if image_size is not None and int(image_size) != crop:
    variables = convert.resize_posemb(variables, image_size, model.patch_size)
    resize = int(round(int(image_size) * resize / crop))
    crop = int(image_size)
  pre = convert.Preprocessing(crop_size=crop, resize_size=resize,
                              interpolation="bilinear",
                              mean=tuple(info["mean"]), std=tuple(info["std"]))
  names = info.get("label_names")
  names = labels.check_labels(names, model.num_classes or 0, path) if names else None
  desc = (f"vit_jax training checkpoint (step {info.get('step')}, dataset "
          f"{info.get('dataset')!r}): "
          f"{describe_arch(dict(_arch_of_model(model), image_size=crop))}")
  return Loaded(model, variables, pre, names, desc, "orbax",
                use_training_pipeline=True, info=dict(info))


# --------------------------------------------------------------------------- #
# Running.
# --------------------------------------------------------------------------- #


def make_probabilities_fn(model) -> Callable:
  """jit(variables, images) -> softmax probabilities (float32)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  @jax.jit
  def fn(variables, images):
    logits = model.apply(variables, images, train=False)
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)

  return fn


def run_batches(fn, variables, images: np.ndarray, batch_size: int) -> np.ndarray:
  """Applies ``fn`` to ``images`` (N, H, W, 3) in batches of one fixed
  shape (the last one padded), so it compiles once."""
  n = len(images)
  if n == 0:
    return np.zeros((0,), np.float32)
  b = max(1, min(int(batch_size), n))
  outs = []
  for start in range(0, n, b):
    chunk = images[start:start + b]
    k = len(chunk)
    if k < b:
      chunk = np.concatenate([chunk, np.zeros((b - k,) + chunk.shape[1:],
                                              chunk.dtype)])
    outs.append(np.asarray(fn(variables, chunk))[:k])
  return np.concatenate(outs)
