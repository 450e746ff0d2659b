"""The model a training config describes, and its initial variables.

From scratch (random init inside the jitted init step), or fine-tuning from
``config.init_weights``: anything :func:`vit_jax.weights.load` reads (a
``.pth`` / ``.safetensors`` / ``.npz`` file, a Hugging Face model directory,
``hf-hub:org/name``, a training workdir, ``torchvision:IMAGENET1K_V1`` or
just ``IMAGENET1K_V1`` with ``model_name``). The weights decide the
architecture (sizes, registers, LayerScale, pooling, activation ...);
``config.model`` gives the training options (dtype, dropout, drop path,
scan, remat, attention). A recipe's ``model_name`` and model sizes are used
only where they describe the weights; set on the command line they are
applied (the patch size by resampling) or refused when the weights say
otherwise (:func:`load_initial_weights`); the run says at start which.
Sources that need torch to be read (``.pth``,
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
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax import models, weights
from vit_jax.data import preprocessing as pp
from vit_jax.weights import build, files, layouts, names, pretrained, trees
from vit_jax.weights.check import check_keys

# VisionTransformer fields a training config sets even when the weights give
# the architecture; every other field comes from the weights.
TRAINING_OPTIONS = models.OPTION_FIELDS
# The sizes of config.model (a recipe's model). Fine-tuning, the weights
# decide them: the recipe's are used only where they describe the weights
# (they give what the weights do not store, e.g. the heads of a custom
# width); those set on the command line are applied (patch_size: the patch
# kernel resampled, FlexiViT; num_heads where the weights do not store it)
# or, contradicting the weights, refused.
_SIZES = ("patch_size", "hidden_size", "num_layers", "num_heads", "mlp_dim")
_SAY = {"patch_size": "patch", "hidden_size": "width", "num_layers": "layers",
        "num_heads": "heads", "mlp_dim": "MLP"}


@dataclasses.dataclass
class InitialWeights:
  """What a fine-tuning run starts from."""

  source: str
  arch: Dict[str, Any]  # the weights' architecture (JSON-able model fields)
  variables: Any  # host numpy arrays, per-layer layout
  preprocessing: pp.Preprocessing
  description: str
  # The run's model name: the weights' own where known (given, recorded,
  # the recipe's when it describes them), else our variant's or 'vit'.
  model_name: str = "vit"
  # One line said at start: where the architecture came from, what of the
  # recipe's model was not used, what was resampled.
  note: str = ""


def source_of(init_weights: str) -> str:
  """``config.init_weights`` as a :func:`vit_jax.weights.load` source: a bare
  torchvision weights name (``IMAGENET1K_V1``) means ``torchvision:NAME``."""
  w = str(init_weights)
  if re.fullmatch(r"[A-Z][A-Z0-9_]*", w) and not os.path.exists(w):
    return f"torchvision:{w}"
  return w


# Exit statuses of ``python -m vit_jax.weights`` that say why, as the
# exceptions they stand for.
_CHILD_ERRORS = {3: lambda why: build.NameMismatch(why, {}),
                 4: lambda why: layouts.Undecided(why, "model_name"),
                 5: lambda why: layouts.Undecided(why, "num_heads")}


def _convert_in_child(source: str, out: str,
                      tries: Sequence[Tuple[Optional[str], Dict[str, Any]]],
                      image_size: int) -> int:
  """``python -m vit_jax.weights SOURCE OUT``: torch stays in the child.
  ``tries``: (model name, stated sizes) in order, all in the one child
  (its imports once); returns the index of the one written, or raises the
  last one's error."""
  (model_name, stated), rest = tries[0], tries[1:]
  cmd = [sys.executable, "-m", "vit_jax.weights", source, out,
         "--image-size", str(image_size), "--overrides", json.dumps(stated)]
  if model_name:
    cmd += ["--model", model_name]
  if rest:
    cmd += ["--then", json.dumps([{"model": n, "overrides": s}
                                  for n, s in rest])]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (root, env.get("PYTHONPATH")) if p)
  p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
  if p.returncode != 0:
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    why = next((l[len("error: "):] for l in reversed(lines)
                if l.startswith("error: ")), "\n".join(lines[-15:]))
    cause = _CHILD_ERRORS.get(p.returncode, lambda why: None)(why)
    raise weights.CheckpointError(
        f"config.init_weights={source!r} could not be converted (python -m "
        f"vit_jax.weights, exit {p.returncode}): {why}") from cause
  last = (p.stdout.strip().splitlines() or [""])[-1]
  return int(last.split()[1]) if rest and last.startswith("try ") else 0


def _cause(e: BaseException, kind) -> Optional[BaseException]:
  """``e`` or the first exception of its ``__cause__`` chain of ``kind``."""
  while e is not None:
    if isinstance(e, kind):
      return e
    e = e.__cause__
  return None


def _variant(name: str) -> bool:
  """Ours (``vit_ti_4``, ``B/16``): a name that is only sizes."""
  return names.is_variant(name.split(".", 1)[0])


def _known(name: str) -> bool:
  try:
    pretrained.check_known(name)
  except ValueError:  # unknown, or a timm model vit_jax does not compute
    return False
  return True


def _sizes(fields: Dict[str, Any]) -> str:
  return ", ".join(f"{_SAY.get(k, k)} {v!r}" if isinstance(v, str) else
                   f"{_SAY.get(k, k)} {v}" for k, v in fields.items())


def load_initial_weights(config, stated=()) -> Optional[InitialWeights]:
  """The weights ``config.init_weights`` names, at ``config.image_size``
  (None: from scratch), and the architecture they decide.

  ``stated``: the config fields set on the command line (``'model_name'``,
  ``'model.num_heads'``...; :func:`vit_jax.train.loop.train_and_evaluate`
  passes train.py's ``--config.*`` overrides). They are applied
  (``model.patch_size``: the patch kernel resampled, FlexiViT;
  ``model.num_heads`` where the weights do not store the heads) or, when
  they contradict the weights, refused naming both values. The recipe's
  ``model_name`` and ``config.model`` sizes are used only where they
  describe the weights (a recipe for another model, e.g. configs/digits.py
  with a ViT-Ti file, is not used, and :attr:`InitialWeights.note` says
  so)."""
  if not config.init_weights:
    return None
  stated = set(stated)
  source = source_of(config.init_weights)
  named = not os.path.exists(source) and pretrained.is_name(source)
  rec = pretrained.lookup(source) if named else None
  if named:  # released weights by name: the record says where and what
    source = rec.source
  if not (os.path.exists(source) or source.startswith(
      files.HF_PREFIXES + ("torchvision:",))):
    raise weights.CheckpointError(
        f"config.init_weights={source!r}: no such file or directory. Expected "
        f"{weights.SUPPORTED}, a pretrained name "
        f"(vit_jax.list_models(pretrained=True)), a torchvision weights name "
        f"such as 'IMAGENET1K_V1', or '' to train from scratch.")
  given_name = config.model_name if "model_name" in stated else None
  given = {k: config.model[k] for k in _SIZES if f"model.{k}" in stated
           and config.model.get(k) is not None}
  # Weights that say what they are (a name, a Hugging Face directory, a
  # training workdir) take nothing from the recipe.
  says_itself = named or source.startswith(files.HF_PREFIXES) or (
      os.path.isdir(source))
  recipe = {} if says_itself else {
      k: config.model[k] for k in _SIZES if f"model.{k}" not in stated
      and config.model.get(k) is not None}
  recipe_name = None
  if not says_itself and given_name is None and _known(config.model_name):
    recipe_name = config.model_name
  size = int(config.image_size)

  def attempt(tries):
    """The first of ``tries`` ((name, sizes)) that loads, and its index;
    or the last one's error. PyTorch files: all in one child process."""
    src = rec.name if named else source
    if files.needs_torch(source):
      with tempfile.TemporaryDirectory(prefix="vit_jax_init_") as d:
        out = os.path.join(d, "init_weights.safetensors")
        i = _convert_in_child(src, out, tries, size)
        loaded = weights.load(out)
        loaded.info.setdefault("model_name", tries[i][0])
        return i, loaded
    for i, (name, sizes) in enumerate(tries):
      try:
        loaded = weights.load(src, model_name=name, image_size=size, **sizes)
      except weights.CheckpointError:
        if i + 1 < len(tries):
          continue
        raise
      loaded.info.setdefault("model_name", name)
      return i, loaded
    raise AssertionError("no tries")

  # torchvision's releases are only found by the variant's name: the
  # recipe's (configs/b16.py: vit_b_16) is theirs unless one is given.
  base_name = given_name
  if source.startswith("torchvision:") and base_name is None:
    base_name, recipe_name = config.model_name, None
  # What is tried, in order, until one loads: the recipe's model (if it
  # is these weights'), the recipe's timm name with only what was stated
  # (its sizes another depth's), then only what was stated.
  tries: List[Tuple[Optional[str], Dict[str, Any]]] = []
  patch = None
  if recipe_name is not None or recipe:
    # The recipe's model, if it is these weights': its sizes are checked
    # against them (and give what they do not store: the heads), but its
    # patch size is compared after, not resampled to. Our variant names are
    # only sizes (vit_ti_4: Ti's, patch 4), under the recipe's own.
    name, sizes = base_name or recipe_name, dict(recipe)
    if name is not None and _variant(name):
      sizes = dict(models.decode_variant(name.split(".", 1)[0]).as_kwargs(),
                   **sizes)
      name = base_name
    patch = sizes.pop("patch_size", None)
    tries.append((name, dict(sizes, **given)))
  if (recipe_name is not None and recipe and not _variant(recipe_name)):
    tries.append((recipe_name, dict(given)))
  tries.append((base_name, dict(given)))
  first = 0
  while True:
    try:
      i, loaded = attempt(tries[first:])
    except weights.CheckpointError as e:
      raise weights.CheckpointError(
          f"{e}{_what_to_pass(e, config, given_name, recipe)}") from e
    i += first
    if (i == 0 and len(tries) > 1 and patch is not None and
        patch != int(loaded.model.patch_size)):
      first = 1  # a recipe for another model: the next tries
      continue
    break
  used_recipe = i == 0 and len(tries) > 1
  if used_recipe:
    loaded.info["model_name"] = base_name or recipe_name
  arch = models.arch_record(loaded.model)
  for k, v in given.items():  # applied, or (the weights show it) refused
    if arch[k] != v:
      raise ValueError(
          f"--config.model.{k}={v} but the initial weights {source!r} have "
          f"{k}={arch[k]} ({loaded.description}). The weights decide the "
          f"architecture: drop the override or use other weights.")
  # Other model fields given (the pooling: a class-token model pooled by
  # 'gap' or 'token'): applied; the weights must still fit the model
  # (initial_variables checks every key).
  options = {k: config.model[k] for k in config.model
             if f"model.{k}" in stated and k in models.ARCH_FIELDS
             and k not in _SIZES and config.model[k] != arch.get(k)}
  arch.update(options)
  given = dict(given, **options)
  name = (rec.architecture if named else loaded.info.get("model_name") or
          models.variant_name(arch) or "vit")
  variables = trees.unstack_layers(trees.wrap(
      jax.tree_util.tree_map(np.asarray, dict(loaded.variables))))
  note = _note(config, source, loaded, arch, given, recipe, given_name,
               used_recipe)
  return InitialWeights(source, arch, variables, loaded.preprocessing,
                        loaded.description, name, note)


def _what_to_pass(e, config, given_name, recipe) -> str:
  """train.py's spelling of what the weights need said (appended to the
  error)."""
  undecided = _cause(e, layouts.Undecided)
  if _cause(e, build.NameMismatch) is not None and given_name:
    return (f" (--config.model_name={given_name} is not these weights' name: "
            f"drop it or pass theirs.)")
  if _cause(e, build.StatedMismatch) is not None:
    return (" (a --config.model.<size> on the command line: the weights "
            "decide the architecture; drop it or use other weights.)")
  if undecided is None:
    return ""
  ignored = ""
  if config.model_name != given_name or recipe:
    ignored = (f"; the recipe's {config.model_name!r}"
               + (f" ({_sizes(recipe)})" if recipe else "")
               + " does not describe these weights")
  if undecided.field == "num_heads":
    return (f" In train.py: --config.model.num_heads=N (or "
            f"--config.model_name=<their name>){ignored}.")
  return f" In train.py: --config.model_name=<their timm name>{ignored}."


def _note(config, source, loaded, arch, given, recipe, given_name,
          used_recipe) -> str:
  """The start line: the model the weights give, what of the recipe's was
  not used, what was resampled."""
  parts = [f"model from config.init_weights={source!r}: "
           f"{loaded.description}"]
  if not used_recipe:
    differ = {k: v for k, v in recipe.items() if arch.get(k) != v}
    unused = [f"model_name {config.model_name!r}"] if (
        given_name is None and config.model_name != loaded.info.get(
            "model_name")) else []
    unused += [_sizes(differ)] if differ else []
    if unused:
      parts.append(f"the recipe's model ({'; '.join(unused)}) is not used: "
                   f"the weights decide the architecture (--config.model_name "
                   f"/ --config.model.<size> on the command line state it)")
  if given:
    parts.append(f"as given: {_sizes(given)}" + (
        " (the patch-embedding kernel resampled to it where the weights' "
        "differs, FlexiViT)"
        if "patch_size" in given else ""))
  grid = int(config.image_size) // int(arch["patch_size"])
  pos = ("rotary positions, any size" if not arch.get("abs_pos_embed", True)
         else "a NaFlex grid, resized per image" if arch.get("naflex")
         else "the position embedding resampled to it where the weights' "
              "differs")
  parts.append(f"images at {config.image_size} px: a {grid}x{grid} grid of "
               f"{arch['patch_size']} px patches ({pos})")
  return "; ".join(parts) + "."


def model_kwargs(config, num_classes: int,
                 init: Optional[InitialWeights] = None) -> Dict[str, Any]:
  """JSON-able keyword arguments of ``models.get_model`` for this config:
  ``config.model`` from scratch; the weights' architecture with the
  config's training options when fine-tuning."""
  kw = {k: v for k, v in config.model.to_dict().items()
        if not (k in _SIZES and v is None)}  # None: the name's
  kw["remat_policy"] = kw.get("remat_policy") or None
  for k in ("dtype", "param_dtype"):
    if k in kw:
      try:
        kw[k] = jnp.dtype(kw[k]).name
      except TypeError:
        raise ValueError(f"config.model.{k}={kw[k]!r} is not a dtype "
                         f"(expected e.g. 'float32' or 'bfloat16').") from None
  if init is not None:  # the weights' architecture (load_initial_weights)
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
