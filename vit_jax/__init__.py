"""vit-jax: the Vision Transformer in JAX/Flax, with exact parity with the
PyTorch ViTs (torchvision, timm, transformers).

The package is laid out by job; dependencies point one way::

    models  <-  data  <-  weights  <-  train / export  <-  the CLIs and faces

* :mod:`vit_jax.models`: the linen ViT, its variants and ``get_model``;
* :mod:`vit_jax.data`: preprocessing records, labels, tfds -> tf.data;
* :mod:`vit_jax.weights`: every checkpoint layout, ``weights.load``;
* :mod:`vit_jax.train`: the training loop and what it needs;
* :mod:`vit_jax.export`: StableHLO, SavedModel and ONNX;
* ``convert``, ``formats``, ``inference``: thin public faces; ``predict``,
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


def __getattr__(name):
  if name in MOVED:  # from vit_jax import checkpoint
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
