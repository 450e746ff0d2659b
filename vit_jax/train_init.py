"""The model a training config describes, and its initial variables.

From scratch (random init inside the jitted init step), or fine-tuning from
torchvision weights (a ``.pth`` state dict or a released-weights name):
those import torch and torchvision, which must be imported *before*
TensorFlow in one process, as ``train.py`` does (importing torchvision's
triton after TensorFlow crashes the process).
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Any, Dict

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax import checkpoint, convert, models

_ARCH_FIELDS = ("hidden_size", "num_layers", "num_heads", "mlp_dim",
                "patch_size")


def model_kwargs(config, num_classes: int) -> Dict[str, Any]:
  """JSON-able keyword arguments of ``models.get_model`` for this config."""
  kw = dict(config.model.to_dict())
  kw["num_classes"] = int(num_classes)
  kw["remat_policy"] = kw.get("remat_policy") or None
  for k in ("dtype", "param_dtype"):
    if k in kw:
      try:
        kw[k] = jnp.dtype(kw[k]).name
      except TypeError:
        raise ValueError(f"config.model.{k}={kw[k]!r} is not a dtype "
                         f"(expected e.g. 'float32' or 'bfloat16').") from None
  return kw


def build_model(model_name: str, kwargs: Dict[str, Any]) -> models.VisionTransformer:
  """The model, built the way inference rebuilds it from a checkpoint."""
  return checkpoint.build_model({"model_name": model_name,
                                 "model_kwargs": kwargs})


def _torchvision_state_dict(model_name: str, weights: str):
  """State dict + (mean, std) for ``weights`` (a .pth path or torchvision
  name); fails fast offline when the named weights are not cached."""
  is_file = (os.path.sep in weights or os.path.exists(weights) or
             weights.endswith((".pth", ".pt")))
  if is_file:
    if not os.path.isfile(weights):
      raise FileNotFoundError(
          f"config.init_weights={weights!r}: no such file. Expected a "
          f"torchvision {model_name} state dict saved with torch.save(), or a "
          f"torchvision weights name such as 'IMAGENET1K_V1'.")
    return weights
  import torch  # pylint: disable=import-outside-toplevel
  import torchvision  # pylint: disable=import-outside-toplevel
  enum_name = model_name.upper().replace("VIT_", "ViT_") + "_Weights"
  try:
    enum = torchvision.models.get_weight(f"{enum_name}.{weights}")
  except (ValueError, KeyError, AttributeError):
    raise ValueError(
        f"config.init_weights={weights!r}: torchvision has no such weights "
        f"for {model_name}. Use a name like 'IMAGENET1K_V1', a path to a "
        f".pth state dict, or '' to train from scratch.") from None
  cached = os.path.join(torch.hub.get_dir(), "checkpoints",
                        os.path.basename(enum.url))
  if not os.path.exists(cached):
    from vit_jax import input_pipeline  # pylint: disable=import-outside-toplevel
    host = urllib.parse.urlparse(enum.url).hostname
    if not input_pipeline._online(host):  # pylint: disable=protected-access
      raise FileNotFoundError(
          f"torchvision weights {enum_name}.{weights} are not cached at "
          f"{cached!r} and {host} cannot be reached (offline?). Download "
          f"{enum.url} to that path, or set "
          f"--config.init_weights=/path/to/weights.pth.")
  return weights


def init_variables(config, model, num_classes: int):
  """(host variables or None for random init, preprocessing or None)."""
  if not config.init_weights:
    return None, None
  weights = _torchvision_state_dict(config.model_name, config.init_weights)
  # Architecture overrides (custom sizes) describe the checkpoint too.
  kw = {k: config.model[k] for k in _ARCH_FIELDS if k in config.model}
  tv = convert.load_torchvision(config.model_name, weights,
                                image_size=config.image_size,
                                scan_layers=model.scan_layers, **kw)
  variables = jax.tree_util.tree_map(np.asarray, dict(tv.variables))
  params = dict(variables["params"])
  width = params["head"]["kernel"].shape[0] if "head" in params else None
  if width is not None and (config.reset_head or
                            params["head"]["kernel"].shape[1] != num_classes):
    params["head"] = {
        "kernel": np.zeros((width, num_classes), np.float32),
        "bias": np.full((num_classes,), model.head_bias_init, np.float32)}
  variables["params"] = params
  return variables, tv.preprocessing


def check_tree(expected, got, what: str):
  """Raises naming missing, unexpected and mis-shaped leaves."""
  e = {jax.tree_util.keystr(k): v.shape for k, v in
       jax.tree_util.tree_leaves_with_path(expected)}
  g = {jax.tree_util.keystr(k): np.shape(v) for k, v in
       jax.tree_util.tree_leaves_with_path(got)}
  missing = sorted(set(e) - set(g))
  unexpected = sorted(set(g) - set(e))
  shapes = [f"{k}: model {e[k]}, weights {g[k]}" for k in sorted(set(e) & set(g))
            if tuple(e[k]) != tuple(g[k])]
  if missing or unexpected or shapes:
    raise ValueError(
        f"{what} do not match the model:\n  missing: {missing[:10]}\n  "
        f"unexpected: {unexpected[:10]}\n  mis-shaped: {shapes[:10]}")
