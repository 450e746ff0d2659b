"""The PyTorch twin of a model: torchvision's or timm's module with the same
architecture, our weights loaded into it with ``strict=True``.

The ONNX export traces the twin (:mod:`vit_jax.export.onnx`), and
:func:`vit_jax.convert.to_torchvision_model` hands it to users. timm's twin
is the class the tree belongs to: ``VisionTransformer`` (classic ViTs,
DeiT-III, DINOv2 incl. its giant's packed SwiGLU, CLIP, SigLIP, AIMv2,
RADIO; the R50+ViT hybrids with a ``HybridEmbed``),
``VisionTransformerDistilled`` (DeiT with a distillation token),
``Eva`` (DINOv3, EVA-02, Perception Encoder, EVA-01's giants, timm's SBB
and Naver's RoPE ViTs incl. RoPE-Mixed, LingBot-Vision), ``Beit`` (a
relative position bias: BEiT, BEiT v2), ``VisionTransformerRelPos`` (a
relative position MLP, or a table without a class token: ``vit_relpos_*``),
``VisionTransformerSAM`` (Segment Anything's image encoder) or ``Cait``
(class attention, talking heads).
torch,
torchvision and timm are imported here only (after TensorFlow too:
:func:`vit_jax.weights.files.torch_after_tensorflow`).
"""

from __future__ import annotations

import functools
from typing import Optional

from vit_jax import models
from vit_jax.models import rope as rope_lib
from vit_jax.weights import build, files, layouts, saving, trees


class NoTwin(ValueError):
  """No PyTorch library module holds this architecture."""


def torchvision_model(variables, name, conv_stem=None, **arch_overrides):
  """torchvision's ``VisionTransformer`` matching ``variables`` (built from
  the weights; ``name`` is checked against them), loaded with
  ``strict=True``. A conv stem's strides are ``conv_stem``'s (e.g.
  ``model.conv_stem``), else inferred as on load."""
  files.torch_after_tensorflow()
  import torchvision  # pylint: disable=import-outside-toplevel
  from torchvision.models.vision_transformer import ConvStemConfig  # pylint: disable=import-outside-toplevel

  model, _ = build.from_tree(variables, name, conv_stem=conv_stem,
                             **arch_overrides)
  image_size = trees.native_image_size(
      trees.unstack_layers(dict(variables)), model)
  kwargs = dict(image_size=image_size, patch_size=model.patch_size,
                num_layers=model.num_layers, num_heads=model.num_heads,
                hidden_dim=model.hidden_size, mlp_dim=model.mlp_dim,
                num_classes=model.num_classes or 0,
                representation_size=model.representation_size)
  if model.conv_stem:
    kwargs["conv_stem_configs"] = [
        ConvStemConfig(c.out_channels, c.kernel_size, c.stride)
        for c in model.conv_stem]
  tv = torchvision.models.VisionTransformer(**kwargs)
  tv.load_state_dict(saving.to_torch(saving.to_state_dict(
      variables, "torchvision")), strict=True)
  return tv.eval()


def _norm(model):
  from timm.layers import LayerNorm, RmsNorm  # pylint: disable=import-outside-toplevel
  cls = RmsNorm if model.norm_type == "rms" else LayerNorm
  return functools.partial(cls, eps=model.layer_norm_eps)


def _ratio(width: int, dim: int) -> float:
  """A ratio whose ``int(dim * ratio)`` is exactly ``width``."""
  return (width + 0.5) / dim


def _pool(model) -> str:
  return {"token": "token", "gap": "avg", "map": "map",
          "unpooled": ""}[model.classifier]


def timm_class(model, variables) -> str:
  """``'cait'``, ``'relpos'``, ``'beit'``, ``'sam'``, ``'eva'``,
  ``'distilled'`` or ``'vit'``: the timm class of the tree."""
  if model.class_attn_layers:
    return "cait"
  flat = trees.flatten(trees.wrap(trees.unstack_layers(trees.wrap(variables))))
  if model.rel_pos_bias is not None:
    return "relpos" if layouts.is_relpos_tree(flat) else "beit"
  if (model.window_size or model.rel_pos or model.neck_chans or
      layouts.timm_layout_of(flat) == "timm_sam"):
    return "sam"
  if model.rope is not None or layouts.timm_layout_of(flat) == "timm_eva":
    return "eva"
  return "distilled" if model.distilled else "vit"


def timm_model(model, variables, image_size=None):
  """timm's model of ``model``, loaded with ``strict=True`` from
  :func:`vit_jax.weights.saving.to_state_dict`'s timm state dict: the class
  :func:`timm_class` names, every option of ours that it has a knob for
  set (registers, LayerScale, no_embed_class, pre-norm, fc_norm, MAP head,
  activation, norm and epsilon, RoPE, gated MLPs, patch norm, qk norm, the
  distillation head ...); :class:`NoTwin` naming an option it has none
  for. MLP widths are ratios that timm's ``int(dim * ratio)`` turns back
  into the exact widths. ``image_size``: default the position embedding's
  own."""
  files.torch_after_tensorflow()
  image_size = image_size or trees.native_image_size(
      trees.unstack_layers(dict(variables)), model) or 224
  kind = timm_class(model, variables)
  if model.patch_bias == model.pre_norm:  # timm: PatchEmbed(bias=not pre_norm)
    raise NoTwin(
        f"timm's ViTs have a patch-embedding bias exactly when they have no "
        f"norm before the blocks (CLIP, PE); this model has patch_bias="
        f"{model.patch_bias}, pre_norm={model.pre_norm}.")
  if kind == "cait":
    net = _cait(model, image_size)
  elif kind == "relpos":
    net = _relpos(model, image_size)
  elif kind == "beit":
    net = _beit(model, image_size)
  elif kind == "sam":
    net = _sam(model, image_size)
  elif kind == "eva":
    net = _eva(model, image_size)
  else:
    net = _vit(model, image_size, distilled=kind == "distilled")
  # Eva's names whatever else could hold the tree (a RoPE model's tree
  # may be DeiT-III's: Naver's *_rope_ape_224).
  sd = saving.to_state_dict(variables, "timm_eva" if kind == "eva"
                            else "timm")
  if model.resnet is not None and not model.resnet.std_eps_in_sqrt:
    sd = _as_timm_standardisation(sd, model.resnet.std_eps)
  net.load_state_dict(saving.to_torch(sd), strict=True)
  return net.eval()


# The weight-standardisation epsilon of a twin whose model divides by
# std + eps (Google's); see _as_timm_standardisation.
_TWIN_STD_EPS = 1e-8


def _as_timm_standardisation(sd, eps):
  """Conv kernels that timm's ``StdConv2dSame`` (``(w - mean) / sqrt(var +
  e)``, e = ``_TWIN_STD_EPS``) standardises to exactly what Google's
  ``(w - mean) / (std + eps)`` gives: ``c * (w - mean)`` per output channel
  with ``c**2 = e / (2 * std * eps + eps**2)`` (then ``c * (std + eps) =
  sqrt(c**2 * std**2 + e)``)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  out = dict(sd)
  for k, w in sd.items():
    if not (k.startswith("patch_embed.backbone.") and k.endswith(".weight")
            and np.ndim(w) == 4):
      continue
    w = np.asarray(w, np.float64)
    centred = w - w.mean(axis=(1, 2, 3), keepdims=True)
    std = np.sqrt((centred ** 2).mean(axis=(1, 2, 3), keepdims=True))
    c = np.sqrt(_TWIN_STD_EPS / (2 * std * eps + eps ** 2))
    out[k] = (c * centred).astype(np.float32)
  return out


def _hybrid_embed(model):
  """timm's ``HybridEmbed`` around the ResNet stem of ``model`` (as
  ``vision_transformer_hybrid._resnetv2`` builds it, with the model's
  GroupNorm epsilon and, for timm's own standardisation, its epsilon)."""
  from timm.layers import GroupNormAct, HybridEmbed, StdConv2dSame  # pylint: disable=import-outside-toplevel
  from timm.models.resnetv2 import ResNetV2, create_resnetv2_stem  # pylint: disable=import-outside-toplevel

  r = model.resnet
  conv = functools.partial(
      StdConv2dSame, eps=r.std_eps if r.std_eps_in_sqrt else _TWIN_STD_EPS)
  norm = functools.partial(GroupNormAct, num_groups=32, eps=r.gn_eps)
  if r.num_layers:
    backbone = ResNetV2(layers=r.num_layers, width_factor=r.width_factor,
                        num_classes=0, global_pool="",
                        in_chans=model.num_channels, preact=False,
                        stem_type="same", conv_layer=conv, norm_layer=norm)
  else:
    backbone = create_resnetv2_stem(model.num_channels, out_chs=r.width,
                                    stem_type="same", preact=False,
                                    conv_layer=conv, norm_layer=norm)
  return functools.partial(HybridEmbed, backbone=backbone)


def _vitamin_embed(model):
  """timm's ``HybridEmbed`` without a projection around ViTamin's
  ``MbConvStages`` (as ``vitamin._create_vitamin`` builds it)."""
  from timm.layers import HybridEmbed  # pylint: disable=import-outside-toplevel
  from timm.models.vitamin import MbConvStages, VitCfg  # pylint: disable=import-outside-toplevel

  c = model.mbconv
  if c.expand_ratio != 4.0:
    raise NoTwin("timm's MbConvLNBlock expands by 4.")
  cfg = VitCfg(embed_dim=(*c.widths, model.hidden_size),
               depths=(*c.depths, 1), stem_width=c.stem_width)
  return functools.partial(HybridEmbed, backbone=MbConvStages(
      cfg, in_chans=model.num_channels), proj=False)


def _vit(model, image_size, distilled: bool):
  from timm.layers import GluMlp, Mlp, SwiGLU  # pylint: disable=import-outside-toplevel
  from timm.models.deit import VisionTransformerDistilled  # pylint: disable=import-outside-toplevel
  from timm.models.vision_transformer import VisionTransformer  # pylint: disable=import-outside-toplevel

  m = model
  if m.rope is not None or not m.key_bias and m.qkv_bias:
    raise NoTwin("timm's VisionTransformer has no RoPE nor q/v-only biases.")
  if m.final_norm is False and m.fc_norm:
    raise NoTwin("timm has no fc_norm without final_norm.")
  d = m.hidden_size
  if m.mlp_input_norm:  # ViTamin's GeGluMlp: its norm 1e-6, as ours here
    from timm.models.vitamin import GeGluMlp  # pylint: disable=import-outside-toplevel
    if (m.gated_mlp != "split" or m.layer_norm_eps != 1e-6 or
        m.norm_type != "layer" or not m.proj_bias):
      raise NoTwin("timm's GeGluMlp (the norm of the MLP's input) is a "
                   "split gated MLP with biases and a LayerNorm of "
                   "epsilon 1e-6.")
    mlp, ratio = GeGluMlp, _ratio(m.mlp_dim, d)
  elif m.gated_mlp == "packed":
    mlp = functools.partial(GluMlp, act_layer=_act(m.act), gate_last=False)
    ratio = _ratio(2 * m.mlp_dim, d)
  elif m.gated_mlp == "split":
    mlp, ratio = SwiGLU, _ratio(m.mlp_dim, d)
  else:
    mlp, ratio = Mlp, _ratio(m.mlp_dim, d)
  kw = dict(
      img_size=image_size, patch_size=m.patch_size, embed_dim=d,
      depth=m.num_layers, num_heads=m.num_heads, mlp_ratio=ratio,
      qkv_bias=m.qkv_bias, qk_norm=m.qk_norm, scale_attn_norm=m.attn_norm,
      scale_mlp_norm=m.mlp_norm, proj_bias=m.proj_bias,
      class_token=m.has_class_token, reg_tokens=m.num_registers,
      no_embed_class=m.no_embed_class or m.no_embed_registers,
      init_values=m.layer_scale_init, pre_norm=m.pre_norm, fc_norm=m.fc_norm,
      final_norm=m.final_norm, global_pool=_pool(m),
      pool_include_prefix=m.pool_include_prefix,  # (timm's test_vit3)
      num_classes=m.num_classes or 0, act_layer=m.act, mlp_layer=mlp,
      norm_layer=_norm(m), embed_norm_layer=_norm(m) if m.patch_norm else None,
      pos_embed="learn" if m.abs_pos_embed else "none")
  if m.classifier == "map" and (m.map_heads or m.map_mlp_dim):
    raise NoTwin("timm's VisionTransformer's MAP head has the encoder's heads "
                 "and MLP width.")
  if m.post_norm:  # timm's ResPostBlock: no LayerScale (init_values
    if m.layer_scale_init is not None:  # initialises its norms instead)
      raise NoTwin("timm's post-norm block (ResPostBlock) has no LayerScale.")
    from timm.models.vision_transformer import ResPostBlock  # pylint: disable=import-outside-toplevel
    kw.update(block_fn=ResPostBlock, init_values=None)
  if m.diff_attn is not None or m.parallel is not None:
    kw.update(_diff_parallel(m))
  if m.resnet is not None:  # the R50+ViT hybrids
    kw.update(embed_layer=_hybrid_embed(m),
              patch_size=m.patch_size // m.resnet.stride)
  if m.mbconv is not None:  # ViTamin
    kw.update(embed_layer=_vitamin_embed(m), patch_size=1)
  if distilled:
    return VisionTransformerDistilled(**kw)
  return VisionTransformer(**kw)


def _diff_parallel(m) -> dict:
  """timm's VisionTransformer arguments of differential attention
  (``attn_layer='diff'``; timm's ``dual_lambda`` through a subclass) and
  parallel blocks (``ParallelScalingBlock``, ``fuse_out_proj``,
  ``DiffParallelScalingBlock``)."""
  from timm.layers import DiffAttention  # pylint: disable=import-outside-toplevel
  from timm.models import vision_transformer as vt  # pylint: disable=import-outside-toplevel

  dual = m.diff_attn == "dual"
  if m.parallel is None:
    if not dual:
      return dict(attn_layer="diff")

    class DualLambdaDiffAttention(DiffAttention):
      def __init__(self, *args, **kwargs):
        super().__init__(*args, dual_lambda=True, **kwargs)
    return dict(attn_layer=DualLambdaDiffAttention)
  _refuse("ParallelScalingBlock", [k for k, on in (
      ("gated MLP", m.gated_mlp), ("norm inside the MLP", m.mlp_norm),
      ("norm inside the attention", m.attn_norm),
      ("differential attention with two output projections (its "
       "DiffParallelScalingBlock has one)",
       m.diff_attn is not None and m.parallel == "split")) if on])
  if m.diff_attn is not None:
    return dict(block_fn=functools.partial(vt.DiffParallelScalingBlock,
                                           dual_lambda=dual))
  return dict(block_fn=functools.partial(
      vt.ParallelScalingBlock, fuse_out_proj=m.parallel == "fused"))


def _act(name):
  from timm.layers import get_act_layer  # pylint: disable=import-outside-toplevel
  return get_act_layer(name)


def _eva(model, image_size):
  from timm.models.eva import Eva  # pylint: disable=import-outside-toplevel

  m = model
  if m.classifier == "map" and m.num_prefix_tokens and not m.pool_include_prefix:
    raise NoTwin("timm's Eva feeds every token to its MAP head.")
  if m.gated_mlp is not None and m.act != "silu":
    raise NoTwin("timm's Eva gates its SwiGLU by SiLU.")
  if m.patch_norm:
    raise NoTwin("timm's Eva has no norm after the patch embedding.")
  if m.classifier == "map" and m.act != "gelu":
    raise NoTwin("timm's Eva's MAP head uses exact GELU.")
  full_bias = m.qkv_bias and m.key_bias
  d = m.hidden_size
  kw = dict(
      img_size=image_size, patch_size=m.patch_size, embed_dim=d,
      depth=m.num_layers, num_heads=m.num_heads, qkv_bias=m.qkv_bias,
      qkv_fused=not m.mlp_norm, qk_norm=m.qk_norm,
      mlp_ratio=_ratio(m.mlp_dim, d), swiglu_mlp=m.gated_mlp is not None,
      scale_mlp=m.mlp_norm, scale_attn_inner=m.attn_norm,
      attn_type="rope" if full_bias else "eva",
      norm_layer=_norm(m), init_values=m.layer_scale_init,
      class_token=m.has_class_token, num_reg_tokens=m.num_registers,
      no_embed_class=m.no_embed_class, use_abs_pos_emb=m.abs_pos_embed,
      use_rot_pos_emb=m.rope is not None,
      use_pre_transformer_norm=m.pre_norm,
      use_post_transformer_norm=m.final_norm and not m.fc_norm,
      use_fc_norm=m.fc_norm, global_pool=_pool(m),
      use_post_norm=m.post_norm, num_classes=m.num_classes or 0)
  if m.gated_mlp == "split" and not m.mlp_norm:
    kw["swiglu_align_to"] = 1  # the split SwiGLU without a norm (DINOv3 S+)
  if m.classifier == "map":
    kw.update(attn_pool_num_heads=m.map_heads or m.num_heads,
              attn_pool_mlp_ratio=_ratio(m.map_mlp_dim or m.mlp_dim, d))
  if m.rope is not None:
    kw.update(rope_type=m.rope, rope_rotate_half=m.rope == "dinov3",
              rope_temperature=m.rope_temperature or (
                  rope_lib.DEFAULT_TEMPERATURE[m.rope]),
              rope_grid_offset=m.rope_grid_offset,
              rope_grid_indexing=m.rope_grid_indexing,
              ref_feat_shape=m.rope_ref_grid)
  if m.gated_mlp == "packed" and m.mlp_norm:
    raise NoTwin("timm's Eva has no packed SwiGLU with a norm inside.")
  return Eva(**kw)


def _beit(model, image_size):
  from timm.models.beit import Beit  # pylint: disable=import-outside-toplevel

  m = model
  lacks = [what for what, has in (
      ("a key bias (it has q and v biases only)", m.qkv_bias and m.key_bias),
      ("RoPE", m.rope is not None), ("registers", m.num_registers),
      ("a distillation token", m.distilled), ("a norm before the blocks",
                                               m.pre_norm),
      ("a norm after the patch embedding", m.patch_norm),
      ("q/k norms", m.qk_norm), ("a norm inside the attention", m.attn_norm),
      ("post-norm blocks", m.post_norm), ("a MAP head", m.classifier == "map"),
      ("a model without biases on the projections", not m.proj_bias),
      ("RMSNorm", m.norm_type != "layer"),
      ("a packed gated MLP", m.gated_mlp == "packed"),
      ("another activation than exact GELU (SiLU for its SwiGLU)",
       m.act != ("silu" if m.gated_mlp else "gelu")),
      ("no final norm nor fc_norm", not m.final_norm and not m.fc_norm))
      if has]
  if lacks:
    raise NoTwin(f"timm's Beit has no {'; no '.join(lacks)}.")
  d = m.hidden_size
  return Beit(
      img_size=image_size, patch_size=m.patch_size, embed_dim=d,
      depth=m.num_layers, num_heads=m.num_heads, qkv_bias=m.qkv_bias,
      mlp_ratio=_ratio(m.mlp_dim, d), swiglu_mlp=m.gated_mlp == "split",
      scale_mlp=m.mlp_norm, norm_layer=_norm(m),
      init_values=m.layer_scale_init, use_abs_pos_emb=m.abs_pos_embed,
      use_rel_pos_bias=m.rel_pos_bias == "block",
      use_shared_rel_pos_bias=m.rel_pos_bias == "shared",
      global_pool=_pool(m), use_fc_norm=m.fc_norm,
      num_classes=m.num_classes or 0)


def _sam(model, image_size):
  from timm.models.vision_transformer_sam import VisionTransformerSAM  # pylint: disable=import-outside-toplevel

  m = model
  lacks = [what for what, on in (
      ("a neck (without one timm norms the map by a LayerNorm2d)",
       not m.neck_chans),
      ("a final norm", m.final_norm), ("fc_norm", m.fc_norm),
      (f"classifier={m.classifier!r} (it averages the map)",
       m.classifier != "gap"),
      ("a gated MLP", m.gated_mlp), ("RMSNorm", m.norm_type != "layer"),
      ("a norm after the patch embedding", m.patch_norm),
      ("norms inside the attention or MLP", m.attn_norm or m.mlp_norm),
      ("post-norm blocks", m.post_norm),
      ("q/v-only or no projection biases",
       not m.key_bias or not m.proj_bias),
      ("a representation layer", m.representation_size)) if on]
  _refuse("VisionTransformerSAM", lacks)
  return VisionTransformerSAM(
      **_sizes(m, image_size), qk_norm=m.qk_norm, pre_norm=m.pre_norm,
      use_abs_pos=m.abs_pos_embed, use_rel_pos=m.rel_pos,
      window_size=m.window_size,
      global_attn_indexes=tuple(m.global_attn_indexes),
      neck_chans=m.neck_chans, global_pool="avg")


def _cait(model, image_size):
  from timm.models.cait import Cait  # pylint: disable=import-outside-toplevel

  m = model
  lacks = [what for what, on in (
      ("attention without talking heads", not m.talking_heads),
      ("a model without LayerScale", m.layer_scale_init is None),
      ("RoPE", m.rope is not None), ("registers", m.num_registers),
      ("a distillation token", m.distilled),
      ("a norm before the blocks", m.pre_norm),
      ("a norm after the patch embedding", m.patch_norm),
      ("q/k norms or norms inside the attention or MLP",
       m.qk_norm or m.attn_norm or m.mlp_norm),
      ("post-norm blocks", m.post_norm), ("a gated MLP", m.gated_mlp),
      (f"classifier={m.classifier!r}", m.classifier == "map"),
      ("q/v-only or no projection biases", not m.key_bias or not m.proj_bias),
      ("RMSNorm", m.norm_type != "layer"), ("fc_norm", m.fc_norm),
      ("a model without its final norm", not m.final_norm),
      ("a representation layer", m.representation_size)) if on]
  _refuse("Cait", lacks)
  return Cait(**_sizes(m, image_size), global_pool=_pool(m),
              depth_token_only=m.class_attn_layers,
              mlp_ratio_token_only=_ratio(m.mlp_dim, m.hidden_size))


def _relpos(model, image_size):
  from timm.models import vision_transformer_relpos as relpos  # pylint: disable=import-outside-toplevel

  m = model
  lacks = [what for what, on in (
      ("RoPE", m.rope is not None), ("registers", m.num_registers),
      ("a distillation token", m.distilled),
      ("a norm before the blocks", m.pre_norm),
      ("a norm after the patch embedding", m.patch_norm),
      ("norms inside the attention or MLP", m.attn_norm or m.mlp_norm),
      ("LayerScale in post-norm blocks (ResPostRelPosBlock)",
       m.post_norm and m.layer_scale_init is not None),
      ("a gated MLP", m.gated_mlp), ("a MAP head", m.classifier == "map"),
      ("q/v-only or no projection biases", not m.key_bias or not m.proj_bias),
      ("RMSNorm", m.norm_type != "layer"),
      ("a learned position embedding", m.abs_pos_embed),
      ("a model without a final norm nor fc_norm",
       not m.final_norm and not m.fc_norm),
      ("a representation layer", m.representation_size)) if on]
  _refuse("VisionTransformerRelPos", lacks)
  kind = ("bias" if m.rel_pos_mlp is None else
          "mlp_swin" if m.rel_pos_mlp == "swin" else "mlp")
  return relpos.VisionTransformerRelPos(
      **_sizes(m, image_size), qk_norm=m.qk_norm,
      class_token=m.has_class_token, fc_norm=m.fc_norm,
      global_pool=_pool(m), rel_pos_type=kind,
      rel_pos_dim=m.rel_pos_mlp_dim, shared_rel_pos=m.rel_pos_bias == "shared",
      block_fn=(relpos.ResPostRelPosBlock if m.post_norm
                else relpos.RelPosBlock))


def _refuse(cls: str, lacks) -> None:
  if lacks:
    raise NoTwin(f"timm's {cls} has no {'; no '.join(lacks)}.")


def _sizes(m, image_size) -> dict:
  """The constructor arguments timm's SAM, Cait and
  VisionTransformerRelPos share: sizes, heads, MLP ratio, q/k/v biases,
  norm, activation, LayerScale."""
  d = m.hidden_size
  return dict(
      img_size=image_size, patch_size=m.patch_size, in_chans=m.num_channels,
      num_classes=m.num_classes or 0, embed_dim=d, depth=m.num_layers,
      num_heads=m.num_heads, mlp_ratio=_ratio(m.mlp_dim, d),
      qkv_bias=m.qkv_bias, norm_layer=_norm(m), act_layer=_act(m.act),
      init_values=m.layer_scale_init)


def torch_model(model, variables, image_size: Optional[int] = None):
  """The twin that holds ``model``: torchvision's for a conv stem or a
  representation layer (timm has neither), else timm's (a ResNet stem:
  its hybrid)."""
  if model.resnet is not None and model.representation_size:
    raise NoTwin("timm's hybrid ViT has no representation layer "
                 "(pre_logits), and torchvision has no hybrid.")
  if model.conv_stem or model.representation_size:
    if model.classifier != "token":
      raise NoTwin(
          f"neither torchvision's nor timm's ViT holds a "
          f"classifier={model.classifier!r} model with a conv stem or a "
          f"representation layer.")
    # The sizes are the weights'; the heads are the model's (no name).
    return torchvision_model(variables, None, conv_stem=model.conv_stem,
                             num_heads=model.num_heads)
  return timm_model(model, variables, image_size)
