"""Weights in any layout -> ``(model, variables)``, in one pass down:

    their state dict --(layout table)--> our flat tree --(arch_of)-->
    architecture (+ what the name / config decides) --(models.get_model)-->
    model --(check against its eval_shape tree)--> variables

:func:`from_state_dict` takes torchvision's, timm's or transformers' names;
:func:`from_tree` takes our own tree (Google ``.npz`` after its fix-ups, our
safetensors, a training checkpoint). Both check the weights against the
model they build, report every missing / unexpected / mis-shaped key by
name (in the layout's own names), resample the position embedding for
``image_size`` and stack the blocks for ``scan_layers=True``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from vit_jax import models
from vit_jax.models import _timm_archs
from vit_jax.weights import check, layouts, mapping, names, posemb, trees

# Architecture fields a caller may state about a checkpoint (they are checked
# against the weights) as opposed to options of how to run it.
_SIZE_FIELDS = ("hidden_size", "num_layers", "num_heads", "mlp_dim",
                "patch_size")


def _width(layout: mapping.Layout, sd: Mapping[str, np.ndarray]) -> int:
  """The model width, from the patch-embedding weight (ViTamin's: its
  stem's last convolution)."""
  for row in layout.flat_rows():
    if row.ours in (("params/embedding/kernel",),
                    (layouts.MBCONV + "pool_proj/kernel",)):
      w = sd.get(row.theirs)
      # A conv's (D, C, P, P), or a Linear over pre-cut patches (D, P*P*C).
      if w is not None and np.ndim(w) == (2 if row.op.name == "linear_patch"
                                          else 4):
        return int(np.shape(w)[0])
  raise ValueError(f"Not a {layout.name} ViT state dict: no "
                   f"patch-embedding weight of the layout's shape; first "
                   f"keys: {list(sd)[:6]}.")


def _refuse_unknown(layout: mapping.Layout, sd, unmatched) -> None:
  """Keys of features we lack, or of another network, are refused here by
  name; a few stray keys are left to the checker ("unexpected keys")."""
  bad = sorted({f"{k} ({what})" for k in unmatched
                for pat, what in layout.unsupported if pat in k})
  if bad:  # named first: a foreign CNN backbone has many keys of its own
    raise ValueError(
        f"This {layout.name} checkpoint uses features vit_jax's "
        f"VisionTransformer does not have: " + "; ".join(bad[:8]) +
        (f" and {len(bad) - 8} more" if len(bad) > 8 else "") + ".")
  if len(unmatched) > len(sd) // 2:
    raise ValueError(
        f"Not a {layout.name} VisionTransformer state dict (or one with parts "
        f"vit_jax does not know): {len(unmatched)} of its {len(sd)} keys are "
        f"no ViT parameter, e.g. {unmatched[:5]}. Is it another architecture "
        f"(Swin, ConvNeXt, ResNet...)?")


# Layouts whose weights cannot show what only the timm name decides: the
# hint the name must give, the message without a name, and the message for
# a name of another family.
_NAME_DECIDES = {
    "timm_eva": ("rope", layouts.NEEDS_A_NAME,
                 "is not a timm name of the Eva families vit_jax decodes "
                 "(DINOv3, EVA-02, Perception Encoder, EVA-01, timm's SBB "
                 "and Naver's RoPE ViTs, LingBot-Vision), and these weights "
                 "are an Eva model's (LayerScale gamma_1, q_bias / v_bias or "
                 "separate q_proj), whose rotary position embedding (or its "
                 "absence) the name must give."),
    "timm_sam": ("window_size", layouts.SAM_NEEDS_A_NAME,
                 "is not a timm name of SAM's image encoder (samvit_*), and "
                 "these weights are a VisionTransformerSAM's (a neck, "
                 "rel-pos tables): " + layouts.SAM_NEEDS_A_NAME.split(
                     ". ", 1)[1]),
    "timm_naflex": ("naflex", layouts.NAFLEX_NEEDS_A_NAME,
                    "is not a timm NaFlexVit name (naflexvit_*), and these "
                    "weights are a NaFlexVit's (embeds.*): "
                    + layouts.NAFLEX_NEEDS_A_NAME.split(". ", 1)[1]),
}

# How timm's class of a layout pools, where no name says (from the keys).
_POOLING = {"timm_beit": layouts.beit_pooling,
            "timm_relpos": layouts.relpos_pooling}

CLIP_NEEDS_A_NAME = (
    "These are the weights of a CLIP image tower (a LayerNorm before the "
    "blocks), whose activation they do not store: OpenAI's CLIP (and "
    "MetaCLIP) use QuickGELU, OpenCLIP's LAION / DataComp / DFN towers exact "
    "GELU, and the two give different numbers. Pass the timm name, e.g. "
    "model_name='vit_base_patch16_clip_quickgelu_224' for OpenAI's weights "
    "or 'vit_base_patch16_clip_224' for OpenCLIP's (in the CLIs: --model).")


# The tables' generator builds timm's own weights under names the tables do
# not hold yet (timm's registry vouches for them): within
# names_from_timm(), a timm name is neither looked up nor compared.
_FROM_TIMM = []


@contextlib.contextmanager
def names_from_timm():
  """Within: timm names are taken as timm's registry gives them (for
  :mod:`vit_jax.weights.pretrained`'s generator of the tables)."""
  _FROM_TIMM.append(True)
  try:
    yield
  finally:
    _FROM_TIMM.pop()


def check_known(name: str) -> None:
  """A ValueError (:class:`~vit_jax.weights.names.UnknownName`) for a
  name vit_jax does not know (a misspelt architecture or tag), naming the
  close ones."""
  if _FROM_TIMM and layouts.parse_timm_name(name) is not None:
    return
  names.check_known(name)


def _has_class_token(a):
  token = a.get("class_token")
  return (a.get("classifier", "token") == "token" if token is None
          else bool(token))


# What a checkpoint's keys show of its structure, whatever its sizes: (how
# it is said, how it is read from an architecture record). A timm name is
# compared on these (timm models are built at other widths, depths and
# resolutions under the same name, so sizes are not).
_SHOWN = (
    ("a class token", _has_class_token),
    ("a MAP head", lambda a: a.get("classifier") == "map"),
    ("registers", lambda a: int(a.get("num_registers") or 0)),
    ("a distillation token", lambda a: bool(a.get("distilled"))),
    ("LayerScale", lambda a: a.get("layer_scale_init") is not None),
    ("fc_norm", lambda a: bool(a.get("fc_norm"))),
    ("a final norm", lambda a: bool(a.get("final_norm", True))),
    ("a norm before the blocks", lambda a: bool(a.get("pre_norm"))),
    ("norm", lambda a: a.get("norm_type", "layer")),
    ("a norm after the patch embedding", lambda a: bool(a.get("patch_norm"))),
    ("a patch-embedding bias", lambda a: bool(a.get("patch_bias", True))),
    ("q/k/v biases", lambda a: bool(a.get("qkv_bias", True))),
    ("a key bias", lambda a: bool(a.get("key_bias", True)) or not a.get(
        "qkv_bias", True)),
    ("an attention output bias", lambda a: bool(a.get("proj_bias", True))),
    ("q/k norms", lambda a: bool(a.get("qk_norm"))),
    ("a norm inside the attention", lambda a: bool(a.get("attn_norm"))),
    ("gated MLP", lambda a: a.get("gated_mlp") or "none"),
    ("a norm inside the MLP", lambda a: bool(a.get("mlp_norm"))),
    ("a learned position embedding", lambda a: bool(a.get("abs_pos_embed",
                                                           True))),
    ("learned RoPE frequencies", lambda a: a.get("rope") == "mixed"),
    ("a NaFlex position grid", lambda a: a.get("naflex") is not None),
    ("a factorized position embedding",
     lambda a: bool(a.get("naflex_factorized"))),
    ("a conv stem", lambda a: bool(a.get("conv_stem"))),
    ("a ViTamin stem", lambda a: a.get("mbconv") is not None),
    ("a norm of the MLP's input", lambda a: bool(a.get("mlp_input_norm"))),
    ("relative position bias", lambda a: a.get("rel_pos_bias") or "none"),
    ("a relative position MLP", lambda a: a.get("rel_pos_mlp") or "none"),
    ("decomposed relative positions", lambda a: bool(a.get("rel_pos"))),
    ("a SAM neck", lambda a: bool(a.get("neck_chans"))),
    ("class-attention blocks", lambda a: int(a.get("class_attn_layers") or 0)),
    ("talking-heads attention", lambda a: bool(a.get("talking_heads"))),
    ("differential attention", lambda a: a.get("diff_attn") or "none"),
    ("parallel blocks", lambda a: a.get("parallel") or "none"),
)
# What only the name decides, compared where the weights come with a record
# of it (a training checkpoint, our safetensors).
_RECORDED = ("act", "layer_norm_eps", "rope", "rope_temperature", "naflex")


def _full_record(base: str) -> Dict[str, Any]:
  defaults = {f.name: f.default for f in dataclasses.fields(
      models.VisionTransformer) if f.name in models.FIELDS}
  return dict(defaults, **_timm_archs.ARCHS.get(base, {}))


def _structure(arch: Mapping[str, Any]) -> Dict[str, Any]:
  return {what: read(arch) for what, read in _SHOWN}


def _say(what, value) -> str:
  if value is True:
    return what
  if value is False or value == "none":
    article = what.split(" ", 1)[0] in ("a", "an")
    return f"no {what.split(' ', 1)[1] if article else what}"
  return f"{what} {value!r}" if isinstance(value, str) else f"{value} {what}"


def _check_timm_name(arch: Mapping[str, Any], name: str,
                     recorded: bool) -> None:
  """Raises :class:`NameMismatch` when the weights' structure (``arch``,
  as read from them) is not timm's ``name``'s, or, for weights with a
  record (``recorded``), when what only the name decides (activation,
  epsilon, RoPE, NaFlex resize) differs from their record."""
  base = name.split(".", 1)[0]
  want = _full_record(base)
  have_s, want_s = _structure(arch), _structure(want)
  diff = [f"{_say(k, have_s[k])} (the name: {_say(k, want_s[k])})"
          for k in have_s if have_s[k] != want_s[k]]
  if recorded:
    diff += [f"{k}={arch.get(k)!r} (the name: {want.get(k)!r})"
             for k in _RECORDED if k in arch and arch.get(k) != want.get(k)]
  if not diff:
    return
  alike = [n for n in sorted(_timm_names())
           if _structure(_full_record(n)) == have_s and (
               not recorded or all(arch.get(k) == _full_record(n).get(k)
                                   for k in _RECORDED if k in arch))]
  parsed = layouts.parse_timm_name(base) or {}
  alike.sort(key=lambda n: (  # same family and patch first
      (layouts.parse_timm_name(n) or {}).get("family") != parsed.get("family"),
      (layouts.parse_timm_name(n) or {}).get("patch_size") != arch.get(
          "patch_size"), n))
  hint = (f"Names of their structure: {', '.join(alike[:4])}."
          if alike else "No timm name vit_jax knows has their structure; "
                        "load them without a name.")
  raise NameMismatch(
      f"These weights are not a {base}: they have {'; '.join(diff)}. They "
      f"look like {trees.describe(arch)}. {hint}", {})


def _timm_names():
  return _timm_archs.ARCHS.keys()


def check_name(arch: Mapping[str, Any], name: str,
               stated: Optional[Mapping[str, Any]] = None, *,
               recorded: bool = False) -> None:
  """Raises unless ``name`` describes the weights whose architecture is
  ``arch``: a name vit_jax does not know (:func:`check_known`); our variant
  (``vit_b_16``, ``B/16``) of another size (``stated`` size fields, a
  custom-size checkpoint's ``num_layers=2``, replace the name's); a timm
  name of another structure (class token, registers, LayerScale, MAP head,
  fc_norm, biases, norms, gated MLP, position embedding...: every
  difference named, with the names of the weights' structure). timm names
  are not compared on sizes: people build timm models at other widths,
  depths and resolutions under the same name. ``recorded``: ``arch`` is a
  record that also says what only the name decides (activation, epsilon,
  RoPE), and those are compared too."""
  check_known(name)
  parsed = layouts.parse_timm_name(name)
  hybrid = bool(parsed and parsed["hybrid"])
  has_stem = arch.get("resnet") is not None
  if hybrid != has_stem:  # any name: a hybrid's has a ResNet stem, others none
    what = ("a hybrid, with a ResNet stem before the patch embedding"
            if hybrid else "a ViT without a ResNet stem")
    raise NameMismatch(
        f"{name} is {what}, but these weights have "
        f"{'one (conv_root, block1/...)' if has_stem else 'none'}. They "
        f"look like {trees.describe(arch)}.", {})
  base = str(name).split(".", 1)[0]  # vit_b_16.tv_in1k: weights of vit_b_16
  if layouts.parse_timm_name(name) is not None and not names.is_variant(base):
    if not _FROM_TIMM and base in _timm_archs.ARCHS:
      _check_timm_name(arch, base, recorded)
    return
  v = models.decode_variant(base)
  want = {k: getattr(v, k) for k in _SIZE_FIELDS}
  want.update({k: v for k, v in (stated or {}).items() if k in _SIZE_FIELDS})
  diff = [f"{k} {arch.get(k)} (expected {want[k]})" for k in want
          if arch.get(k) != want[k]]
  if diff:
    raise NameMismatch(
        f"The checkpoint is not a {base}: it has {', '.join(diff)}. It looks "
        f"like {trees.describe(arch)}; pass that variant instead.", want)


class StatedMismatch(ValueError):
  """Weights of other sizes than stated (``num_layers=2`` ...)."""


class NameMismatch(ValueError):
  """Weights of another architecture than their name says; ``sizes`` are
  the name's (our variants)."""

  def __init__(self, message, sizes):
    super().__init__(message)
    self.sizes = sizes


def _finish(variables, arch: Dict[str, Any], image_size, overrides,
            what: str, their: Optional[Tuple[mapping.Layout, dict]] = None,
            resample: Optional[str] = None, named_size=None):
  """arch -> model; check the weights against it; resample; stack.

  The checks run against the model at the weights' own patch size; a
  ``patch_size`` override that differs from it (:func:`new_patch_size`)
  then rebuilds both at the new one (:func:`resize_patch`). A resolution
  that is not a multiple of the patch is the model's ``image_size`` where
  it is the named model's own (SigLIP so400m/14 at 384: the convolution
  leaves the last pixels out, as timm's)."""
  options = {k: v for k, v in overrides.items()
             if k not in _SIZE_FIELDS and k != "image_size"}
  model = models.get_model(arch, **options)
  native = trees.native_image_size(variables, model)
  want = check.expected(model, native or 224)
  have = check.shapes(trees.flatten(variables))
  pos = "params/Transformer/posembed_input/pos_embedding"
  if native is None and pos in have and pos in want:  # a non-square grid
    want[pos] = have[pos][:2] + want[pos][2:]
  if native is None:  # relative position tables of a non-square grid
    for k in want:
      if k.endswith(layouts.REL_TABLE) and k in have:
        want[k] = have[k][:1] + want[k][1:]
  if their is None:
    check.check_keys(have, want, what)
  else:
    layout, sd = their
    check.check_keys(check.shapes(sd), mapping.expected(layout, want), what)
  size = image_size
  if size is None and named_size and native and named_size % model.patch_size:
    if named_size // model.patch_size * model.patch_size == native:
      size = named_size  # the released size, remainder left out
  if size is not None:
    h, w = models.pair(size)
    if (h % model.patch_size or w % model.patch_size) and size != named_size:
      raise ValueError(
          f"image_size {h}x{w} is not a multiple of the patch size "
          f"{model.patch_size}: expected multiples (e.g. "
          f"{h // model.patch_size * model.patch_size}x"
          f"{w // model.patch_size * model.patch_size}). timm's convolution "
          f"would leave the last pixels out; vit_jax does that only at a "
          f"model's own released resolution (vit_so400m_patch14_siglip_384 "
          f"at 384), named by its timm name.")
  patch = new_patch_size(arch, overrides)
  if patch is not None:  # FlexiViT: the same weights at another patch size
    model, variables = resize_patch(model, variables, patch, image_size)
  elif size is not None:  # as the weights' own library would
    variables = posemb.resize_posemb(
        variables, size, model.patch_size,
        num_prefix_tokens=trees.pos_prefix_rows(model),
        method=resample or (their[0].resample if their else "torchvision"),
        remainder_ok=True)
    variables = posemb.resize_rel_pos(variables, size, model.patch_size)
    h, w = models.pair(size)
    if h % model.patch_size or w % model.patch_size:
      model = model.clone(image_size=size)
  if model.scan_layers:
    variables = trees.stack_layers(variables)
  return model, variables


def new_patch_size(arch: Mapping[str, Any], overrides) -> Optional[int]:
  """A ``patch_size`` override that differs from the weights' patchify
  kernel: the patch size to run at (timm's ``create_model(...,
  patch_size=N)`` spelling), else None. A conv stem's patch size is its
  strides', so there ``patch_size`` only states them (and is checked)."""
  p = overrides.get("patch_size")
  if (p is None or arch.get("conv_stem") or arch.get("resnet") is not None
      or int(p) == int(arch["patch_size"])):
    return None
  return int(p)


def resize_patch(model, variables, patch_size: int, image_size=None):
  """``(model, variables)`` at another patch size (FlexiViT; timm's
  ``set_input_size(patch_size=...)``): the patch-embedding kernel resampled
  by pseudo-inverse, the position embedding resampled as timm does
  (antialiased bicubic) to the patch grid of ``image_size`` (default: the
  resolution the weights were made for, e.g. a /16 224px checkpoint at
  ``patch_size=8`` runs 224px images on a 28x28 grid). Per-layer trees."""
  if model.conv_stem or model.resnet is not None:
    raise ValueError("patch_size: a conv (or ResNet) stem's patch size is "
                     "fixed by its strides; only a single patchify conv can "
                     "be resampled.")
  size = image_size or trees.native_image_size(variables, model)
  if size is None:
    raise ValueError(
        f"patch_size={patch_size}: the weights' position embedding is not a "
        f"square grid, so their resolution is unknown; pass image_size.")
  h, w = models.pair(size)
  if h % patch_size or w % patch_size:
    raise ValueError(f"patch_size={patch_size} does not divide the image "
                     f"size {h}x{w}; pass an image_size it divides.")
  variables = posemb.resize_posemb(
      variables, (h, w), patch_size,
      num_prefix_tokens=0 if model.no_embed_class else model.num_prefix_tokens,
      method="timm")
  variables = posemb.resize_rel_pos(variables, (h, w), patch_size)
  variables = posemb.resize_patch_embed(variables, patch_size)
  return model.clone(patch_size=patch_size), variables


def _arch(variables, name, overrides, hints, image_size_hint=None):
  arch = trees.arch_of(variables, conv_stem=overrides.get("conv_stem"),
                       patch_size=overrides.get("patch_size") or (
                           _named(name).get("patch_size")),
                       image_size=image_size_hint)
  timm_name = name is not None and layouts.parse_timm_name(name) is not None
  if timm_name:
    check_name(arch, name)  # their structure, before the name's hints
  for k, v in hints.items():
    if "." in k:  # a field of a record: the ResNet stem's constants
      field, sub = k.split(".", 1)
      if arch.get(field) is not None:
        arch[field] = dataclasses.replace(arch[field], **{sub: v})
    elif k in ("window_size", "global_attn_indexes") and arch.get(
        "window_size"):
      continue  # SAM's rel-pos tables showed them: the weights decide
    elif k != "num_heads":
      arch[k] = v
  if arch.get("classifier") == "token":  # the class token is required: a
    arch["class_token"] = None  # tree without one is missing a key
  stated = {k: overrides[k] for k in _SIZE_FIELDS
            if overrides.get(k) is not None}
  if new_patch_size(arch, overrides) is not None:
    del stated["patch_size"]  # a patch size to run at, not the weights'
  if name is not None and not timm_name:
    check_name(arch, name, stated)
  else:
    diff = [f"{k}={arch[k]}, not {v} as given" for k, v in stated.items()
            if arch[k] != v]
    if diff:  # stated sizes describe the checkpoint: check them
      raise StatedMismatch(f"The checkpoint has {'; '.join(diff)}. It looks like "
                       f"{trees.describe(arch)}.")
  return arch


def _named(name: Optional[str]) -> Dict[str, Any]:
  """The sizes a name states: ours all of them, timm's patch and width."""
  parsed = layouts.parse_timm_name(name) if name else None
  if parsed:
    return {"patch_size": parsed["patch_size"], "hidden_size": parsed["width"]}
  try:
    return (models.decode_variant(name.split(".", 1)[0]).as_kwargs()
            if name else {})
  except ValueError:
    return {}


def _heads(name, num_heads, hints, width, shown=None) -> int:
  """Stated, else what the weights show (CaiT's talking-heads maps, timm's
  relative position MLPs and tables: :func:`layouts.shown_heads`), else
  the name's (if the width is the name's), else the width's usual
  number."""
  named = _named(name)
  if num_heads:
    return int(num_heads)
  if shown:
    return int(shown)
  if named.get("hidden_size") in (None, width):
    if hints.get("num_heads") or named.get("num_heads"):
      return int(hints.get("num_heads") or named["num_heads"])
  return layouts.heads_for_width(width)


def from_state_dict(state_dict, name: Optional[str] = None, *,
                    layout: Optional[str] = None,
                    config: Optional[Mapping[str, Any]] = None,
                    image_size=None, num_heads: Optional[int] = None,
                    **overrides):
  """A torchvision / timm / transformers ViT state dict -> (model, variables).

  Args:
    state_dict: names -> tensors or arrays (a torch module, or a training
      checkpoint ``{'model': ...}``, is unwrapped).
    name: the model's name: ours (``vit_b_16``, ``B/16``) or timm's
      (``vit_small_patch14_reg4_dinov2``): it decides what the keys cannot
      (timm's activation, LayerNorm epsilon, heads) and is checked against
      the weights.
    layout: a name of :data:`vit_jax.weights.layouts.LAYOUTS` ('torchvision',
      'timm' (VisionTransformer's, Eva's, Beit's, SAM's, Cait's or
      VisionTransformerRelPos's names, from the keys), 'timm_eva',
      'timm_cait', 'timm_relpos',
      'transformers', 'transformers_dinov2', 'transformers_dinov2_reg',
      'transformers_dinov3', 'transformers_clip', 'transformers_siglip',
      'transformers_aimv2', 'transformers_vit_mae', 'transformers_ijepa');
      default: read from the keys.
    config: a Hugging Face ``config.json`` (transformers layouts).
    image_size: resample the position embedding for this resolution.
    num_heads: the heads, where neither the name nor the width says.
    **overrides: :class:`~vit_jax.models.VisionTransformer` options (dtype,
      scan_layers, ...); size fields (``num_layers``...) are checked.
  """
  from vit_jax.weights import files  # pylint: disable=import-outside-toplevel

  if num_heads:  # stated like any size field: checked against the weights
    overrides = dict(overrides, num_heads=int(num_heads))
  if name is not None:
    check_known(name)
  # Read in place: each tensor is copied once, where it lands (a scanned
  # model's stacked blocks are new arrays already; trees.owned copies the
  # rest), not first here and then again to stack it.
  sd = files.unwrap(state_dict, f"a {layout or 'ViT'} state_dict",
                    copy=False)
  detected = layout is None
  layout = layout or layouts.detect(list(sd))
  if layout is None:
    keys = list(sd)
    raise ValueError(
        "Not a Vision Transformer checkpoint of torchvision's, timm's or "
        "transformers' layout (no 'conv_proj' / 'encoder.layers.*', "
        "'patch_embed' / 'blocks.*' nor 'embeddings.patch_embedding(s)' keys); "
        f"it has {len(keys)} entries, e.g. {keys[:5]}. Is it another "
        f"architecture (e.g. a ResNet)?")
  if layout == "timm":  # VisionTransformer's names or Eva's
    layout = layouts.timm_layout(mapping.canonical(layouts.TIMM, sd))
  for what, keys in mapping.dropped(layouts.LAYOUTS[layout], sd).items():
    warnings.warn(f"Not loaded: {len(keys)} keys of {what}, e.g. "
                  f"{keys[0]!r}.", stacklevel=2)
  sd = mapping.canonical(layouts.LAYOUTS[layout], sd)
  if detected and layout == "transformers_ijepa":
    layouts.refuse_vit_without_class_token(sd)
  layout = layouts.refine(layout, sd)
  table = layouts.LAYOUTS[layout]
  hints: Dict[str, Any] = {}
  parsed = None
  if layout.startswith("timm") and name is not None:
    layouts.refuse_unsupported_timm(name)
    hints = layouts.timm_hints(name)
    parsed = layouts.parse_timm_name(name)
  elif layout.startswith("transformers"):
    hints = layouts.transformers_hints(config or {}, layout)
  if layout in _POOLING and "classifier" not in hints:
    hints["classifier"] = _POOLING[layout](sd)  # as timm's class pools
  _refuse_unknown(table, sd, mapping.unmatched(table, sd))
  if layout == "timm_cait" and not any(k.startswith("blocks_token_only.")
                                       for k in sd):
    raise ValueError(layouts.CAIT_WITHOUT_CLASS_ATTENTION)
  if layout == "timm" and name is None and "norm_pre.weight" in sd:
    raise layouts.Undecided(CLIP_NEEDS_A_NAME, "model_name")
  if layout in _NAME_DECIDES and _NAME_DECIDES[layout][0] not in hints:
    _, needs, wrong = _NAME_DECIDES[layout]
    if name is None:
      raise layouts.Undecided(needs, "model_name")
    raise NameMismatch(f"{name!r} {wrong}", {})
  heads = _heads(name, overrides.get("num_heads"), hints,
                 _width(table, sd), layouts.shown_heads(sd))
  flat, _ = mapping.to_ours(table, sd, {
      "model": heads, "map": int(hints.get("map_heads") or heads),
      "heads_width": (heads, _width(table, sd))})
  variables = trees.unflatten(flat)
  if "params" not in variables:
    raise ValueError(f"Not a {layout} ViT state dict: none of its keys maps "
                     f"to a parameter.")
  hints = {**hints, **dict(table.fixed)}
  hint = _native_hint(layout, name, config)
  what = f"{layout}'s "
  try:
    arch = _arch(variables, name, overrides, hints, image_size_hint=hint)
  except NameMismatch as e:
    # List, in their names, everything that differs from the named model.
    arch = dict(_arch(variables, None, {}, hints, image_size_hint=hint),
                **e.sizes)
    try:
      _finish(variables, arch, None, overrides, what + name, (table, sd))
    except ValueError as check_error:
      raise NameMismatch(f"{e}\n{check_error}", e.sizes) from None
    raise
  resample = parsed["resample"] if parsed else table.resample
  if (image_size is None and resample.startswith("radio") and
      np.shape(flat.get(_POS, ()))[1:2] == (128 * 128,)):
    image_size = parsed["image_size"]  # RADIO's 128x128 grid -> the name's
  model, variables = _finish(
      variables, arch, image_size, overrides,
      what + (name or trees.describe(arch)), (table, sd), resample=resample,
      named_size=parsed and parsed["image_size"])
  return model, trees.owned(variables)


def _native_hint(layout, name, config):
  """The checkpoint's resolution where the name or config says it."""
  if config and config.get("image_size"):
    return config["image_size"]
  if layout.startswith("timm") and name is not None:
    parsed = layouts.parse_timm_name(name)
    return parsed and parsed["image_size"]
  return None


def from_tree(variables, name: Optional[str] = None, *, image_size=None,
              arch: Optional[Mapping[str, Any]] = None, **overrides):
  """Our own tree (per-layer or scanned) -> (model, variables). ``arch``
  (e.g. stored beside the weights) takes precedence over what is read."""
  variables = trees.unstack_layers(trees.wrap(variables))
  stored = {k: v for k, v in (arch or {}).items() if k in models.FIELDS}
  stem = {"conv_stem": stored["conv_stem"]} if stored.get("conv_stem") else {}
  read = _arch(variables, name, {**stem, **overrides}, {})
  read.update(stored)
  if name is not None and stored:  # a record: what only a name decides too
    check_name(read, name, recorded=True)
  what = name or trees.describe(read)
  return _finish(variables, read, image_size, overrides, what)


def to_state_dict(variables, layout: str) -> "Dict[str, np.ndarray]":
  """Our tree -> a state dict in ``layout`` (numpy, float32). ``'timm'``
  picks timm's class from the tree (:func:`layouts.timm_layout_of`: Eva for
  DINOv3, EVA-02, PE; else VisionTransformer). Where the layout places the
  class token's position otherwise than the tree (transformers' DINOv2 with
  registers gives the class token a position row, timm's does not), the
  tree is rewritten to the same function first: timm folds the row into
  the class token, transformers gets a zero row."""
  flat = trees.flatten(trees.wrap(trees.unstack_layers(trees.wrap(variables))))
  if layout == "timm":
    layout = layouts.timm_layout_of(flat)
  if layout.startswith("timm") or layout == "transformers_dinov2_reg":
    arch = trees.arch_of(trees.unflatten(flat))
    if layout.startswith("timm") and arch.get("no_embed_registers"):
      flat = _fold_class_position(flat)
    elif (layout == "transformers_dinov2_reg" and arch["no_embed_class"] and
          arch["num_registers"]):
      flat = _unfold_class_position(flat)
  return mapping.to_theirs(layouts.LAYOUTS[layout], flat)


_POS = "params/Transformer/posembed_input/pos_embedding"


def _fold_class_position(flat):
  """[cls + pos row 0], pos rows 1: (no_embed_class)."""
  flat = dict(flat)
  pe = trees.f32(flat[_POS])
  flat["params/cls"] = trees.f32(flat["params/cls"]) + pe[:, :1]
  flat[_POS] = pe[:, 1:]
  return flat


def _unfold_class_position(flat):
  """A zero position row for the class token, which keeps its value."""
  flat = dict(flat)
  pe = trees.f32(flat[_POS])
  flat[_POS] = np.concatenate([np.zeros_like(pe[:, :1]), pe], axis=1)
  return flat


def from_transformers(state_dict_or_dir, config=None, *, image_size=None,
                      **overrides):
  """Hugging Face transformers weights (a state dict, a model, or a
  ``save_pretrained`` directory) -> (model, variables). The layout comes
  from ``config`` (a dict or a transformers config; a directory's own
  ``config.json``; a model's ``.config``); without one, from the keys."""
  from vit_jax.weights import files  # pylint: disable=import-outside-toplevel

  if hasattr(config, "to_dict"):
    config = config.to_dict()
  if isinstance(state_dict_or_dir, (str, os.PathLike)):
    arrays, dir_config, _ = files.read_model_dir(str(state_dict_or_dir))
    state_dict_or_dir, config = arrays, config or dir_config
  elif hasattr(state_dict_or_dir, "config") and config is None:
    config = state_dict_or_dir.config.to_dict()  # a transformers model
  return from_state_dict(state_dict_or_dir,
                         layout=layouts.transformers_layout(config),
                         config=config, image_size=image_size, **overrides)


def from_npz(arrays, name: Optional[str] = None, *, image_size=None,
             **overrides):
  """A Google ``.npz``'s arrays (vision_transformer or big_vision) ->
  (model, variables), after :mod:`~vit_jax.weights.google_npz`'s
  fix-ups; a hybrid (R50+ViT) as Google's module computes it (its tanh
  GELU unless ``act`` is given)."""
  from vit_jax.weights import google_npz  # pylint: disable=import-outside-toplevel
  variables = google_npz.npz_to_tree(arrays, image_size=image_size)
  if google_npz.is_hybrid(variables):  # Google's module's function
    overrides = {**google_npz.HYBRID_DEFAULTS, **overrides}
  return from_tree(variables, name, image_size=image_size, **overrides)


def from_arrays(arrays, meta: Mapping[str, Any], name: Optional[str] = None,
                **kwargs):
  """A file's arrays in our layout (with its metadata: ``format``
  ``'vit_jax'``, the ``arch`` record) or a PyTorch library's ->
  (model, variables, layout name)."""
  if meta.get("format") == "vit_jax" or any(k.startswith("params/")
                                            for k in arrays):
    model, variables = from_tree(trees.unflatten(arrays), name,
                                 arch=meta.get("arch"), **kwargs)
    return model, variables, "vit_jax"
  model, variables = from_state_dict(arrays, name, **kwargs)
  return model, variables, layouts.detect(list(arrays)) or "unknown"


def from_safetensors(path: str, name: Optional[str] = None, **kwargs):
  """A safetensors file of any layout -> (model, variables, metadata)
  (metadata JSON-decoded; ``layout`` says which names the file uses)."""
  from vit_jax.weights import files  # pylint: disable=import-outside-toplevel
  arrays, meta = files.read_safetensors(path)
  model, variables, layout = from_arrays(arrays, meta, name, **kwargs)
  meta.setdefault("layout", layout)
  return model, variables, meta
