"""The model a training config describes, and its initial variables.

From scratch (random init inside the jitted init step), or fine-tuning from
``config.init_weights``: anything :func:`vit_jax.weights.load` reads (a
``.pth`` / ``.safetensors`` / ``.npz`` file, a Hugging Face model directory,
``hf-hub:org/name``, a training workdir, ``torchvision:IMAGENET1K_V1`` or
just ``IMAGENET1K_V1`` with ``model_name``). The weights decide the
architecture (sizes, registers, LayerScale, pooling, activation ...);
``config.model`` gives the training options (dtype, dropout, drop path,
scan, remat, attention). Sources that need torch to be read (``.pth``,
torchvision's releases) are converted in a child process
(``python -m vit_jax.weights``) to a torch-free file first, so torch is never
imported beside JAX and TensorFlow in the training process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax import models, weights
from vit_jax.data import preprocessing as pp
from vit_jax.weights import files, pretrained, trees
from vit_jax.weights.check import check_keys

# VisionTransformer fields a training config sets even when the weights give
# the architecture; every other field comes from the weights.
TRAINING_OPTIONS = models.OPTION_FIELDS
# Sizes a config may state (a custom-size checkpoint): checked, not applied.
_STATED = ("patch_size", "hidden_size", "num_layers", "num_heads", "mlp_dim")


@dataclasses.dataclass
class InitialWeights:
  """What a fine-tuning run starts from."""

  source: str
  arch: Dict[str, Any]  # the weights' architecture (JSON-able model fields)
  variables: Any  # host numpy arrays, per-layer layout
  preprocessing: pp.Preprocessing
  description: str


def source_of(init_weights: str) -> str:
  """``config.init_weights`` as a :func:`vit_jax.weights.load` source: a bare
  torchvision weights name (``IMAGENET1K_V1``) means ``torchvision:NAME``."""
  w = str(init_weights)
  if re.fullmatch(r"[A-Z][A-Z0-9_]*", w) and not os.path.exists(w):
    return f"torchvision:{w}"
  return w


def _convert_in_child(source: str, out: str, model_name: Optional[str],
                      image_size: int, stated: Dict[str, Any]) -> None:
  """``python -m vit_jax.weights SOURCE OUT``: torch stays in the child."""
  cmd = [sys.executable, "-m", "vit_jax.weights", source, out,
         "--image-size", str(image_size), "--overrides", json.dumps(stated)]
  if model_name:
    cmd += ["--model", model_name]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (root, env.get("PYTHONPATH")) if p)
  p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
  if p.returncode != 0:
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    why = next((l[len("error: "):] for l in reversed(lines)
                if l.startswith("error: ")), "\n".join(lines[-15:]))
    raise weights.CheckpointError(
        f"config.init_weights={source!r} could not be converted (python -m "
        f"vit_jax.weights, exit {p.returncode}): {why}")


def load_initial_weights(config) -> Optional[InitialWeights]:
  """The weights ``config.init_weights`` names, at ``config.image_size``
  (None: from scratch)."""
  if not config.init_weights:
    return None
  source = source_of(config.init_weights)
  stated = {k: config.model[k] for k in _STATED if k in config.model}
  named = not os.path.exists(source) and pretrained.is_name(source)
  if named:  # released weights by name: the record says where and what
    rec = pretrained.lookup(source)
    source = rec.source
  # The name decides what the keys cannot (a timm state dict's activation,
  # torchvision's released weights); a Hugging Face directory says itself.
  by_name = not (source.startswith(files.HF_PREFIXES) or os.path.isdir(source))
  name = rec.architecture if named else (
      config.model_name if by_name else None)
  size = int(config.image_size)
  if not (os.path.exists(source) or source.startswith(
      files.HF_PREFIXES + ("torchvision:",))):
    raise weights.CheckpointError(
        f"config.init_weights={source!r}: no such file or directory. Expected "
        f"{weights.SUPPORTED}, a pretrained name "
        f"(vit_jax.list_models(pretrained=True)), a torchvision weights name "
        f"such as 'IMAGENET1K_V1', or '' to train from scratch.")
  if named and not files.needs_torch(source):
    loaded = weights.load(rec.name, image_size=size, **stated)
  elif files.needs_torch(source):
    with tempfile.TemporaryDirectory(prefix="vit_jax_init_") as d:
      out = os.path.join(d, "init_weights.safetensors")
      _convert_in_child(source, out, name, size, stated)
      loaded = weights.load(out)
  else:
    loaded = weights.load(source, model_name=name, image_size=size, **stated)
  variables = trees.unstack_layers(trees.wrap(
      jax.tree_util.tree_map(np.asarray, dict(loaded.variables))))
  return InitialWeights(source, models.arch_record(loaded.model), variables,
                        loaded.preprocessing, loaded.description)


def model_kwargs(config, num_classes: int,
                 init: Optional[InitialWeights] = None) -> Dict[str, Any]:
  """JSON-able keyword arguments of ``models.get_model`` for this config:
  ``config.model`` from scratch; the weights' architecture with the
  config's training options when fine-tuning."""
  kw = dict(config.model.to_dict())
  kw["remat_policy"] = kw.get("remat_policy") or None
  for k in ("dtype", "param_dtype"):
    if k in kw:
      try:
        kw[k] = jnp.dtype(kw[k]).name
      except TypeError:
        raise ValueError(f"config.model.{k}={kw[k]!r} is not a dtype "
                         f"(expected e.g. 'float32' or 'bfloat16').") from None
  if init is not None:
    for k in _STATED:
      if k in kw and kw[k] != init.arch[k]:
        raise ValueError(
            f"config.model.{k}={kw[k]} but the initial weights "
            f"{init.source!r} have {k}={init.arch[k]} ({init.description}). "
            f"The weights decide the architecture: drop the override or use "
            f"other weights.")
    arch = dict(init.arch)
    if arch["classifier"] == "unpooled":  # a backbone: the config pools
      arch["classifier"] = kw.get("classifier") or "token"
    kw = dict(arch, **{k: v for k, v in kw.items() if k in TRAINING_OPTIONS})
  if init is None and config.get("naflex_seq_lens") and not kw.get("naflex"):
    # A NaFlex model from scratch: SigLIP 2's per-image grid resize, the
    # grid of config.image_size.
    patch = int(kw.get("patch_size") or
                models.decode_variant(config.model_name).patch_size)
    side = max(1, int(config.image_size) // patch)
    kw.update(naflex="bilinear_aa", naflex_grid=[side, side])
  kw["num_classes"] = int(num_classes)
  return kw


def build_model(model_name: str, kwargs: Dict[str, Any]) -> models.VisionTransformer:
  """The model, built the way inference rebuilds it from a checkpoint
  (:func:`vit_jax.models.from_record`)."""
  return models.from_record(model_name, kwargs)


def initial_variables(config, init: Optional[InitialWeights], abstract):
  """Host variables in the train state's layout (None: random init). The
  head is a fresh zero head when ``config.reset_head``, when the number of
  classes differs, or when the weights have none (a backbone)."""
  if init is None:
    return None
  params = dict(init.variables["params"])
  want = abstract.params.get("head")
  have = params.get("head")
  if want is None:
    params.pop("head", None)
  elif (config.reset_head or have is None or
        tuple(np.shape(have["kernel"])) != tuple(want["kernel"].shape)):
    params["head"] = {
        "kernel": np.zeros(want["kernel"].shape, np.float32),
        "bias": np.full(want["bias"].shape, float(config.model.head_bias_init),
                        np.float32)}
  variables = dict(init.variables, params=params)
  if bool(config.model.scan_layers):
    variables = trees.stack_layers(variables)
  expected = {"params": abstract.params}
  if abstract.batch_stats:
    expected["batch_stats"] = abstract.batch_stats
  check_keys({k: tuple(np.shape(v)) for k, v in trees.flatten(variables).items()},
             {k: tuple(v.shape) for k, v in trees.flatten(expected).items()},
             f"the model of this config (initial weights {init.source!r})")
  return variables
