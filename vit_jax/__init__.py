"""vit-jax: the Vision Transformer in JAX/Flax, with exact parity with the
PyTorch ViTs (torchvision, timm, transformers).

The package is laid out by job; dependencies point one way::

    models  <-  data  <-  weights  <-  train / export  <-  the CLIs and faces

* :mod:`vit_jax.models`: the linen ViT, its variants and ``get_model``;
* :mod:`vit_jax.data`: preprocessing records, labels, tfds -> tf.data;
* :mod:`vit_jax.weights`: every checkpoint layout, ``weights.load``;
* :mod:`vit_jax.train`: the training loop and what it needs;
* :mod:`vit_jax.export`: StableHLO, SavedModel and ONNX;
* :func:`create_model` / :func:`list_models`: models and pretrained weights
  by name (timm's names and tags);
* ``convert``, ``formats``, ``inference``, ``nnx``: thin public faces; ``predict``,
  ``evaluate``, ``visualize``, ``features``, ``probe``: the CLIs
  (``python -m vit_jax.<name>``).

Importing this package (or ``vit_jax.models``) imports neither torch nor
TensorFlow. Module paths of earlier releases (``vit_jax.checkpoint``,
``vit_jax.input_pipeline``, ``vit_jax.kernels``, ...) still import, as the
module that holds their names now, with a DeprecationWarning naming it.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

__version__ = "0.1.0"

# Old module -> the module(s) holding its names now (several: their names
# merged, the same objects).
MOVED = {
    "layers": ("models.layers",),
    "kernels": ("models.kernels",),
    "interpolate": ("models.interpolate",),
    "preprocessing": ("data.preprocessing", "data.transforms"),
    "labels": ("data.labels",),
    "randaugment": ("data.randaugment",),
    "console": ("data.console",),
    "input_pipeline": ("data.sources", "data.transforms", "data.batches"),
    "datasets": ("data.digits",),
    "checkpoint": ("train.checkpoint", "weights.orbax"),
    "train_loop": ("train.loop",),
    "train_step": ("train.step",),
    "train_init": ("train.init",),
    "train_lib": ("train",),
    "optim": ("train.optim",),
    "sharding": ("train.sharding",),
    "multihost": ("train.multihost",),
    "metrics": ("train.metrics",),
    "export_tf": ("export.savedmodel",),
    "export_onnx": ("export.onnx",),
    "export_preprocessing": ("export.preprocessing",),
}


def _moved(old: str):
  """The module now behind ``vit_jax.<old>`` (with the warning)."""
  new = MOVED[old]
  warnings.warn(
      f"vit_jax.{old} has moved to " +
      " and ".join(f"vit_jax.{n}" for n in new) +
      "; the old path works for this release only.", DeprecationWarning,
      stacklevel=3)
  mods = [importlib.import_module(f"{__name__}.{n}") for n in new]
  if len(mods) == 1:
    return mods[0]
  merged = types.ModuleType(f"{__name__}.{old}", mods[0].__doc__)
  for m in reversed(mods):
    merged.__dict__.update({k: v for k, v in vars(m).items()
                            if not k.startswith("__")})
  return merged


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """``import vit_jax.<old>`` gives the module that holds its names now."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    prefix = __name__ + "."
    if fullname.startswith(prefix) and fullname[len(prefix):] in MOVED:
      return importlib.machinery.ModuleSpec(fullname, self)
    return None

  def create_module(self, spec):
    module = _moved(spec.name[len(__name__) + 1:])
    self._specs = getattr(self, "_specs", {})
    self._specs[spec.name] = getattr(module, "__spec__", None)
    return module

  def exec_module(self, module):
    # The import system gave the module this alias's spec: put its own back
    # (it is the same module object as under its new name).
    own = self._specs.pop(module.__spec__.name, None)
    if own is not None:
      module.__spec__ = own


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
  sys.meta_path.append(_MovedFinder())


def create_model(name: str, pretrained: bool = False, *,
                 num_classes=None, image_size=None, **options):
  """A model by name, as timm's ``create_model``: ``(model, variables,
  preprocessing)`` (a :class:`vit_jax.weights.Loaded`, which also has
  ``label_names``, ``head`` and ``info['pretrained']``).

      model, variables, preprocessing = vit_jax.create_model(
          "vit_small_patch14_reg4_dinov2.lvd142m", pretrained=True)
      logits = model.apply(variables, images, train=False)

  Args:
    name: a timm architecture, optionally with a tag
      (``vit_base_patch16_224.augreg2_in21k_ft_in1k``; without one, its
      default weights), one of ours (``vit_b_16``; ``vit_b_16.tv_in1k`` for
      torchvision's release), or with ``pretrained=True`` anything
      :func:`vit_jax.weights.load` reads (``hf-hub:org/name``, a file).
      :func:`list_models` lists them.
    pretrained: load the released weights (from the Hugging Face Hub, or
      the local cache offline) and their preprocessing and labels; else a
      random initialisation of the architecture, with the preprocessing of
      its default weights where it has any.
    num_classes: a head of this many classes (a fresh, zero head where the
      weights have another one; 0: no head).
    image_size: run at this resolution (the position embedding resampled).
    **options: :class:`vit_jax.models.VisionTransformer` options (dtype,
      scan_layers, dynamic_img_size, drop_path_rate...).
  """
  from vit_jax import weights  # pylint: disable=import-outside-toplevel
  if pretrained:
    loaded = weights.load(name, image_size=image_size, **options)
    if num_classes is not None and num_classes != loaded.model.num_classes:
      loaded = weights.with_head(loaded, num_classes)
    return loaded
  return weights.initial(name, num_classes=num_classes,
                         image_size=image_size, **options)


def list_models(pattern: str = "*", pretrained: bool = False,
                exclude=()) -> list:
  """Names :func:`create_model` takes that match ``pattern`` (fnmatch, as
  timm's ``list_models``): architectures, or with ``pretrained=True``
  every ``architecture.tag`` with released weights vit_jax loads.

      vit_jax.list_models("*dinov3*", pretrained=True)
  """
  from vit_jax.weights import pretrained as records  # pylint: disable=import-outside-toplevel
  return records.list_names(pattern, pretrained=pretrained, exclude=exclude)


# Submodules reachable as attributes after a bare ``import vit_jax``
# (``vit_jax.weights.load(...)``), imported on first use.
SUBMODULES = ("models", "data", "weights", "train", "export", "convert",
              "formats", "inference", "nnx", "predict", "evaluate",
              "visualize", "features", "probe", "cli")


def __getattr__(name):
  if name in MOVED or name in SUBMODULES:  # from vit_jax import checkpoint
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
