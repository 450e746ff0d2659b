"""timm's own model of one of our trees, built from the model's fields and
loaded with ``strict=True`` (ONNX export goes through it; a user can run
it beside ours).

The class is the one :func:`vit_jax.weights.layouts.timm_layout_of` maps
the tree to, or ``Eva`` for a RoPE model: ``VisionTransformer`` (classic
ViTs, DeiT-III, DINOv2 incl. its giant's packed SwiGLU, CLIP, SigLIP, AIMv2,
RADIO), ``VisionTransformerDistilled`` (DeiT with a distillation token) or
``Eva`` (DINOv3, EVA-02, Perception Encoder). Every option of ours that the
class has a knob for is set; one it has none for is named in the error.
MLP widths are given as ratios that timm's ``int(dim * ratio)`` turns back
into the exact widths.
"""

from __future__ import annotations

import functools

from vit_jax.weights import layouts, trees


class NoTwin(ValueError):
  """timm has no class with this combination of options."""


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
  """``'eva'``, ``'distilled'`` or ``'vit'``: the timm class of the tree."""
  flat = trees.flatten(trees.wrap(trees.unstack_layers(trees.wrap(variables))))
  if model.rope is not None or layouts.timm_layout_of(flat) == "timm_eva":
    return "eva"
  return "distilled" if model.distilled else "vit"


def timm_twin(model, variables, image_size):
  """timm's module computing ``model`` with ``variables`` on
  ``image_size`` images (NCHW), in eval mode, loaded strictly from
  :func:`vit_jax.formats.to_timm`'s state dict."""
  import torch  # pylint: disable=import-outside-toplevel
  from vit_jax.weights import build  # pylint: disable=import-outside-toplevel

  kind = timm_class(model, variables)
  if model.patch_bias == model.pre_norm:  # timm: PatchEmbed(bias=not pre_norm)
    raise NoTwin(
        f"timm's ViTs have a patch-embedding bias exactly when they have no "
        f"norm before the blocks (CLIP, PE); this model has patch_bias="
        f"{model.patch_bias}, pre_norm={model.pre_norm}.")
  net = (_eva(model, image_size) if kind == "eva" else
         _vit(model, image_size, distilled=kind == "distilled"))
  sd = {k: torch.from_numpy(v.copy())
        for k, v in build.to_state_dict(variables, "timm").items()}
  net.load_state_dict(sd, strict=True)
  return net.eval()


def _vit(model, image_size, distilled: bool):
  from timm.layers import GluMlp, Mlp, SwiGLU  # pylint: disable=import-outside-toplevel
  from timm.models.deit import VisionTransformerDistilled  # pylint: disable=import-outside-toplevel
  from timm.models.vision_transformer import VisionTransformer  # pylint: disable=import-outside-toplevel

  m = model
  if m.rope is not None or not m.key_bias and m.qkv_bias:
    raise NoTwin("timm's VisionTransformer has no RoPE nor q/v-only biases")
  if m.pool_include_prefix and m.num_prefix_tokens:
    raise NoTwin("timm's VisionTransformer pools without the prefix tokens")
  if m.final_norm is False and m.fc_norm:
    raise NoTwin("fc_norm without final_norm")
  d = m.hidden_size
  if m.gated_mlp == "packed":
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
      num_classes=m.num_classes or 0, act_layer=m.act, mlp_layer=mlp,
      norm_layer=_norm(m), embed_norm_layer=_norm(m) if m.patch_norm else None,
      pos_embed="learn" if m.abs_pos_embed else "none")
  if m.classifier == "map" and (m.map_heads or m.map_mlp_dim):
    raise NoTwin("timm's VisionTransformer's MAP head has the encoder's heads "
                 "and MLP width")
  if distilled:
    return VisionTransformerDistilled(**kw)
  return VisionTransformer(**kw)


def _act(name):
  from timm.layers import get_act_layer  # pylint: disable=import-outside-toplevel
  return get_act_layer(name)


def _eva(model, image_size):
  from timm.models.eva import Eva  # pylint: disable=import-outside-toplevel

  m = model
  if m.classifier == "map" and m.num_prefix_tokens and not m.pool_include_prefix:
    raise NoTwin("timm's Eva feeds every token to its MAP head")
  if m.gated_mlp is not None and m.act != "silu":
    raise NoTwin("timm's Eva gates its SwiGLU by SiLU")
  if m.patch_norm:
    raise NoTwin("timm's Eva has no norm after the patch embedding")
  if m.classifier == "map" and m.act != "gelu":
    raise NoTwin("timm's Eva's MAP head uses exact GELU")
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
      num_classes=m.num_classes or 0)
  if m.gated_mlp == "split" and not m.mlp_norm:
    kw["swiglu_align_to"] = 1  # the split SwiGLU without a norm (DINOv3 S+)
  if m.classifier == "map":
    kw.update(attn_pool_num_heads=m.map_heads or m.num_heads,
              attn_pool_mlp_ratio=_ratio(m.map_mlp_dim or m.mlp_dim, d))
  if m.rope is not None:
    kw.update(rope_type=m.rope, rope_rotate_half=m.rope == "dinov3",
              rope_temperature=m.rope_temperature or (
                  100.0 if m.rope == "dinov3" else 10000.0),
              rope_grid_offset=m.rope_grid_offset,
              rope_grid_indexing=m.rope_grid_indexing,
              ref_feat_shape=m.rope_ref_grid)
  if m.gated_mlp == "packed" and m.mlp_norm:
    raise NoTwin("timm's Eva has no packed SwiGLU with a norm inside")
  return Eva(**kw)
