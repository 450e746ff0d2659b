"""The weights layer: every checkpoint layout, one room per job.

    from vit_jax import weights
    model, variables, preprocessing = weights.load("hf-hub:timm/vit_base_patch14_reg4_dinov2.lvd142m")

:func:`load` accepts

* a training workdir, its ``checkpoints/`` directory or one step directory
  (Orbax, written by ``train.py``);
* a ``.pth`` / ``.pt`` / ``.bin`` state dict of torchvision's, timm's or
  transformers' ViT (``torch.load(weights_only=True)``: no pickled code
  runs);
* a Google ``.npz`` (vision_transformer / big_vision, the R50+ViT hybrids
  included; ``allow_pickle=False``);
* a ``.safetensors`` file (ours, timm's, torchvision's or transformers'
  layout);
* a Hugging Face model directory (``config.json`` + ``model.safetensors``:
  transformers' ``save_pretrained`` or a timm hub repo);
* ``hf-hub:org/name[@revision]`` (e.g. ``hf-hub:google/vit-base-patch16-224``,
  ``hf-hub:timm/vit_base_patch14_reg4_dinov2.lvd142m``): the Hub repo's
  config and safetensors weights, from the local cache when offline;
* ``torchvision:WEIGHTS`` with ``model_name`` (e.g. ``torchvision:IMAGENET1K_V1``
  and ``vit_b_16``): torchvision's released weights, hash-checked.

and returns a :class:`Loaded`: the model, the variables, the preprocessing
those weights expect (unpacks as those three), label names and a one-line
description. Rooms: :mod:`~vit_jax.weights.files` (reading files and hubs),
:mod:`~vit_jax.weights.layouts` (one name table per PyTorch layout),
:mod:`~vit_jax.weights.mapping` (the table-driven mapper),
:mod:`~vit_jax.weights.google_npz` (Google's fix-ups),
:mod:`~vit_jax.weights.build` (-> model), :mod:`~vit_jax.weights.check`
(the one checker), :mod:`~vit_jax.weights.posemb` (resampling),
:mod:`~vit_jax.weights.trees` (our tree as data),
:mod:`~vit_jax.weights.names` (the names vit_jax knows, checked where they
are typed), :mod:`~vit_jax.weights.pretrained` (the records of the tags).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import warnings
from typing import Any, List, Optional

import numpy as np

from vit_jax import models
from vit_jax.data import labels, preprocessing as pp
from vit_jax.weights import build, files, layouts, trees
from vit_jax.weights.build import from_state_dict, from_tree, to_state_dict  # noqa: F401
from vit_jax.weights.check import check, check_keys  # noqa: F401
from vit_jax.weights.trees import arch_of  # noqa: F401

SUPPORTED = (
    "a training workdir / its checkpoints/ dir / a step dir (Orbax), a .pth, "
    ".pt or .bin state dict (torchvision, timm or transformers), a Google "
    ".npz, a .safetensors file, a Hugging Face model directory, "
    "hf-hub:org/name (e.g. hf-hub:google/vit-base-patch16-224), or "
    "torchvision:WEIGHTS (e.g. torchvision:IMAGENET1K_V1 with --model "
    "vit_b_16)")


class CheckpointError(ValueError):
  """A checkpoint that cannot be used (missing, unreadable, other model)."""


class GuessWarning(UserWarning):
  """Loading assumed something the weights do not say (how images must be
  prepared, an activation that differs by a little): the message names
  what was assumed and how to state it."""


@dataclasses.dataclass
class Loaded:
  """A model ready for inference and what goes with its weights.

  Unpacks as ``model, variables, preprocessing``."""

  model: Any
  variables: Any
  preprocessing: pp.Preprocessing
  label_names: Optional[List[str]] = None
  description: str = ""
  kind: str = ""  # 'orbax' | 'torchvision' | 'timm' | 'transformers' | 'npz' | 'safetensors'
  use_training_pipeline: bool = False  # TF eval transform of vit_jax runs
  info: dict = dataclasses.field(default_factory=dict)  # training run facts
  # What the head gives: 'classes' (scores), 'embedding' (a projection into
  # a joint image-text space, CLIP's), or 'none' (a backbone).
  head: str = "classes"

  def __iter__(self):
    return iter((self.model, self.variables, self.preprocessing))

  @property
  def num_classes(self) -> int:
    """Classes of the head (0 without one, or when it is an embedding)."""
    return 0 if self.head == "embedding" else int(self.model.num_classes or 0)

  @property
  def embedding_dim(self) -> int:
    """Width of an embedding head (CLIP's projection), else 0."""
    return int(self.model.num_classes or 0) if self.head == "embedding" else 0

  @property
  def image_size(self) -> int:
    return int(self.preprocessing.crop_size)

  def head_summary(self) -> str:
    """What the model's output is, in words (for messages)."""
    if self.head == "embedding":
      return (f"its head is a {self.embedding_dim}-d image embedding (CLIP's "
              f"projection into the image-text space), not class scores")
    if not self.num_classes:
      return ("it has no classification head (a backbone: its output is "
              "its pooled features, not class scores)")
    return f"its head gives scores of {self.num_classes} classes"

  def label(self, index: int) -> str:
    if self.label_names is not None:
      return self.label_names[index]
    return f"class {index}"

  @property
  def naflex(self) -> bool:
    """A NaFlex model: images of any shape, as patch sequences."""
    return getattr(self.model, "naflex", None) is not None

  def preprocess(self, image: np.ndarray):
    """One image, uint8 (H, W, 3) (or [0, 255] values; grey-scale
    repeated) -> float32 (S, S, 3), normalised as these weights expect; for
    a NaFlex model its unpadded patch sequence (:func:`vit_jax.data.naflex.
    preprocess`; :meth:`batch` pads a list of them). Anything else (floats in
    [0, 1], CHW, a batch) is a ValueError that says what was expected."""
    image = pp.check_image(image, "Loaded.preprocess")
    if self.naflex and self.use_training_pipeline:
      from vit_jax.data import transforms  # pylint: disable=import-outside-toplevel
      return transforms.preprocess_naflex_tf(image, self.preprocessing,
                                             self.model.patch_size)
    if self.naflex:
      from vit_jax.data import naflex  # pylint: disable=import-outside-toplevel
      return naflex.preprocess(image, self.preprocessing,
                               self.model.patch_size)
    if self.use_training_pipeline:
      from vit_jax.data import console  # pylint: disable=import-outside-toplevel
      console.quiet_native_logs()  # TensorFlow's load-time notices
      from vit_jax.data import transforms  # pylint: disable=import-outside-toplevel
      return transforms.preprocess_tf(image, self.preprocessing)
    return pp.preprocess_pil(image, self.preprocessing)

  def batch(self, samples):
    """:meth:`preprocess`'d images -> the model's input: stacked (N, S, S,
    3), or for a NaFlex model one batch padded to the recipe's
    ``max_seq_len`` (one length: one compilation)."""
    if self.naflex:
      from vit_jax.data import naflex  # pylint: disable=import-outside-toplevel
      return naflex.collate(samples, self.preprocessing.max_seq_len)
    return np.stack(samples)

  def preprocessing_summary(self) -> str:
    how = (" (the training pipeline's eval transform)"
           if self.use_training_pipeline else " (PIL)")
    return self.preprocessing.summary() + how


def load(source, *, model_name: Optional[str] = None, image_size=None,
         num_heads: Optional[int] = None, label_file: Optional[str] = None,
         preprocessing=None, **model_overrides) -> Loaded:
  """Loads ``source`` (see the module docstring).

  Args:
    source: a path, ``hf-hub:org/name`` or ``torchvision:WEIGHTS``.
    model_name: ours (``vit_b_16``, ``B/16``) or timm's
      (``vit_base_patch16_224``): needed only where the weights cannot tell
      (a timm state dict's activation, a torchvision conv stem); when given
      it is checked against the weights.
    image_size: run at this resolution (the position embedding is
      resampled); default: the weights' own.
    patch_size: run at this patch size (FlexiViT, timm's spelling): when it
      differs from the weights' patchify kernel, the kernel is resampled by
      pseudo-inverse and the position embedding to the new patch grid (a
      /16 checkpoint at ``patch_size=8`` runs the same images on a grid
      twice as fine). See :func:`vit_jax.weights.build.resize_patch`.
    num_heads: heads of a model of non-standard width.
    label_file: class names (one per line, or a JSON list).
    preprocessing: how images must be prepared for these weights (a
      :class:`~vit_jax.data.preprocessing.Preprocessing` or its dict), for files
      that do not say it; without it such a file's recipe is assumed from
      its layout and architecture, with a :class:`GuessWarning`.
    **model_overrides: options of the model built (``dtype``,
      ``scan_layers``, ``sow_attention_weights``, ``act``...).

  Raises:
    CheckpointError: the source does not exist, cannot be read, or holds
      weights of another architecture (the message says what and why).
  """
  try:
    if model_name:  # checked where it is typed: a misspelt tag or name
      from vit_jax.weights import pretrained  # pylint: disable=import-outside-toplevel
      pretrained.check_known(model_name)
    loaded = _load(str(source), model_name, image_size, num_heads,
                   model_overrides, _given(preprocessing))
    if image_size is not None and not loaded.naflex:
      # The size asked is the crop, also where no position embedding
      # says it (rotary positions only: DINOv3).
      h, w = models.pair(image_size)
      if h == w and preprocessing is None:
        loaded.preprocessing = loaded.preprocessing.resized(h)
    if label_file:
      names = labels.read_label_file(label_file)
      loaded.label_names = labels.check_labels(
          names, loaded.num_classes, f"The label file {label_file!r}")
  except CheckpointError:
    raise
  except (FileNotFoundError, ValueError, TypeError, KeyError) as e:
    raise CheckpointError(f"{source}: {e}") from e
  return loaded


def with_head(loaded: Loaded, num_classes: int) -> Loaded:
  """``loaded`` with a fresh head of ``num_classes`` (zeros: the start of
  fine-tuning; 0 removes it). The backbone's variables are the same
  arrays."""
  num_classes = int(num_classes)
  model = loaded.model.clone(num_classes=num_classes)
  variables = trees.wrap(dict(loaded.variables))
  params = dict(variables["params"])
  params.pop("head", None)
  if num_classes:
    width = (model.representation_size or model.hidden_size)
    params["head"] = {"kernel": np.zeros((width, num_classes), np.float32),
                      "bias": np.zeros((num_classes,), np.float32)}
  head = "classes" if num_classes else "none"
  return dataclasses.replace(
      loaded, model=model, variables=dict(variables, params=params),
      label_names=None, head=head,
      description=loaded.description + f" -> a new {num_classes}-class head")


def initial(name: str, *, num_classes=None, image_size=None,
            seed: int = 0, **options) -> Loaded:
  """A randomly initialised model of the architecture ``name`` (ours or
  timm's, a tag allowed), with the preprocessing of its pretrained record
  where it has one."""
  from vit_jax.weights import pretrained  # pylint: disable=import-outside-toplevel
  pretrained.check_known(name)  # a misspelt tag is refused, as timm does
  kw = dict(options)
  if num_classes is not None:
    kw["num_classes"] = int(num_classes)
  if image_size is not None:
    kw["image_size"] = image_size
  base = str(name).split(".", 1)[0]
  layouts.refuse_unsupported_timm(base)  # a timm name vit_jax does not build
  model = models.get_model(base, **kw)
  variables = random_variables(model, int(models.pair(
      model.image_size or 224)[0]), seed=seed)
  rec, pre = initial_preprocessing(name, model)
  return Loaded(model, variables, pre, None,
                f"{base} (random initialisation): "
                f"{trees.describe(_record(model))}", "init",
                head="classes" if model.num_classes else "none",
                info={"pretrained": rec.as_dict()} if rec else {})


def random_variables(model, image_size: int, seed: int = 0):
  """Random variables of ``model`` (its own layout), deterministic in
  ``seed``. Where the blocks are alike, they are drawn by the model's
  scanned form (``scan_layers=True``: each block initialiser compiled once
  for all the layers, not once per layer) and laid out per layer: ViT-B/16
  is ready in 5.1 s instead of 12.4 s, CaiT-XXS24 in 5.3 s instead of
  36.8 s (wall, 2 cores of an AMD Zen 1), XLA's compilation of the
  per-layer ``init`` (196 random-number loops for ViT-B) being most of it. The same initialisers, other draws than
  ``models.init_params(model)``'s."""
  import jax  # pylint: disable=import-outside-toplevel
  if model.scan_layers or model.num_layers < 2:
    return models.init_params(model, image_size, seed=seed)
  try:
    scanned = models.init_params(model.clone(scan_layers=True), image_size,
                                 seed=seed)
  except ValueError:  # blocks that differ (SAM's windowed and global ones)
    return models.init_params(model, image_size, seed=seed)
  variables = trees.unstack_layers(jax.device_get(scanned))
  check(model, variables, image_size, "the model initialised")
  return jax.device_put(variables)


def initial_preprocessing(name: str, model
                          ) -> "tuple[Optional[Any], pp.Preprocessing]":
  """(pretrained record or None, preprocessing) of :func:`initial`'s
  ``model`` built from ``name``: the record's recipe (of the tag, or of the
  architecture's default weights), else the family's (timm's names), else
  Google's; at the size the model is initialised at. A NaFlex model's
  recipe keeps its size and always has a token budget (the record's, else
  :func:`_with_naflex_budget`)."""
  from vit_jax.weights import pretrained  # pylint: disable=import-outside-toplevel
  try:
    rec = pretrained.lookup(name)
    pre = rec.preprocessing()
  except pretrained.UnknownName:
    rec, pre = None, _from_name(name) or pp.default_for(None, "timm")
  if model.naflex is None:  # the size it is initialised at
    size = models.pair(model.image_size or 224)
    pre = pre.resized(size[0]) if size[0] == size[1] else pre
  return rec, _with_naflex_budget(pre, model)


def _with_naflex_budget(pre: pp.Preprocessing, model) -> pp.Preprocessing:
  """``pre``, for a NaFlex model given a fixed-size recipe, with the
  budget of its crop: ``(crop // patch) ** 2`` patches."""
  if model.naflex is None or pre.max_seq_len:
    return pre
  return dataclasses.replace(
      pre, max_seq_len=(int(pre.crop_size) // model.patch_size) ** 2)


def _record(model) -> dict:
  """The model's architecture and its head's width, as described."""
  return dict(models.arch_record(model), num_classes=model.num_classes)


def _given(pre) -> Optional[pp.Preprocessing]:
  if pre is None or isinstance(pre, pp.Preprocessing):
    return pre
  if isinstance(pre, dict):
    return pp.Preprocessing.from_dict(pre)
  raise TypeError(f"preprocessing: expected a vit_jax.data.preprocessing."
                  f"Preprocessing or its dict, got {type(pre).__name__}")


def _default_labels(num_classes):
  return labels.default_labels(num_classes or 0, imagenet=True)


def _head_kind(model, variables, names) -> str:
  """'embedding' for a CLIP tower's projection (timm stores OpenAI's and
  OpenCLIP's ``proj`` as a head with a zero bias), 'none' without a head,
  else 'classes'."""
  if not model.num_classes:
    return "none"
  bias = trees.params_of(trees.unstack_layers(variables)).get(
      "head", {}).get("bias")
  if (model.pre_norm and names is None and bias is not None and
      not np.any(np.asarray(bias))):
    return "embedding"
  return "classes"


def _finish(model, variables, pre: pp.Preprocessing, names, what: str,
            kind: str) -> Loaded:
  crop = trees.native_image_size(trees.unstack_layers(variables), model)
  if crop:
    pre = pre.resized(crop)
  pre = _with_naflex_budget(pre, model)
  head = _head_kind(model, variables, names)
  if head == "embedding":
    names = None
  return Loaded(model, variables, pre, names,
                f"{what}: {trees.describe(_record(model), image_size=crop, head=head)}",
                kind, head=head)


def _assumed(src: str, pre: pp.Preprocessing, what: str) -> pp.Preprocessing:
  """``pre``, with the one warning that says it was assumed."""
  warnings.warn(
      f"{src}: the file does not say how images must be prepared for these "
      f"weights; assuming {what}: {pre.summary()}. State it with the name "
      f"of the weights, model_name='<name>.<tag>' (its pretrained record; "
      f"vit_jax.list_models(pretrained=True)), or preprocessing="
      f"Preprocessing(...) (in the CLIs: --model).", GuessWarning,
      stacklevel=_outside_this_package())
  return pre


def _outside_this_package() -> int:
  """The stacklevel of the first caller outside vit_jax.weights (where a
  warning should point)."""
  here = os.path.dirname(os.path.abspath(__file__))
  frame, level = sys._getframe(1), 1  # pylint: disable=protected-access
  while frame is not None and os.path.dirname(
      os.path.abspath(frame.f_code.co_filename)) == here:
    frame, level = frame.f_back, level + 1
  return level


# A timm state dict without its name: the family its structure shows, as a
# timm name whose recipe (layouts.timm_preprocessing_cfg) stands for it.
def _timm_family(model) -> "tuple[str, str]":
  if model.norm_type == "rms":
    return "AIMv2's (RMSNorm)", "aimv2_large_patch14_224"
  if model.distilled:
    return "DeiT's (a distillation token)", "deit_base_distilled_patch16_224"
  if model.classifier == "map":
    return "SigLIP's (a MAP head)", "vit_base_patch16_siglip_224"
  if model.layer_scale_init is not None and model.patch_size == 14:
    return "DINOv2's (LayerScale, patch 14)", "vit_base_patch14_dinov2"
  if model.layer_scale_init is not None:
    return "DeiT-III's (LayerScale)", "deit3_base_patch16_224"
  return "Google's AugReg ViTs'", "vit_base_patch16_224"


def _load(src: str, name, image_size, num_heads, overrides,
          given: Optional[pp.Preprocessing] = None) -> Loaded:
  kw = dict(image_size=image_size, num_heads=num_heads, **overrides)
  m = re.fullmatch(r"torchvision:(\w+)", src)
  if m:
    if not name:
      raise layouts.Undecided("torchvision weights need the variant: pass "
                              "model_name (e.g. vit_b_16; in the CLIs: "
                              "--model).", "model_name")
    enum = files.torchvision_weights(name, m.group(1))
    model, variables = build.from_state_dict(
        files.download_torchvision(enum), name, layout="torchvision", **kw)
    t = enum.transforms()
    pre = pp.Preprocessing(
        int(t.crop_size[0]), int(t.resize_size[0]),
        str(getattr(t.interpolation, "value", t.interpolation)),
        tuple(t.mean), tuple(t.std))
    cats = enum.meta.get("categories")
    return _finish(model, variables, pre, list(cats) if cats else None,
                   f"torchvision {name} {m.group(1)}", "torchvision")
  if src.startswith(files.HF_PREFIXES):
    return _load_dir(files.hub_dir(src), name, kw, src, given)
  if not os.path.exists(src):
    from vit_jax.weights import pretrained  # pylint: disable=import-outside-toplevel
    if pretrained.is_name(src):
      return _load_pretrained(pretrained.lookup(src), name, kw, given)
    ext = os.path.splitext(src)[1].lower()
    if not any(c in src for c in "/\\") and ext not in (
        files.TORCH_EXTS + (".npz", ".safetensors")):
      try:  # a name, not a path: say which names there are
        pretrained.lookup(src)
      except pretrained.UnknownName as e:
        raise CheckpointError(str(e)) from None
    raise CheckpointError(
        f"{src}: no such file or directory. Expected {SUPPORTED}, or a "
        f"pretrained name (vit_jax.list_models(pretrained=True)).")
  if os.path.isdir(src):
    if files.is_model_dir(src):
      return _load_dir(src, name, kw, src, given)
    return _load_orbax(src, name, image_size, overrides.get("patch_size"))
  ext = os.path.splitext(src)[1].lower()
  if ext == ".npz":
    model, variables = build.from_npz(files.read_npz(src), name, **kw)
    crop = trees.native_image_size(trees.unstack_layers(variables), model)
    pre = given or _from_name(name) or _assumed(
        src, pp.google(crop or 224), "Google's recipe for its .npz ViTs "
        "(timm's for AugReg)")
    return _finish(model, variables, pre, _default_labels(model.num_classes),
                   "Google .npz", "npz")
  if ext == ".safetensors":
    arrays, meta = files.read_safetensors(src)
    return _from_arrays(arrays, meta, name, kw, src, given)
  if ext in files.TORCH_EXTS:
    return _from_arrays(files.read_torch(src), {}, name, kw, src, given)
  raise CheckpointError(f"{src}: unknown checkpoint type {ext or '(none)'!r}. "
                        f"Expected {SUPPORTED}.")


def _load_pretrained(rec, name, kw, given) -> Loaded:
  """Released weights by their name: the record's repo (or torchvision's
  release), preprocessing, head and labels."""
  if name and name.split(".", 1)[0] != rec.architecture:
    raise CheckpointError(f"{rec.name} are weights of {rec.architecture}, "
                          f"not of {name}.")
  if rec.torchvision:
    loaded = _load(rec.source, rec.architecture, kw.get("image_size"),
                   kw.get("num_heads"),
                   {k: v for k, v in kw.items()
                    if k not in ("image_size", "num_heads")}, given)
  else:
    loaded = _load_dir(files.hub_dir(rec.source), rec.architecture, kw,
                       rec.source, given or rec.preprocessing())
    if rec.head == "embedding":
      loaded.head, loaded.label_names = "embedding", None
    elif rec.labels != "imagenet-1k" and loaded.label_names is not None and (
        loaded.label_names == _default_labels(loaded.model.num_classes)):
      loaded.label_names = None  # not ImageNet-1k's classes after all
    loaded.description = f"{rec.name} ({rec.hub}): " + (
        loaded.description.split(": ", 1)[-1])
  loaded.info["pretrained"] = rec.as_dict()
  return loaded


def _from_name(name) -> Optional[pp.Preprocessing]:
  """The recipe a timm name gives: its pretrained record's (the tag's, or
  the architecture's default weights'), else its family's; None for other
  names."""
  from vit_jax.weights import layouts, pretrained  # pylint: disable=import-outside-toplevel
  # A tag names the weights (vit_b_16.tv_in1k too); our bare variant names
  # name no weights, so they give no recipe.
  if name and pretrained.is_name(name) and (
      "." in name or name not in models.VARIANTS):
    try:
      return pretrained.lookup(name).preprocessing()
    except pretrained.UnknownName:
      pass
  if name and layouts.parse_timm_name(name) is not None:
    return pp.from_timm_cfg(_timm_cfg(name))
  return None


def _from_arrays(arrays, meta, name, kw, src, given=None) -> Loaded:
  """A safetensors / torch file: our layout (with its metadata) or a
  PyTorch library's."""
  model, variables, layout = build.from_arrays(arrays, meta, name, **kw)
  if given is not None:
    pre = given
  elif isinstance(meta.get("preprocessing"), dict):
    pre = pp.Preprocessing.from_dict(meta["preprocessing"])
  elif _from_name(name) is not None:
    pre = _from_name(name)
  elif layout == "timm":
    what, stand_in = _timm_family(model)
    pre = _assumed(src, pp.from_timm_cfg(_timm_cfg(stand_in)),
                   f"{what} recipe, from the weights' structure")
  elif layout == "torchvision":
    pre = _assumed(src, pp.default_for(None, layout),
                   "torchvision's IMAGENET1K_V1 recipe (its SWAG weights "
                   "resize bicubic, without a crop margin; name them "
                   "model_name='vit_b_16.tv_swag_e2e_in1k' and the like)")
  else:
    pre = _assumed(src, pp.default_for(None, layout),
                   "Google's ViT recipe (mean and std 0.5)")
  names = meta.get("label_names")
  names = (labels.check_labels(names, model.num_classes or 0, src)
           if isinstance(names, list) else _default_labels(model.num_classes))
  if src.endswith(".safetensors"):
    return _finish(model, variables, pre, names,
                   f"safetensors ({layout} layout)", "safetensors")
  return _finish(model, variables, pre, names, f"{layout} state dict", layout)


def _timm_cfg(name):
  from vit_jax.weights import layouts  # pylint: disable=import-outside-toplevel
  return layouts.timm_preprocessing_cfg(name)


def _load_dir(path: str, name, kw, src, given=None) -> Loaded:
  """A Hugging Face model directory: timm's hub layout (``architecture`` in
  config.json) or transformers' (``model_type``)."""
  from vit_jax.weights import layouts  # pylint: disable=import-outside-toplevel

  arrays, config, processor = files.read_model_dir(path)
  if "architecture" in config:  # timm
    arch_name = name or config["architecture"]
    model, variables = build.from_state_dict(arrays, arch_name, layout="timm",
                                             **kw)
    cfg = dict(_timm_cfg(arch_name), **(config.get("pretrained_cfg") or {}))
    pre = given or pp.from_timm_cfg(cfg)
    names = config.get("label_names")
    names = (labels.check_labels(list(names), model.num_classes or 0, src)
             if names else _default_labels(model.num_classes))
    loaded = _finish(model, variables, pre, names, f"timm {arch_name}",
                     "timm")
    loaded.info["model_name"] = arch_name  # the weights' own name
    return loaded
  model_type = config.get("model_type")
  if model_type not in layouts.HF_MODEL_TYPES:
    raise ValueError(
        f"config.json has model_type={model_type!r}: vit_jax loads timm hub "
        f"repos and transformers' {sorted(layouts.HF_MODEL_TYPES)} models.")
  model, variables = build.from_state_dict(
      arrays, name, layout=layouts.HF_MODEL_TYPES[model_type], config=config,
      **kw)
  if given is not None:
    pre = given
  elif processor:
    pre = pp.from_hf_processor(processor)
  else:
    pre = _assumed(src, pp.Preprocessing(224, 224, "bilinear", pp.HALF,
                                         pp.HALF, "squash"),
                   "ViTImageProcessor's defaults (no preprocessor_config."
                   "json)")
  id2label = config.get("id2label") or {}
  names = [id2label.get(str(i), id2label.get(i)) for i in
           range(model.num_classes or 0)] if id2label else None
  if names and (None in names or all(n == f"LABEL_{i}" for i, n in
                                     enumerate(names))):
    names = None
  return _finish(model, variables, pre,
                 names or _default_labels(model.num_classes),
                 f"transformers {config.get('_name_or_path') or src}",
                 "transformers")


def _load_orbax(path: str, name, image_size, patch_size=None) -> Loaded:
  from vit_jax.weights import orbax  # pylint: disable=import-outside-toplevel

  model, variables, info = orbax.load_for_inference(path)
  if name:
    build.check_name(_record(model), name, recorded=True)
  crop = int(info["image_size"])
  run_pp = ((info.get("config") or {}).get("pp") or {})
  resize = pp.eval_resize_size(
      float(run_pp.get("eval_crop_fraction", 0.875)), crop)
  if patch_size is not None and int(patch_size) != model.patch_size:
    model, variables = build.resize_patch(  # per-layer variables here
        model, variables, int(patch_size), image_size or crop)
  elif image_size is not None and int(image_size) != crop:
    variables = build.posemb.resize_posemb(
        variables, image_size, model.patch_size,
        num_prefix_tokens=0 if model.no_embed_class else model.num_prefix_tokens)
  if image_size is not None and int(image_size) != crop:
    resize = int(round(int(image_size) * resize / crop))
    crop = int(image_size)
  pre = pp.Preprocessing(crop, resize, "bilinear", tuple(info["mean"]),
                         tuple(info["std"]),
                         max_seq_len=info.get("naflex_seq_len"))
  names = info.get("label_names")
  names = labels.check_labels(names, model.num_classes or 0, path) if names else None
  desc = (f"vit_jax training checkpoint (step {info.get('step')}, dataset "
          f"{info.get('dataset')!r}): "
          f"{trees.describe(_record(model), image_size=crop)}")
  return Loaded(model, variables, pre, names, desc, "orbax",
                use_training_pipeline=True, info=dict(info))
