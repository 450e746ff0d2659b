"""The PyTorch-side layouts of our tree: one table each.

Each table lists, in the library's own ``state_dict()`` order, their key
pattern, our path(s) and how the tensor maps (:mod:`vit_jax.weights.mapping`
derives both directions and the expected keys from it). Adding a layout is
adding a table here; what the keys cannot say (the activation of a timm
model, the number of heads in a fused q/k/v) comes from the model name or
the checkpoint's config, decoded at the end of this file.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Mapping, Optional

from vit_jax.weights.mapping import (
    HEADS, HEADS_BIAS, Layout, Repeat, Row, const, conv, dense, expand,
    fused_qkv, norm, out_proj, split_qkv, zeros)

E = "params/Transformer/encoderblock_{i}/"  # our block
ATTN = E + "MultiHeadDotProductAttention_0"
POS = "params/Transformer/posembed_input/pos_embedding"
MAP = "params/MAPHead_0/"


def _has(path):
  return lambda flat: path in flat


def _lacks(path):
  return lambda flat: path not in flat


# ------------------------------------------------------------ torchvision ---
_TV = "encoder.layers.encoder_layer_{i}."
_STEM = "conv_proj.conv_bn_relu_{j}."
_HAS_STEM = "params/stem_convs_0/kernel"

TORCHVISION = Layout("torchvision", rows=(
    Row("class_token", ("params/cls",)),
    Repeat((
        *conv(_STEM + "0.", "params/stem_convs_{j}")[:1],  # no bias
        *norm(_STEM + "1.", "params/stem_bns_{j}"),
        Row(_STEM + "1.running_mean", ("batch_stats/stem_bns_{j}/mean",)),
        Row(_STEM + "1.running_var", ("batch_stats/stem_bns_{j}/var",)),
        Row(_STEM + "1.num_batches_tracked",
            ("batch_stats/stem_bns_{j}/mean",), const(0)),
    )),
    *(Row(r.theirs, r.ours, r.op, _has(_HAS_STEM))
      for r in conv("conv_proj.conv_last.", "params/embedding")),
    *(Row(r.theirs, r.ours, r.op, _lacks(_HAS_STEM))
      for r in conv("conv_proj.", "params/embedding")),
    Row("encoder.pos_embedding", (POS,)),
    Repeat((
        *norm(_TV + "ln_1.", E + "LayerNorm_0"),
        *fused_qkv(_TV + "self_attention.in_proj_weight",
                   _TV + "self_attention.in_proj_bias", ATTN),
        *out_proj(_TV + "self_attention.out_proj.", ATTN),
        *norm(_TV + "ln_2.", E + "LayerNorm_1"),
        *dense(_TV + "mlp.0.", E + "MlpBlock_0/Dense_0"),
        *dense(_TV + "mlp.3.", E + "MlpBlock_0/Dense_1"),
    )),
    *norm("encoder.ln.", "params/Transformer/encoder_norm"),
    *dense("heads.pre_logits.", "params/pre_logits"),
    *dense("heads.head.", "params/head"),
), aliases=(
    (r"^module\.", ""),  # DistributedDataParallel
    (r"\.mlp\.linear_1\.", ".mlp.0."),  # torchvision < 0.13
    (r"\.mlp\.linear_2\.", ".mlp.3."),
), fixed=(("classifier", "token"),))

# ------------------------------------------------------------------- timm ---
_TM = "blocks.{i}."

TIMM = Layout("timm", rows=(
    Row("cls_token", ("params/cls",)),
    Row("reg_token", ("params/registers",)),
    Row("pos_embed", (POS,)),
    *conv("patch_embed.proj.", "params/embedding"),
    *norm("norm_pre.", "params/Transformer/pre_norm"),
    Repeat((
        *norm(_TM + "norm1.", E + "LayerNorm_0"),
        *fused_qkv(_TM + "attn.qkv.weight", _TM + "attn.qkv.bias", ATTN),
        *out_proj(_TM + "attn.proj.", ATTN),
        Row(_TM + "ls1.gamma", (E + "LayerScale_0/scale",)),
        *norm(_TM + "norm2.", E + "LayerNorm_1"),
        *dense(_TM + "mlp.fc1.", E + "MlpBlock_0/Dense_0"),
        *dense(_TM + "mlp.fc2.", E + "MlpBlock_0/Dense_1"),
        Row(_TM + "ls2.gamma", (E + "LayerScale_1/scale",)),
    )),
    *norm("norm.", "params/Transformer/encoder_norm"),
    *norm("fc_norm.", "params/fc_norm"),
    Row("attn_pool.latent", (MAP + "probe",)),
    Row("attn_pool.q.weight", (MAP + "MultiHeadDotProductAttention_0/query/kernel",),
        HEADS),
    Row("attn_pool.q.bias", (MAP + "MultiHeadDotProductAttention_0/query/bias",),
        HEADS_BIAS),
    *fused_qkv("attn_pool.kv.weight", "attn_pool.kv.bias",
               MAP + "MultiHeadDotProductAttention_0", names=("key", "value")),
    *out_proj("attn_pool.proj.", MAP + "MultiHeadDotProductAttention_0"),
    *norm("attn_pool.norm.", MAP + "LayerNorm_0"),
    *dense("attn_pool.mlp.fc1.", MAP + "MlpBlock_0/Dense_0"),
    *dense("attn_pool.mlp.fc2.", MAP + "MlpBlock_0/Dense_1"),
    *dense("head.", "params/head"),
), aliases=((r"^module\.", ""),), resample="timm", unsupported=(
    ("dist_token", "DeiT's distillation token (VisionTransformerDistilled)"),
    ("head_dist.", "DeiT's distillation head"),
    (".q_norm.", "q/k normalisation (qk_norm)"),
    (".k_norm.", "q/k normalisation (qk_norm)"),
    (".attn.norm.", "a norm inside attention (scale_attn_norm)"),
    (".mlp.norm.", "a norm inside the MLP (scale_mlp_norm)"),
    (".w12.", "a SwiGLU MLP"),
    (".mlp.fc1_g.", "a gated (GLU) MLP"),
    ("patch_embed.norm.", "a norm after the patch embedding"),
    ("patch_embed.backbone.", "a hybrid CNN backbone (R50+ViT)"),
    ("attn_pool.pos_embed", "a position embedding in the attention pool"),
    (".lambda_", "differential attention"),
))

# ----------------------------------------------------- Hugging Face (ViT) ---
# transformers v5's module names (what ``state_dict()`` has and
# ``load_state_dict`` takes); files on the Hub and from ``save_pretrained``
# keep the v4 names, which the aliases rename on the way in.
_HF = "layers.{i}."

TRANSFORMERS_VIT = Layout("transformers", rows=(
    Row("embeddings.cls_token", ("params/cls",)),
    Row("embeddings.position_embeddings", (POS,)),
    *conv("embeddings.patch_embeddings.projection.", "params/embedding"),
    Repeat((
        *split_qkv(_HF + "attention.", ATTN,
                   names=("q_proj", "k_proj", "v_proj")),
        *out_proj(_HF + "attention.o_proj.", ATTN),
        *norm(_HF + "layernorm_before.", E + "LayerNorm_0"),
        *norm(_HF + "layernorm_after.", E + "LayerNorm_1"),
        *dense(_HF + "mlp.fc1.", E + "MlpBlock_0/Dense_0"),
        *dense(_HF + "mlp.fc2.", E + "MlpBlock_0/Dense_1"),
    )),
    *norm("layernorm.", "params/Transformer/encoder_norm"),
    *dense("pooler.dense.", "params/pre_logits"),
    *dense("classifier.", "params/head"),
), aliases=(
    (r"^module\.", ""), (r"^vit\.", ""),
    (r"^encoder\.layer\.(\d+)\.attention\.attention\.(q|k|v)[a-z]*\.",
     r"layers.\1.attention.\2_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.",
     r"layers.\1.attention.o_proj."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.mlp.fc1."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.mlp.fc2."),
    (r"^encoder\.layer\.", "layers."),
), unsupported=(
    ("embeddings.mask_token", "a mask token (masked image modeling)"),
), fixed=(("classifier", "token"),))

# transformers' DINOv2 (Dinov2Model). Its mask token serves masked-image
# training only: dropped on the way in, zeros on the way out.
_HFD = "encoder.layer.{i}."
TRANSFORMERS_DINOV2 = Layout("transformers_dinov2", rows=(
    Row("embeddings.cls_token", ("params/cls",)),
    Row("embeddings.mask_token", ("params/cls",), zeros(lambda s: s[1:])),
    Row("embeddings.position_embeddings", (POS,)),
    *conv("embeddings.patch_embeddings.projection.", "params/embedding"),
    Repeat((
        *norm(_HFD + "norm1.", E + "LayerNorm_0"),
        *split_qkv(_HFD + "attention.", ATTN,
                   names=("q_proj", "k_proj", "v_proj")),
        *out_proj(_HFD + "attention.o_proj.", ATTN),
        Row(_HFD + "layer_scale1.lambda1", (E + "LayerScale_0/scale",)),
        *norm(_HFD + "norm2.", E + "LayerNorm_1"),
        *dense(_HFD + "mlp.fc1.", E + "MlpBlock_0/Dense_0"),
        *dense(_HFD + "mlp.fc2.", E + "MlpBlock_0/Dense_1"),
        Row(_HFD + "layer_scale2.lambda1", (E + "LayerScale_1/scale",)),
    )),
    *norm("layernorm.", "params/Transformer/encoder_norm"),
), aliases=(
    (r"^module\.", ""), (r"^dinov2\.", ""),
    (r"\.attention\.attention\.(q|k|v)[a-z]*\.", r".attention.\1_proj."),
    (r"\.attention\.output\.dense\.", ".attention.o_proj."),
), unsupported=(
    ("register_tokens", "registers in transformers' layout (use timm's: "
     "hf-hub:timm/vit_*_reg4_dinov2.lvd142m)"),
    (".weights_in.", "a SwiGLU MLP"),
), fixed=(("classifier", "token"),))

# transformers' CLIP and SigLIP image towers (CLIPVisionModel,
# SiglipVisionModel, or the vision half of CLIPModel / SiglipModel).
_HFC = "encoder.layers.{i}."
_HF_TOWER = (
    *norm(_HFC + "layer_norm1.", E + "LayerNorm_0"),
    *split_qkv(_HFC + "self_attn.", ATTN, names=("q_proj", "k_proj", "v_proj")),
    *out_proj(_HFC + "self_attn.out_proj.", ATTN),
    *norm(_HFC + "layer_norm2.", E + "LayerNorm_1"),
    *dense(_HFC + "mlp.fc1.", E + "MlpBlock_0/Dense_0"),
    *dense(_HFC + "mlp.fc2.", E + "MlpBlock_0/Dense_1"),
)
_TOWER_ALIASES = ((r"^module\.", ""), (r"^vision_model\.", ""))
_OTHER_TOWER = r"^(text_model|text_projection|visual_projection|logit_scale|logit_bias)"

TRANSFORMERS_CLIP = Layout("transformers_clip", rows=(
    Row("embeddings.class_embedding", ("params/cls",), expand(2)),
    *conv("embeddings.patch_embedding.", "params/embedding"),
    Row("embeddings.position_embedding.weight", (POS,), expand(1)),
    *norm("pre_layrnorm.", "params/Transformer/pre_norm"),
    Repeat(_HF_TOWER),
    *norm("post_layernorm.", "params/Transformer/encoder_norm"),
), aliases=_TOWER_ALIASES, ignored=_OTHER_TOWER,
   fixed=(("classifier", "token"),))

TRANSFORMERS_SIGLIP = Layout("transformers_siglip", rows=(
    *conv("embeddings.patch_embedding.", "params/embedding"),
    Row("embeddings.position_embedding.weight", (POS,), expand(1)),
    Repeat(_HF_TOWER),
    *norm("post_layernorm.", "params/Transformer/encoder_norm"),
    Row("head.probe", (MAP + "probe",)),
    *fused_qkv("head.attention.in_proj_weight", "head.attention.in_proj_bias",
               MAP + "MultiHeadDotProductAttention_0"),
    *out_proj("head.attention.out_proj.", MAP + "MultiHeadDotProductAttention_0"),
    *norm("head.layernorm.", MAP + "LayerNorm_0"),
    *dense("head.mlp.fc1.", MAP + "MlpBlock_0/Dense_0"),
    *dense("head.mlp.fc2.", MAP + "MlpBlock_0/Dense_1"),
), aliases=_TOWER_ALIASES, ignored=_OTHER_TOWER)

LAYOUTS = {layout.name: layout for layout in (
    TORCHVISION, TIMM, TRANSFORMERS_VIT, TRANSFORMERS_DINOV2,
    TRANSFORMERS_CLIP, TRANSFORMERS_SIGLIP)}
# transformers' model_type -> the layout of its weights.
HF_MODEL_TYPES = {"vit": "transformers", "dinov2": "transformers_dinov2",
                  "clip": "transformers_clip",
                  "clip_vision_model": "transformers_clip",
                  "siglip": "transformers_siglip",
                  "siglip_vision_model": "transformers_siglip"}


def transformers_layout(config: Optional[Mapping[str, Any]]) -> Optional[str]:
  """The layout of a transformers model from its config's ``model_type``
  (a CLIP / SigLIP config's ``vision_config``); None when there is none."""
  config = config or {}
  model_type = (config.get("vision_config") or config).get("model_type")
  return HF_MODEL_TYPES.get(model_type) if model_type else None


# (a key that only this layout has, the layout), first match wins; keys are
# read without a wrapper's prefix.
_SIGNATURES = (
    (r"^(class_token$|conv_proj\.|encoder\.layers\.encoder_layer_)",
     "torchvision"),
    (r"^embeddings\.class_embedding$", "transformers_clip"),
    (r"^embeddings\.patch_embedding\.weight$", "transformers_siglip"),
    (r"layer_scale1\.lambda1$|^encoder\.layer\.\d+\.norm1\.",
     "transformers_dinov2"),
    (r"^embeddings\.patch_embeddings\.projection\.weight$", "transformers"),
    (r"^(patch_embed\.proj\.weight$|blocks\.)", "timm"),
)


def detect(keys) -> Optional[str]:
  """The layout a state dict's keys are in (None: not a ViT we know)."""
  keys = [re.sub(r"^(module|vision_model|vit|dinov2)\.", "", k) for k in keys]
  for pattern, layout in _SIGNATURES:
    if any(re.search(pattern, k) for k in keys):
      return layout
  return None


# --------------------------------------------------------------------------- #
# What the keys cannot say.
# --------------------------------------------------------------------------- #

# The heads of a width, as timm's and torchvision's models have them (head
# width 64 up to ViT-L, then 16 heads).
HEADS_FOR_WIDTH = {192: 3, 256: 4, 320: 5, 384: 6, 512: 8, 640: 10, 768: 12,
                   832: 13, 896: 14, 1024: 16, 1152: 16, 1280: 16, 1408: 16,
                   1536: 16, 1664: 16}


def heads_for_width(width: int) -> int:
  if width not in HEADS_FOR_WIDTH:
    raise ValueError(
        f"The number of attention heads is not stored in these weights and "
        f"width {width} is not a standard ViT width "
        f"({sorted(HEADS_FOR_WIDTH)}): pass num_heads or the model's name.")
  return HEADS_FOR_WIDTH[width]


# timm names: vit_{size}_patch{P}[_...]_{res}, deit3_..., deit_...; a
# '.tag' names the weights and does not change the architecture.
TIMM_SIZES = {
    "tiny": (192, 12), "xsmall": (256, 10), "small": (384, 12),
    "medium": (512, 12), "mediumd": (512, 20), "betwixt": (640, 12),
    "base": (768, 12), "large": (1024, 24), "huge": (1280, 32),
    "giant": (1408, 40), "gigantic": (1664, 48), "so400m": (1152, 27),
    "so150m": (896, 18), "so150m2": (832, 21), "little": (320, 14),
    "wee": (256, 14), "giantopt": (1536, 40),
}
_TIMM_NAME = re.compile(
    r"^(?P<family>vit|deit3|deit)_(?P<size>[a-z0-9]+?)_patch(?P<patch>\d+)"
    r"(?P<rest>_[a-z0-9_]*)?$")

# (pattern on the name, fields) in order; later matches override earlier.
TIMM_FAMILIES = (
    (r"_clip_", dict(layer_norm_eps=1e-5)),
    (r"_quickgelu", dict(act="quick_gelu")),
    # SigLIP 2's own architectures use the tanh GELU in timm.
    (r"^vit_(base_patch32_siglip|large_patch16_siglip(_gap)?_512|"
     r"so400m_patch16_siglip|giantopt_patch16_siglip)", dict(act="gelu_tanh")),
    (r"^vit_base_patch16_gap_224$", dict(num_heads=16)),
    (r"^vit_giant_patch14_(reg\d+_)?(dinov2|tipsv2)", dict(num_heads=24)),
    (r"^vit_base_patch(16|32)_plus", dict(num_heads=14)),
)
# What a family's weights expect (timm's pretrained_cfg defaults).
TIMM_PREPROCESSING = (
    (r"_dinov2", dict(mean="imagenet", interpolation="bicubic", crop_pct=1.0)),
    (r"_clip_", dict(mean="openai_clip", interpolation="bicubic", crop_pct=1.0)),
    (r"_siglip", dict(mean="half", interpolation="bicubic", crop_pct=1.0)),
    (r"^deit3_.*_384", dict(mean="imagenet", interpolation="bicubic",
                            crop_pct=1.0)),
    (r"^deit", dict(mean="imagenet", interpolation="bicubic", crop_pct=0.875)),
)


def parse_timm_name(name: str) -> Optional[Dict[str, Any]]:
  """``vit_small_patch14_reg4_dinov2.lvd142m`` -> {family, size, width,
  depth, patch_size, image_size, registers, base}; None if it is not a timm
  ViT name."""
  base = name.split(".", 1)[0]
  if base.startswith("hf-hub:") or base.startswith("hf_hub:"):
    return None
  m = _TIMM_NAME.match(base)
  if m is None:
    return None
  rest = m.group("rest") or ""
  res = re.search(r"_(\d+)$", rest)
  reg = re.search(r"_reg(\d+)", rest)
  size = m.group("size")
  width, depth = TIMM_SIZES.get(size, (None, None))
  image_size = int(res.group(1)) if res else (
      518 if "dinov2" in rest else 224)
  return dict(family=m.group("family"), size=size, width=width, depth=depth,
              patch_size=int(m.group("patch")), image_size=image_size,
              registers=int(reg.group(1)) if reg else 0, base=base)


def timm_hints(name: str) -> Dict[str, Any]:
  """The fields timm's model ``name`` decides that the keys cannot:
  ``act``, ``layer_norm_eps``, ``num_heads`` (when not the width's)."""
  parsed = parse_timm_name(name)
  if parsed is None:
    return {}
  out: Dict[str, Any] = {"act": "gelu", "layer_norm_eps": 1e-6}
  for pattern, fields in TIMM_FAMILIES:
    if re.search(pattern, parsed["base"]):
      out.update(fields)
  return out


def timm_preprocessing_cfg(name: str) -> Dict[str, Any]:
  """A timm-style pretrained_cfg for the family of ``name`` (input size,
  interpolation, crop_pct, mean, std)."""
  from vit_jax.data import preprocessing as pp  # pylint: disable=import-outside-toplevel

  parsed = parse_timm_name(name) or {}
  cfg = dict(mean="half", interpolation="bicubic", crop_pct=0.9)
  for pattern, fields in TIMM_PREPROCESSING:
    if re.search(pattern, parsed.get("base", name)):
      cfg.update(fields)
      break
  means = {"imagenet": (pp.IMAGENET_MEAN, pp.IMAGENET_STD),
           "openai_clip": (pp.OPENAI_CLIP_MEAN, pp.OPENAI_CLIP_STD),
           "half": (pp.HALF, pp.HALF)}
  mean, std = means[cfg.pop("mean")]
  size = parsed.get("image_size") or 224
  return dict(cfg, mean=mean, std=std, input_size=(3, size, size))


_HF_ACTS = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_new": "gelu_tanh",
            "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}


# transformers' defaults per layout (their configs' defaults): act, epsilon.
_HF_DEFAULTS = {"transformers": ("gelu", 1e-12),
                "transformers_dinov2": ("gelu", 1e-6),
                "transformers_clip": ("quick_gelu", 1e-5),
                "transformers_siglip": ("gelu_pytorch_tanh", 1e-6)}


def transformers_hints(config: Mapping[str, Any], layout: str) -> Dict[str, Any]:
  """The fields a Hugging Face ``config.json`` gives (a CLIP or SigLIP
  config's ``vision_config``): activation, LayerNorm epsilon, heads."""
  config = config.get("vision_config") or config
  act, eps = _HF_DEFAULTS[layout]
  act = config.get("hidden_act", act)
  if act not in _HF_ACTS:
    raise ValueError(f"config.json hidden_act={act!r} is not supported; "
                     f"supported: {sorted(_HF_ACTS)}")
  out = dict(act=_HF_ACTS[act],
             layer_norm_eps=float(config.get("layer_norm_eps", eps)))
  if "num_attention_heads" in config:
    out["num_heads"] = int(config["num_attention_heads"])
  if config.get("pooler_act", "tanh") != "tanh":
    raise ValueError(f"config.json pooler_act={config['pooler_act']!r}: only "
                     f"the tanh pooler of ViTModel is supported")
  return out
