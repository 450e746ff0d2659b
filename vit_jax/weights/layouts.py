"""The PyTorch-side layouts of our tree: one table each.

Each table lists, in the library's own ``state_dict()`` order, their key
pattern, our path(s) and how the tensor maps (:mod:`vit_jax.weights.mapping`
derives both directions and the expected keys from it). Adding a layout is
adding a table here; what the keys cannot say (the activation of a timm
model, the number of heads in a fused q/k/v) comes from the model name or
the checkpoint's config, decoded at the end of this file.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, Mapping, Optional

import numpy as np

from vit_jax.models import resnet as resnet_lib
from vit_jax.weights.mapping import (
    DENSE, FUSED_OUT, GRID_ROWS, GRID_TOKENS, HEADS, HEADS_BIAS, IN_PROJ,
    IN_PROJ_BIAS, LINEAR_PATCH, RAW, Layout, Repeat, Row, const, conv, dense,
    expand, fused_qkv, norm, out_proj, part, split_qkv, zeros)

E = "params/Transformer/encoderblock_{i}/"  # our block
ATTN = E + "MultiHeadDotProductAttention_0"
POS = "params/Transformer/posembed_input/pos_embedding"
POS_GRID = "params/Transformer/posembed_input/pos_grid"  # NaFlex
POS_Y = "params/Transformer/posembed_input/pos_y"  # ... factorized
POS_X = "params/Transformer/posembed_input/pos_x"
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
GATE = E + "MlpBlock_0/Gate_0"
MLP_NORM = E + "MlpBlock_0/LayerNorm_0"


def _any(fragment):
  """``Row.when``: some path of our tree contains ``fragment``."""
  return lambda flat: any(fragment in k for k in flat)


def _none(fragment):
  return lambda flat: not any(fragment in k for k in flat)


def _map_heads(rows):
  """The MAP head's multi-head rows split by its own head count."""
  return tuple(dataclasses.replace(r, heads="map") for r in rows)


_SPLIT_MLP = "MlpBlock_0/Gate_0"


def _shape(v):
  return tuple(v) if isinstance(v, tuple) else tuple(np.shape(v))


def mlp_kind(flat) -> Optional[str]:
  """A tree's block MLP: None (Dense -> act -> Dense), ``'packed'`` (one
  Dense_0 twice as wide as Dense_1 takes) or ``'split'`` (a Gate_0)."""
  d0 = d1 = None
  for k, v in flat.items():
    if "encoderblock" not in k:
      continue
    if _SPLIT_MLP in k:
      return "split"
    if k.endswith("MlpBlock_0/Dense_0/kernel"):
      d0 = _shape(v)
    elif k.endswith("MlpBlock_0/Dense_1/kernel"):
      d1 = _shape(v)
  if d0 and d1 and d0[-1] == 2 * d1[-2]:
    return "packed"
  return None


def _mlp_is(kind):
  return lambda flat: mlp_kind(flat) == kind


def _timm_mlp(prefix: str):
  """timm's MLPs: ``fc1``/``fc2`` (GELU, or a packed GLU whose ``fc1`` is
  the gate then the value half), or the split SwiGLU ``fc1_g``/``fc1_x``;
  an optional ``norm`` over the hidden layer."""
  return (*dense(prefix + "fc1_g.", GATE),
          *dense(prefix + "fc1.", E + "MlpBlock_0/Dense_0"),
          *dense(prefix + "fc1_x.", E + "MlpBlock_0/Dense_0"),
          *norm(prefix + "norm.", MLP_NORM),
          *dense(prefix + "fc2.", E + "MlpBlock_0/Dense_1"))


def _fix_mlp_rows(rows):
  """``fc1`` is written for a GLU-free or packed MLP, ``fc1_x`` for a
  split one (the two name our ``Dense_0``)."""
  out = []
  for r in rows:
    if ".mlp.fc1." in r.theirs:
      r = dataclasses.replace(r, when=_none(_SPLIT_MLP))
    elif ".mlp.fc1_x." in r.theirs:
      r = dataclasses.replace(r, when=_any(_SPLIT_MLP))
    out.append(r)
  return tuple(out)


_TIMM_POOL = (
    Row("attn_pool.latent", (MAP + "probe",)),
    *_map_heads((
        Row("attn_pool.q.weight",
            (MAP + "MultiHeadDotProductAttention_0/query/kernel",), HEADS),
        Row("attn_pool.q.bias",
            (MAP + "MultiHeadDotProductAttention_0/query/bias",), HEADS_BIAS),
        *fused_qkv("attn_pool.kv.weight", "attn_pool.kv.bias",
                   MAP + "MultiHeadDotProductAttention_0",
                   names=("key", "value")),
        *out_proj("attn_pool.proj.", MAP + "MultiHeadDotProductAttention_0"))),
    *norm("attn_pool.norm.", MAP + "LayerNorm_0"),
    *dense("attn_pool.mlp.fc1.", MAP + "MlpBlock_0/Dense_0"),
    *dense("attn_pool.mlp.fc2.", MAP + "MlpBlock_0/Dense_1"),
)

# The hybrids' ResNet stem (timm's HybridEmbed around a ResNetV2 with
# preact=False, or its stem alone) <-> Google's names at the top of our tree
# (vit_jax.models.resnet). Google counts stages and units from 1.
_BB = "patch_embed.backbone."
_BB_UNIT = _BB + "stages.{s}.blocks.{u}."
_UNIT = "params/block{s+1}/unit{u+1}/"
_HAS_STAGES = _any("params/block1/")


def _when(rows, when):
  return tuple(dataclasses.replace(r, when=when) for r in rows)


_TIMM_RESNET = (
    # The root alone (vit_tiny_r_s16_p8) is the backbone itself.
    *_when((*conv(_BB + "conv.", "params/conv_root")[:1],
            *norm(_BB + "norm.", "params/gn_root")), _none("params/block1/")),
    *_when((*conv(_BB + "stem.conv.", "params/conv_root")[:1],
            *norm(_BB + "stem.norm.", "params/gn_root")), _HAS_STAGES),
    Repeat((
        *conv(_BB_UNIT + "downsample.conv.", _UNIT + "conv_proj")[:1],
        *norm(_BB_UNIT + "downsample.norm.", _UNIT + "gn_proj"),
        *(r for k in (1, 2, 3) for r in (
            *conv(f"{_BB_UNIT}conv{k}.", f"{_UNIT}conv{k}")[:1],
            *norm(f"{_BB_UNIT}norm{k}.", f"{_UNIT}gn{k}"))),
    )),
)


def _block_has(path):
  """``Row.when``: the encoder's blocks (all alike: the first's) have
  ``path`` (one lookup: it is asked for every row of every block)."""
  key = "params/Transformer/encoderblock_0/" + path
  return lambda flat: key in flat


def _both(rows, when):
  """``rows`` written only where ``when`` holds too."""
  def both(first):
    return when if first is None else lambda f: first(f) and when(f)
  return tuple(dataclasses.replace(r, when=both(r.when)) for r in rows)


_SERIAL = _block_has("LayerNorm_1/scale")  # a parallel block has one norm
_PARALLEL = lambda flat: not _SERIAL(flat)  # noqa: E731
_MLP_OUT_BIAS = _block_has("MlpBlock_0/Dense_1/bias")  # none: fused
_LAMBDAS = ("lambda_a", "lambda_b", "lambda_q1", "lambda_k1", "lambda_q2",
            "lambda_k2")


def _diff_rows(theirs: str):
  """Differential attention's lambdas (timm's ``DiffAttention``, or
  ``DiffParallelScalingBlock``'s own) under ``theirs``."""
  return tuple(Row(theirs + n, (f"{ATTN}/{n}",)) for n in _LAMBDAS)


def _timm_block(attention=()):
  """A timm ``Block``'s rows (VisionTransformer's; ``RelPosBlock``'s):
  ``attention``, the attention's own extra rows, come before its ``proj``
  (timm's relative position MLP or table); differential attention's
  lambdas before its ``qkv``, its ``sub_norm`` after ``proj``. Then
  ``ParallelScalingBlock``'s / ``DiffParallelScalingBlock``'s (a tree whose
  blocks have one norm): the fused ``in_proj`` (the MLP's first layer and
  q, k, v; ``mlp_bias`` where there is no q/k/v bias), ``attn_out_proj`` /
  ``mlp_out_proj`` or one ``out_proj`` of both (an MLP without an output
  bias), one LayerScale ``ls``."""
  mlp0 = E + "MlpBlock_0/Dense_0"
  serial = (
      *norm(_TM + "norm1.", E + "LayerNorm_0"),
      *_diff_rows(_TM + "attn."),
      *fused_qkv(_TM + "attn.qkv.weight", _TM + "attn.qkv.bias", ATTN),
      *norm(_TM + "attn.q_norm.", ATTN + "/query_ln"),
      *norm(_TM + "attn.k_norm.", ATTN + "/key_ln"),
      *norm(_TM + "attn.norm.", ATTN + "/inner_norm"),
      *attention,
      *out_proj(_TM + "attn.proj.", ATTN),
      Row(_TM + "attn.sub_norm.weight", (ATTN + "/sub_norm/scale",)),
      Row(_TM + "ls1.gamma", (E + "LayerScale_0/scale",)),
      *norm(_TM + "norm2.", E + "LayerNorm_1"),
      *_fix_mlp_rows(_timm_mlp(_TM + "mlp.")),
      Row(_TM + "ls2.gamma", (E + "LayerScale_1/scale",)),
  )
  parallel = (
      Row(_TM + "mlp_bias", (mlp0 + "/bias",),
          when=lambda f: not _block_has(
              "MultiHeadDotProductAttention_0/query/bias")(f)),
      *_diff_rows(_TM),
      *norm(_TM + "in_norm.", E + "LayerNorm_0"),
      Row(_TM + "in_proj.weight", (mlp0 + "/kernel",) + tuple(
          f"{ATTN}/{q}/kernel" for q in ("query", "key", "value")), IN_PROJ),
      Row(_TM + "in_proj.bias", (mlp0 + "/bias",) + tuple(
          f"{ATTN}/{q}/bias" for q in ("query", "key", "value")),
          IN_PROJ_BIAS, heads="heads_width"),
      *norm(_TM + "q_norm.", ATTN + "/query_ln"),
      *norm(_TM + "k_norm.", ATTN + "/key_ln"),
      Row(_TM + "sub_norm.weight", (ATTN + "/sub_norm/scale",)),
      *_both((*out_proj(_TM + "attn_out_proj.", ATTN),
              *dense(_TM + "mlp_out_proj.", E + "MlpBlock_0/Dense_1")),
             _MLP_OUT_BIAS),
      *_both((Row(_TM + "out_proj.weight", (
          ATTN + "/out/kernel", E + "MlpBlock_0/Dense_1/kernel"), FUSED_OUT),
              Row(_TM + "out_proj.bias", (ATTN + "/out/bias",))),
             lambda f: not _MLP_OUT_BIAS(f)),
      Row(_TM + "ls.gamma", (E + "LayerScale_0/scale",)),
  )
  return _both(serial, _SERIAL) + _both(parallel, _PARALLEL)


# timm's VisionTransformer (and VisionTransformerDistilled): classic ViTs,
# DeiT-III, DINOv2 (giant: a packed SwiGLU), CLIP, SigLIP, AIMv2 (RMSNorm,
# split SwiGLU, no biases), RADIO, distilled DeiT, the R50+ViT hybrids
# (whose stem computes with timm's constants: resnet_lib.TIMM).
TIMM = Layout("timm", rows=(
    Row("cls_token", ("params/cls",)),
    Row("reg_token", ("params/registers",)),
    Row("pos_embed", (POS,)),
    Row("dist_token", ("params/dist",)),
    *_TIMM_RESNET,
    *conv("patch_embed.proj.", "params/embedding"),
    *norm("patch_embed.norm.", "params/embedding_norm"),
    *norm("norm_pre.", "params/Transformer/pre_norm"),
    Repeat(_timm_block()),
    *norm("norm.", "params/Transformer/encoder_norm"),
    *norm("fc_norm.", "params/fc_norm"),
    *_TIMM_POOL,
    *dense("head.", "params/head"),
    *dense("head_dist.", "params/head_dist"),
), aliases=((r"^module\.", ""),), resample="timm",
   fixed=tuple((f"resnet.{k}", v) for k, v in resnet_lib.TIMM.items()),
   unsupported=(
    ("patch_embed.backbone.", "a CNN backbone other than BiT's ResNetV2 stem "
     "(timm's vit_*_resnet*d_* and vit_base_mci_*; the R50+ViT hybrids "
     "vit_*_r50_* / _r26_* / vit_tiny_r_* and ViTamin's vitamin_* load)"),
    ("attn_pool.pos_embed", "a position embedding in the attention pool"),
    (".attn.gate.", "gated attention"),
))

# timm's ViTamin (vitamin_*): VisionTransformer with a HybridEmbed without a
# projection around MbConvStages (our mbconv_stem: timm's Stem, two stages
# of MbConvLNBlock, the StridedConv 'pool' to the width) and GeGluMlp (a
# LayerNorm of the MLP's input, then GELU(w0) * w1 and w2: our split gated
# MLP with mlp_input_norm). timm's own names both ways; its 'mlp.norm' is
# the input's norm here (the hidden layer's in VisionTransformer's other
# MLPs): a layout of its own.
_VB = "patch_embed.backbone."
_VB_BLOCK = _VB + "stages.{s}.{u}."
MBCONV = "params/mbconv_stem/"
_MB_BLOCK = MBCONV + "stage{s}_block{u}/"

_TIMM_MBCONV = (
    *conv(_VB + "stem.conv1.", MBCONV + "stem_conv1"),
    *norm(_VB + "stem.norm1.", MBCONV + "stem_norm1"),
    *conv(_VB + "stem.conv2.", MBCONV + "stem_conv2"),
    Repeat((
        *conv(_VB_BLOCK + "shortcut.expand.", _MB_BLOCK + "shortcut"),
        *norm(_VB_BLOCK + "pre_norm.", _MB_BLOCK + "pre_norm"),
        *conv(_VB_BLOCK + "conv1_1x1.", _MB_BLOCK + "conv1"),
        *conv(_VB_BLOCK + "conv2_kxk.", _MB_BLOCK + "conv2"),
        *conv(_VB_BLOCK + "conv3_1x1.", _MB_BLOCK + "conv3"),
    )),
    *conv(_VB + "pool.proj.", MBCONV + "pool_proj"),
    *norm(_VB + "pool.norm.", MBCONV + "pool_norm"),
)

TIMM_VITAMIN = Layout("timm_vitamin", rows=(
    Row("cls_token", ("params/cls",)),
    Row("reg_token", ("params/registers",)),
    Row("pos_embed", (POS,)),
    *_TIMM_MBCONV,
    *norm("norm_pre.", "params/Transformer/pre_norm"),
    Repeat((
        *norm(_TM + "norm1.", E + "LayerNorm_0"),
        *fused_qkv(_TM + "attn.qkv.weight", _TM + "attn.qkv.bias", ATTN),
        *norm(_TM + "attn.q_norm.", ATTN + "/query_ln"),
        *norm(_TM + "attn.k_norm.", ATTN + "/key_ln"),
        *norm(_TM + "attn.norm.", ATTN + "/inner_norm"),
        *out_proj(_TM + "attn.proj.", ATTN),
        Row(_TM + "ls1.gamma", (E + "LayerScale_0/scale",)),
        *norm(_TM + "norm2.", E + "LayerNorm_1"),
        *norm(_TM + "mlp.norm.", E + "MlpBlock_0/InputNorm"),
        *dense(_TM + "mlp.w0.", GATE),
        *dense(_TM + "mlp.w1.", E + "MlpBlock_0/Dense_0"),
        *dense(_TM + "mlp.w2.", E + "MlpBlock_0/Dense_1"),
        Row(_TM + "ls2.gamma", (E + "LayerScale_1/scale",)),
    )),
    *norm("norm.", "params/Transformer/encoder_norm"),
    *norm("fc_norm.", "params/fc_norm"),
    *_TIMM_POOL,
    *dense("head.", "params/head"),
), aliases=((r"^module\.", ""),), resample="timm")


def is_vitamin_tree(flat) -> bool:
  """Whether a tree of ours is timm's ViTamin's (its stem, or GeGluMlp's
  norm of the MLP's input)."""
  return any(k.startswith(MBCONV) or "/MlpBlock_0/InputNorm/" in k
             for k in flat)


# timm's NaFlexVit (SigLIP 2 NaFlex, C-RADIO's naflexvit_*, timm's own
# NaFlex ViTs): VisionTransformer's blocks and heads; the embedding module
# ``embeds`` holds the tokens, a Linear over pre-cut (y, x, channel)
# patches (our conv kernel, flattened) and the position grid (1, H, W, D),
# or its factorized rows (1, H, D) and columns (1, W, D).
_TIMM_EMBEDDING_KEYS = ("cls_token", "reg_token", "pos_embed", "dist_token",
                        "patch_embed.")
TIMM_NAFLEX = Layout("timm_naflex", rows=(
    Row("embeds.cls_token", ("params/cls",)),
    Row("embeds.reg_token", ("params/registers",)),
    Row("embeds.pos_embed", (POS_GRID,)),
    Row("embeds.pos_embed_y", (POS_Y,)),  # pos_embed='factorized'
    Row("embeds.pos_embed_x", (POS_X,)),
    *dense("embeds.proj.", "params/embedding", op=LINEAR_PATCH),
    *norm("embeds.norm.", "params/embedding_norm"),
    *(r for r in TIMM.rows
      if not (r.rows[0] if isinstance(r, Repeat) else r).theirs.startswith(
          _TIMM_EMBEDDING_KEYS)),
), aliases=((r"^module\.", ""),), unsupported=(
    *TIMM.unsupported,
    ("embeds.norm_input", "a norm of the input patches"),
))

# timm's Eva: DINOv3, EVA-02, Perception Encoder, EVA-01 (eva_giant_*: no
# RoPE), timm's SBB RoPE ViTs, Naver's RoPE-ViT (RoPE-Mixed's learned
# frequencies: rope.freqs, ours at the encoder, the same (2, depth, heads,
# head_dim / 2) array), LingBot-Vision. LayerScale is gamma_1 / gamma_2;
# the query and value biases are q_bias / v_bias beside a fused qkv weight
# (the key has none), or the projections are separate (q_proj, k_proj,
# v_proj: EVA-02 B/L and EVA-02 CLIP, the Eva models with a norm inside the
# MLP, which is how a tree tells them apart).
_EVA_SPLIT = _any("MlpBlock_0/LayerNorm_0")
_EVA_FUSED = _none("MlpBlock_0/LayerNorm_0")
_QV_ONLY = _none("MultiHeadDotProductAttention_0/key/bias")

TIMM_EVA = Layout("timm_eva", rows=(
    Row("cls_token", ("params/cls",)),
    Row("reg_token", ("params/registers",)),
    Row("pos_embed", (POS,)),
    *conv("patch_embed.proj.", "params/embedding"),
    Row("rope.freqs", ("params/Transformer/rope_freqs",)),
    *norm("norm_pre.", "params/Transformer/pre_norm"),
    Repeat((
        Row(_TM + "gamma_1", (E + "LayerScale_0/scale",)),
        Row(_TM + "gamma_2", (E + "LayerScale_1/scale",)),
        *norm(_TM + "norm1.", E + "LayerNorm_0"),
        *(dataclasses.replace(r, when=lambda f: _EVA_FUSED(f) and _QV_ONLY(f))
          for r in (Row(_TM + "attn.q_bias", (ATTN + "/query/bias",),
                        HEADS_BIAS),
                    Row(_TM + "attn.v_bias", (ATTN + "/value/bias",),
                        HEADS_BIAS))),
        *(dataclasses.replace(r, when=_EVA_FUSED) for r in fused_qkv(
            _TM + "attn.qkv.weight", _TM + "attn.qkv.bias", ATTN)),
        *(dataclasses.replace(r, when=_EVA_SPLIT) for r in split_qkv(
            _TM + "attn.", ATTN, names=("q_proj", "k_proj", "v_proj"))),
        *norm(_TM + "attn.q_norm.", ATTN + "/query_ln"),
        *norm(_TM + "attn.k_norm.", ATTN + "/key_ln"),
        *norm(_TM + "attn.norm.", ATTN + "/inner_norm"),
        *out_proj(_TM + "attn.proj.", ATTN),
        *norm(_TM + "norm2.", E + "LayerNorm_1"),
        *_fix_mlp_rows(_timm_mlp(_TM + "mlp.")),
    )),
    *norm("norm.", "params/Transformer/encoder_norm"),
    *_TIMM_POOL,
    *norm("fc_norm.", "params/fc_norm"),
    *dense("head.", "params/head"),
), aliases=((r"^module\.", ""),), resample="timm", unsupported=(
    (".attn.gate.", "gated attention"),
))


# timm's Beit (BEiT, BEiT v2): Eva's block names (LayerScale gamma_1 /
# gamma_2, q_bias / v_bias beside a fused qkv weight, no key bias) and
# relative position tables, one per block's attention or one shared
# (rel_pos_bias.*; our rel_pos_bias 'block' / 'shared'); the learned
# position embedding optional (use_abs_pos_emb).
REL_TABLE = "/rel_pos_bias/table"
TIMM_BEIT = Layout("timm_beit", rows=(
    Row("cls_token", ("params/cls",)),
    Row("pos_embed", (POS,)),
    *conv("patch_embed.proj.", "params/embedding"),
    Row("rel_pos_bias.relative_position_bias_table",
        ("params/Transformer" + REL_TABLE,)),
    Repeat((
        Row(_TM + "gamma_1", (E + "LayerScale_0/scale",)),
        Row(_TM + "gamma_2", (E + "LayerScale_1/scale",)),
        *norm(_TM + "norm1.", E + "LayerNorm_0"),
        Row(_TM + "attn.q_bias", (ATTN + "/query/bias",), HEADS_BIAS),
        Row(_TM + "attn.v_bias", (ATTN + "/value/bias",), HEADS_BIAS),
        Row(_TM + "attn.relative_position_bias_table", (ATTN + REL_TABLE,)),
        fused_qkv(_TM + "attn.qkv.weight", "", ATTN)[0],
        *out_proj(_TM + "attn.proj.", ATTN),
        *norm(_TM + "norm2.", E + "LayerNorm_1"),
        *_fix_mlp_rows(_timm_mlp(_TM + "mlp.")),
    )),
    *norm("norm.", "params/Transformer/encoder_norm"),
    *norm("fc_norm.", "params/fc_norm"),
    *dense("head.", "params/head"),
), aliases=((r"^module\.", ""),), resample="timm",
   # The index of a table is computed from the grid (BEiT's own
   # checkpoints saved it; timm's loader drops it too).
   ignored=r"relative_position_index$")


# timm's VisionTransformerSAM (Segment Anything's image encoder, timm's
# samvit_*): a (1, H, W, D) position grid, the decomposed rel-pos tables of
# each attention, the conv neck, a ClassifierHead (head.fc). SAM's own
# checkpoints (sam_vit_*.pth: image_encoder.*, mlp.lin1 / lin2, beside the
# prompt encoder and mask decoder) are renamed as timm's checkpoint_filter_fn.
_SAM_RE = re.compile(r"^(neck\.|blocks\.\d+\.attn\.rel_pos_h$)")
TIMM_SAM = Layout("timm_sam", rows=(
    Row("pos_embed", (POS,), GRID_TOKENS),
    *conv("patch_embed.proj.", "params/embedding"),
    *norm("norm_pre.", "params/Transformer/pre_norm"),
    Repeat((
        *norm(_TM + "norm1.", E + "LayerNorm_0"),
        Row(_TM + "attn.rel_pos_h", (ATTN + "/rel_pos_h",)),
        Row(_TM + "attn.rel_pos_w", (ATTN + "/rel_pos_w",)),
        *fused_qkv(_TM + "attn.qkv.weight", _TM + "attn.qkv.bias", ATTN),
        *norm(_TM + "attn.q_norm.", ATTN + "/query_ln"),
        *norm(_TM + "attn.k_norm.", ATTN + "/key_ln"),
        *out_proj(_TM + "attn.proj.", ATTN),
        Row(_TM + "ls1.gamma", (E + "LayerScale_0/scale",)),
        *norm(_TM + "norm2.", E + "LayerNorm_1"),
        *dense(_TM + "mlp.fc1.", E + "MlpBlock_0/Dense_0"),
        *dense(_TM + "mlp.fc2.", E + "MlpBlock_0/Dense_1"),
        Row(_TM + "ls2.gamma", (E + "LayerScale_1/scale",)),
    )),
    *conv("neck.0.", "params/neck/Conv_0")[:1],
    *norm("neck.1.", "params/neck/LayerNorm_0"),
    *conv("neck.2.", "params/neck/Conv_1")[:1],
    *norm("neck.3.", "params/neck/LayerNorm_1"),
    *dense("head.fc.", "params/head"),
), aliases=((r"^module\.", ""), (r"^image_encoder\.", ""),
            (r"\.mlp\.lin([12])\.", r".mlp.fc\1.")),
   ignored=r"^(prompt_encoder|mask_decoder)\.|^pixel_(mean|std)$",
   resample="timm", unsupported=(
    ("neck.weight", "SAM's ViT without its conv neck (a channel LayerNorm "
     "of epsilon 1e-6 after blocks of 1e-5: timm's samvit_base_patch16_224, "
     "without released weights)"),
))


# timm's VisionTransformerRelPos (vit_relpos_*, vit_srelpos_*): no
# position embedding; a relative position MLP (rel_pos.mlp.fc1 / fc2, no
# fc2 bias in Swin v2's mode) or table (rel_pos.relative_position_bias_
# table: timm's RelPosBias, with the class token's three rows where the
# model has one) in each block's attention, or one shared (shared_rel_pos.);
# our rel_pos_bias/... with rel_pos_bias 'block' / 'shared'. The blocks are
# VisionTransformer's names (ls1 / ls2; ResPostRelPosBlock: none); the
# class token, fc_norm, the head.
REL_MLP = "/rel_pos_bias/Dense_0/kernel"


def _rel_pos_rows(theirs: str, ours: str):
  """timm's RelPosBias / RelPosMlp ``theirs`` <-> our ``rel_pos_bias``
  module ``ours``."""
  return (Row(theirs + "relative_position_bias_table", (ours + "/table",)),
          *dense(theirs + "mlp.fc1.", ours + "/Dense_0"),
          *dense(theirs + "mlp.fc2.", ours + "/Dense_1"))


TIMM_RELPOS = Layout("timm_relpos", rows=(
    Row("cls_token", ("params/cls",)),
    *conv("patch_embed.proj.", "params/embedding"),
    *_rel_pos_rows("shared_rel_pos.", "params/Transformer/rel_pos_bias"),
    Repeat(_timm_block(_rel_pos_rows(_TM + "attn.rel_pos.",
                                     ATTN + "/rel_pos_bias"))),
    *norm("norm.", "params/Transformer/encoder_norm"),
    *norm("fc_norm.", "params/fc_norm"),
    *dense("head.", "params/head"),
), aliases=((r"^module\.", ""),), resample="timm",
   # Computed from the grid, never saved (non-persistent buffers).
   ignored=r"(relative_position_index|rel_coords_log)$")


def relpos_pooling(keys) -> str:
  """timm's VisionTransformerRelPos pools by the class token where it has
  one and no ``fc_norm`` (``vit_relpos_*_cls_*``), else by the mean of
  the patches (its default; ``_clsgap_``: a class token, then the mean,
  then ``fc_norm``): the classifier of its state dict without a name."""
  keys = list(keys)
  return ("token" if "cls_token" in keys and "fc_norm.weight" not in keys
          else "gap")


def is_relpos_tree(flat) -> bool:
  """Whether only timm's VisionTransformerRelPos holds a tree's relative
  position bias: an MLP's, or a table without the class token's rows or
  beside a key bias (Beit's has neither). A table with the class token
  and no key bias is Beit's as much (the same function): Beit's names."""
  keys = list(flat)
  if any(k.endswith(REL_MLP) for k in keys):
    return True
  if not any(k.endswith(REL_TABLE) for k in keys):
    return False
  return "params/cls" not in keys or any(
      k.endswith("MultiHeadDotProductAttention_0/key/bias") for k in keys)


# timm's Cait (CaiT): the blocks' talking-heads attention (a fused qkv, the
# heads' mixing proj_l / proj_w), LayerScale gamma_1 / gamma_2 (Eva's
# names), a position embedding of the patches only; then the class-attention
# blocks (blocks_token_only.*: separate q, k, v), the final norm, the head.
# Every timm Cait drops paths at one rate in every block (fixed).
_TC = "blocks_token_only.{i}."
C = "params/Transformer/classblock_{i}/"  # our class-attention block
C_ATTN = C + "MultiHeadDotProductAttention_0"


def _layer_scale_block(theirs: str, ours: str, attention):
  """A CaiT block: gamma_1 / gamma_2, the norms, ``attention``'s rows,
  the MLP (fc1 / fc2)."""
  return (Row(theirs + "gamma_1", (ours + "LayerScale_0/scale",)),
          Row(theirs + "gamma_2", (ours + "LayerScale_1/scale",)),
          *norm(theirs + "norm1.", ours + "LayerNorm_0"),
          *attention,
          *norm(theirs + "norm2.", ours + "LayerNorm_1"),
          *dense(theirs + "mlp.fc1.", ours + "MlpBlock_0/Dense_0"),
          *dense(theirs + "mlp.fc2.", ours + "MlpBlock_0/Dense_1"))


TIMM_CAIT = Layout("timm_cait", rows=(
    Row("cls_token", ("params/cls",)),
    Row("pos_embed", (POS,)),
    *conv("patch_embed.proj.", "params/embedding"),
    Repeat(_layer_scale_block(_TM, E, (
        *fused_qkv(_TM + "attn.qkv.weight", _TM + "attn.qkv.bias", ATTN),
        *out_proj(_TM + "attn.proj.", ATTN),
        *dense(_TM + "attn.proj_l.", ATTN + "/proj_l"),
        *dense(_TM + "attn.proj_w.", ATTN + "/proj_w")))),
    Repeat(_layer_scale_block(_TC, C, (
        *split_qkv(_TC + "attn.", C_ATTN, names=("q", "k", "v")),
        *out_proj(_TC + "attn.proj.", C_ATTN)))),
    *norm("norm.", "params/Transformer/encoder_norm"),
    *dense("head.", "params/head"),
), aliases=((r"^module\.", ""),), resample="timm",
   fixed=(("drop_path_schedule", "constant"),))

CAIT_WITHOUT_CLASS_ATTENTION = (
    "These are the weights of a timm Cait without class-attention blocks "
    "(no blocks_token_only.*: depth_token_only=0), whose class token never "
    "meets the patches; vit_jax computes CaiT with its class-attention "
    "blocks (class_attn_layers), as every released cait_* has them.")


# timm's tensors with an axis of one entry per head: (key, that axis).
_PER_HEAD = (
    ("blocks.0.attn.proj_l.weight", 0),  # CaiT's (heads, heads) maps
    ("blocks.0.attn.rel_pos.mlp.fc2.weight", 0),  # RelPosMlp's output
    ("shared_rel_pos.mlp.fc2.weight", 0),
    ("blocks.0.attn.rel_pos.relative_position_bias_table", 1),  # RelPosBias
    ("shared_rel_pos.relative_position_bias_table", 1),
)


def shown_heads(keys_and_shapes: Mapping[str, Any]) -> Optional[int]:
  """The heads a timm state dict shows (None where it does not): CaiT's
  talking-heads maps are (heads, heads); timm's relative position MLPs
  give one bias per head, its tables (RelPosBias) hold a column per
  head."""
  for key, axis in _PER_HEAD:
    w = keys_and_shapes.get(key)
    if w is not None and np.ndim(w) == 2:
      return int(np.shape(w)[axis])
  return None


def timm_layout(keys) -> str:
  """``'timm_naflex'`` for NaFlexVit's ``embeds.*``; ``'timm_cait'`` for
  Cait's class-attention blocks or talking heads; ``'timm_relpos'`` for
  VisionTransformerRelPos's ``rel_pos`` / ``shared_rel_pos``;
  ``'timm_beit'`` for BEiT's relative position tables; ``'timm_sam'`` for
  VisionTransformerSAM's neck or rel-pos tables; ``'timm_vitamin'`` for
  ViTamin's stem (``patch_embed.backbone.stem.conv1``) or ``GeGluMlp``
  (``mlp.w0``); ``'timm_eva'`` for keys only timm's Eva has (LayerScale
  ``gamma_1``, ``q_bias`` / ``v_bias``, separate ``q_proj``); else
  ``'timm'``."""
  keys = list(keys)
  if any(k.startswith("embeds.") for k in keys):
    return "timm_naflex"
  if any(k.startswith(_VB + "stem.conv1.") or
         re.match(r"^blocks\.\d+\.mlp\.w0\.", k) for k in keys):
    return "timm_vitamin"
  cait = re.compile(r"^(blocks_token_only\.|blocks\.\d+\.attn\.proj_[lw]\.)")
  if any(cait.match(k) for k in keys):
    return "timm_cait"
  if any(re.match(r"^(blocks\.\d+\.attn\.rel_pos|shared_rel_pos)\.", k)
         for k in keys):
    return "timm_relpos"
  beit = re.compile(r"^(blocks\.\d+\.attn\.|rel_pos_bias\.)"
                    r"relative_position_bias_table$")  # not Swin's layers.*
  if any(beit.match(k) for k in keys):
    return "timm_beit"
  if any(_SAM_RE.match(re.sub(r"^image_encoder\.", "", k)) for k in keys):
    return "timm_sam"
  eva = re.compile(r"^blocks\.\d+\.(gamma_1|attn\.q_bias|attn\.q_proj\.)")
  return "timm_eva" if any(eva.match(k) for k in keys) else "timm"


def timm_layout_of(flat) -> str:
  """The timm class a tree of ours loads into: ``'timm_naflex'`` for a
  NaFlex position grid (NaFlexVit); ``'timm_cait'`` for class-attention
  blocks (Cait); ``'timm_relpos'`` for a relative position MLP, or a table
  only VisionTransformerRelPos holds (:func:`is_relpos_tree`);
  ``'timm_beit'`` for other relative position tables (Beit);
  ``'timm_sam'`` for SAM's neck or decomposed rel-pos tables
  (VisionTransformerSAM); ``'timm_vitamin'`` for ViTamin's stem or MLP
  input norm (:func:`is_vitamin_tree`); ``'timm_eva'`` where only Eva can
  hold it (no learned position embedding: DINOv3; learned RoPE
  frequencies: RoPE-Mixed; a query bias without a key bias; LayerScale
  with a norm before the blocks: PE), else ``'timm'``
  (VisionTransformer). A tree both hold (Naver's axial ``*_rope_ape_224``:
  DeiT-III's tree) is VisionTransformer's; :func:`timm_layout_for_name`
  says Eva's by name."""
  keys = list(flat)
  if POS_GRID in keys or POS_Y in keys:
    return "timm_naflex"
  if any(k.startswith("params/Transformer/classblock_") for k in keys):
    return "timm_cait"
  if is_relpos_tree(keys):
    return "timm_relpos"
  if any(k.endswith(REL_TABLE) for k in keys):
    return "timm_beit"
  if any(k.startswith("params/neck/") or k.endswith("/rel_pos_h")
         for k in keys):
    return "timm_sam"
  if is_vitamin_tree(keys):
    return "timm_vitamin"
  if _PARALLEL(keys) or any("/lambda_" in k for k in keys):
    return "timm"  # ParallelScalingBlock, DiffAttention: VisionTransformer's
  if (not any("posembed_input" in k for k in keys) or
      "params/Transformer/rope_freqs" in keys):
    return "timm_eva"
  if (any(k.endswith("MultiHeadDotProductAttention_0/query/bias")
          and "encoderblock" in k for k in keys) and
      not any(k.endswith("MultiHeadDotProductAttention_0/key/bias")
              and "encoderblock" in k for k in keys)):
    return "timm_eva"
  if (any("LayerScale_0" in k for k in keys) and
      any("Transformer/pre_norm" in k for k in keys)):
    return "timm_eva"
  return "timm"


# ----------------------------------------------------- Hugging Face (ViT) ---
# transformers v5's module names (what ``state_dict()`` has and
# ``load_state_dict`` takes); files on the Hub and from ``save_pretrained``
# keep the v4 names, which the aliases rename on the way in.
_HF = "layers.{i}."

# transformers' ViT-style encoder keys (ViT, ViTMAE, I-JEPA, BEiT,
# Data2Vec-Vision) -> the shared row names.
_HF_ENCODER_ALIASES = (
    (r"^encoder\.layer\.(\d+)\.attention\.attention\.(q|k|v)[a-z]*\.",
     r"layers.\1.attention.\2_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.",
     r"layers.\1.attention.o_proj."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.mlp.fc1."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.mlp.fc2."),
    (r"^encoder\.layer\.", "layers."),
)

# ViTModel's patch embedding and blocks, which ViTMAE and I-JEPA share.
_HF_PATCHES = conv("embeddings.patch_embeddings.projection.",
                   "params/embedding")
_HF_VIT_BLOCKS = Repeat((
    *split_qkv(_HF + "attention.", ATTN, names=("q_proj", "k_proj", "v_proj")),
    *out_proj(_HF + "attention.o_proj.", ATTN),
    *norm(_HF + "layernorm_before.", E + "LayerNorm_0"),
    *norm(_HF + "layernorm_after.", E + "LayerNorm_1"),
    *dense(_HF + "mlp.fc1.", E + "MlpBlock_0/Dense_0"),
    *dense(_HF + "mlp.fc2.", E + "MlpBlock_0/Dense_1"),
))

TRANSFORMERS_VIT = Layout("transformers", rows=(
    Row("embeddings.cls_token", ("params/cls",)),
    Row("embeddings.position_embeddings", (POS,)),
    *_HF_PATCHES,
    _HF_VIT_BLOCKS,
    *norm("layernorm.", "params/Transformer/encoder_norm"),
    *dense("pooler.dense.", "params/pre_logits"),
    *dense("classifier.", "params/head"),
), aliases=(
    (r"^module\.", ""), (r"^vit\.", ""),
    *_HF_ENCODER_ALIASES,
), unsupported=(
    ("embeddings.mask_token", "a mask token (masked image modeling)"),
), fixed=(("classifier", "token"),))

# transformers' MAE encoder (ViTMAEModel, or a ViTMAEForPreTraining's
# ``vit.``): ViTModel's names without a pooler. Its fixed 2-D sin-cos
# position embedding (a Parameter with requires_grad=False, so in the state
# dict; the class token's row zeros) is our position embedding, read and
# written as it is. The model is the encoder on every patch: transformers'
# forward with mask_ratio=0 and its tokens in order (noise sorted, or
# unshuffled by ids_restore). The pretraining decoder is a second network:
# left out with a warning, as transformers' ViTMAEModel.from_pretrained
# reports it unexpected and leaves it.
TRANSFORMERS_VIT_MAE = Layout("transformers_vit_mae", rows=(
    Row("embeddings.cls_token", ("params/cls",)),
    Row("embeddings.position_embeddings", (POS,)),
    *_HF_PATCHES,
    _HF_VIT_BLOCKS,
    *norm("layernorm.", "params/Transformer/encoder_norm"),
), aliases=TRANSFORMERS_VIT.aliases, dropped=(
    (r"^decoder\.", "ViTMAEForPreTraining's decoder (the pixel "
     "reconstruction of masked patches; vit_jax loads the encoder, "
     "ViTMAEModel)"),
), fixed=(("classifier", "token"),))

# transformers' I-JEPA (IJepaModel, IJepaForImageClassification): ViTModel's
# names without a class token; the position embedding covers the patches;
# the classifier reads the mean of the final norm's tokens (ours 'gap').
# IJepaModel's optional pooler (add_pooling_layer=True) reads the first
# patch token, which no model of ours does: refused by name. The mask token
# (masked-image pretraining) is not kept.
TRANSFORMERS_IJEPA = Layout("transformers_ijepa", rows=(
    Row("embeddings.position_embeddings", (POS,)),
    *_HF_PATCHES,
    _HF_VIT_BLOCKS,
    *norm("layernorm.", "params/Transformer/encoder_norm"),
    *dense("classifier.", "params/head"),
), aliases=(
    (r"^module\.", ""), (r"^ijepa\.", ""),
    *_HF_ENCODER_ALIASES,
), ignored=r"^embeddings\.mask_token$", unsupported=(
    ("pooler.dense.", "IJepaModel's pooler (add_pooling_layer=True: the first "
     "patch token through Dense + tanh); build it without one"),
), fixed=(("classifier", "gap"),))


def refuse_vit_without_class_token(state_dict) -> None:
  """ViT's names without a class token are read as I-JEPA's
  (:func:`detect`), whose position embedding covers a square grid of
  patches: a ValueError where its rows are no square (a ViTModel's class
  token missing). An I-JEPA of a non-square size loads with its config."""
  shape = np.shape(state_dict.get("embeddings.position_embeddings", ()))
  rows = shape[1] if len(shape) == 3 else 0
  if not rows or int(round(np.sqrt(rows))) ** 2 == rows:
    return  # (a missing embedding is the checker's to name)
  raise ValueError(
      f"These weights have ViT's names without a class token "
      f"(embeddings.cls_token), as I-JEPA's (IJepaModel), but their "
      f"position embedding of shape {shape} is no square grid of patches: "
      f"is it a ViTModel's state dict missing its class token? An I-JEPA of "
      f"a non-square size loads with its config (config.json's model_type "
      f"'ijepa').")

# transformers' DINOv2 (Dinov2Model) and DINOv2 with registers
# (Dinov2WithRegistersModel, whose position embedding covers the class token
# but not the registers). The mask token serves masked-image training only:
# dropped on the way in, zeros on the way out. The giants' SwiGLU is our
# packed gated MLP: gate_proj and up_proj are its two halves (Hub files: one
# weights_in, as timm's fc1).
_HFD = "encoder.layer.{i}."
_PACKED = E + "MlpBlock_0/Dense_0"


def _hf_swiglu(prefix: str, names=("gate_proj", "up_proj", "down_proj")):
  """transformers' SwiGLU: ``gate_proj``, ``up_proj``, ``down_proj``. Our
  split MLP maps one to one; a packed one's Dense_0 is gate then up."""
  gate, up, down = names
  packed = _mlp_is("packed")
  return (
      Row(f"{prefix}{gate}.weight", (_PACKED + "/kernel",), part(DENSE, 0, 2),
          packed),
      Row(f"{prefix}{gate}.bias", (_PACKED + "/bias",), part(RAW, 0, 2),
          packed),
      Row(f"{prefix}{up}.weight", (_PACKED + "/kernel",), part(DENSE, 1, 2),
          packed),
      Row(f"{prefix}{up}.bias", (_PACKED + "/bias",), part(RAW, 1, 2), packed),
      *(dataclasses.replace(r, when=_any(_SPLIT_MLP)) for r in (
          *dense(f"{prefix}{gate}.", GATE),
          *dense(f"{prefix}{up}.", _PACKED))),
      *(dataclasses.replace(r, when=lambda f: mlp_kind(f) is not None)
        for r in dense(f"{prefix}{down}.", E + "MlpBlock_0/Dense_1")),
  )


def _hf_dinov2_rows(registers: bool):
  return (
      Row("embeddings.cls_token", ("params/cls",)),
      Row("embeddings.mask_token", ("params/cls",), zeros(lambda s: s[1:])),
      Row("embeddings.position_embeddings", (POS,)),
      *((Row("embeddings.register_tokens", ("params/registers",)),)
        if registers else ()),
      *conv("embeddings.patch_embeddings.projection.", "params/embedding"),
      Repeat((
          *norm(_HFD + "norm1.", E + "LayerNorm_0"),
          *split_qkv(_HFD + "attention.", ATTN,
                     names=("q_proj", "k_proj", "v_proj")),
          *out_proj(_HFD + "attention.o_proj.", ATTN),
          Row(_HFD + "layer_scale1.lambda1", (E + "LayerScale_0/scale",)),
          *norm(_HFD + "norm2.", E + "LayerNorm_1"),
          *(dataclasses.replace(r, when=_mlp_is(None))
            for r in dense(_HFD + "mlp.fc1.", E + "MlpBlock_0/Dense_0")),
          *_hf_swiglu(_HFD + "mlp."),
          *(dataclasses.replace(r, when=_mlp_is(None))
            for r in dense(_HFD + "mlp.fc2.", E + "MlpBlock_0/Dense_1")),
          Row(_HFD + "layer_scale2.lambda1", (E + "LayerScale_1/scale",)),
      )),
      *norm("layernorm.", "params/Transformer/encoder_norm"),
  )


_HF_DINOV2_ALIASES = (
    (r"^module\.", ""), (r"^dinov2(_with_registers)?\.", ""),
    (r"\.attention\.attention\.(q|k|v)[a-z]*\.", r".attention.\1_proj."),
    (r"\.attention\.output\.dense\.", ".attention.o_proj."),
    (r"\.mlp\.weights_out\.", ".mlp.down_proj."),  # Hub files' SwiGLU
)
# Hub files keep the SwiGLU's gate and up projections in one weights_in,
# which transformers chunks on load (its conversion_mapping): so do we.
_HF_DINOV2_CHUNKS = (
    (r"\.mlp\.weights_in\.", (".mlp.gate_proj.", ".mlp.up_proj.")),)

TRANSFORMERS_DINOV2 = Layout(
    "transformers_dinov2", rows=_hf_dinov2_rows(registers=False),
    aliases=_HF_DINOV2_ALIASES, chunks=_HF_DINOV2_CHUNKS, unsupported=(
        ("register_tokens", "registers: a Dinov2WithRegistersModel (its "
         "config.json's model_type 'dinov2_with_registers')"),
    ), fixed=(("classifier", "token"),))

TRANSFORMERS_DINOV2_REG = Layout(
    "transformers_dinov2_reg", rows=_hf_dinov2_rows(registers=True),
    aliases=_HF_DINOV2_ALIASES, chunks=_HF_DINOV2_CHUNKS,
    fixed=(("classifier", "token"),), resample="timm")

# transformers' DINOv3 (DINOv3ViTModel): no position embedding (RoPE), q/v
# biases without a key bias, LayerScale, an optional SwiGLU (split).
_HF3 = "model.layer.{i}."
TRANSFORMERS_DINOV3 = Layout("transformers_dinov3", rows=(
    Row("embeddings.cls_token", ("params/cls",)),
    Row("embeddings.mask_token", ("params/cls",), zeros(lambda s: s)),
    Row("embeddings.register_tokens", ("params/registers",)),
    *conv("embeddings.patch_embeddings.", "params/embedding"),
    Repeat((
        *norm(_HF3 + "norm1.", E + "LayerNorm_0"),
        *split_qkv(_HF3 + "attention.", ATTN,
                   names=("q_proj", "k_proj", "v_proj")),
        *out_proj(_HF3 + "attention.o_proj.", ATTN),
        Row(_HF3 + "layer_scale1.lambda1", (E + "LayerScale_0/scale",)),
        *norm(_HF3 + "norm2.", E + "LayerNorm_1"),
        *dense(_HF3 + "mlp.gate_proj.", GATE),
        *dense(_HF3 + "mlp.up_proj.", E + "MlpBlock_0/Dense_0"),
        *dense(_HF3 + "mlp.down_proj.", E + "MlpBlock_0/Dense_1"),
        Row(_HF3 + "layer_scale2.lambda1", (E + "LayerScale_1/scale",)),
    )),
    *norm("norm.", "params/Transformer/encoder_norm"),
), aliases=(
    (r"^module\.", ""), (r"^dinov3\.", ""),
    (r"^layer\.(\d+)\.", r"model.layer.\1."),  # Hub files (v4 names)
), fixed=(("classifier", "token"),))

# transformers' AIMv2 image tower (Aimv2VisionModel, or an Aimv2Model's
# vision half): RMSNorm, a norm after the patch embedding, no biases, a
# SwiGLU (split). Its optional attention-pooling head (use_head) has no
# counterpart here and is named as unsupported.
_HFA = "encoder.layers.{i}."
TRANSFORMERS_AIMV2 = Layout("transformers_aimv2", rows=(
    *conv("embeddings.patch_embed.", "params/embedding"),
    *norm("embeddings.rms_norm.", "params/embedding_norm"),
    Row("embeddings.position_embedding.weight", (POS,), expand(1)),
    Repeat((
        *split_qkv(_HFA + "attention.", ATTN,
                   names=("q_proj", "k_proj", "v_proj")),
        *out_proj(_HFA + "attention.out_proj.", ATTN),
        *dense(_HFA + "ffn.gate_proj.", GATE),
        *dense(_HFA + "ffn.up_proj.", E + "MlpBlock_0/Dense_0"),
        *dense(_HFA + "ffn.down_proj.", E + "MlpBlock_0/Dense_1"),
        *norm(_HFA + "rms_norm1.", E + "LayerNorm_0"),
        *norm(_HFA + "rms_norm2.", E + "LayerNorm_1"),
    )),
    *norm("rms_norm.", "params/Transformer/encoder_norm"),
), aliases=((r"^module\.", ""), (r"^vision_model\.", "")),
   ignored=r"^(text_model|text_projection|image_projection|logit_scale)",
   unsupported=(("head.", "AIMv2's attention-pooling head (use_head=True); "
                 "build the tower with use_head=False"),))

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

# transformers' SigLIP 2 image tower (Siglip2VisionModel, or a Siglip2Model's
# vision half): SigLIP's, but a Linear over pre-cut patches and a square
# position table resized to each image (our NaFlex model).
TRANSFORMERS_SIGLIP2 = Layout("transformers_siglip2", rows=(
    *dense("embeddings.patch_embedding.", "params/embedding",
           op=LINEAR_PATCH),
    Row("embeddings.position_embedding.weight", (POS_GRID,), GRID_ROWS),
    *TRANSFORMERS_SIGLIP.rows[3:],
), aliases=_TOWER_ALIASES, ignored=_OTHER_TOWER)

# transformers' BEiT (BeitModel, BeitForImageClassification: v5 names, which
# its state_dict() has; files keep the v4 names, renamed on the way in) and
# Data2Vec-Vision (Data2VecVisionModel / ...ForImageClassification, whose
# modules keep the v4 names): timm's Beit in other names. q and v biases, no
# key bias; LayerScale lambda_1 / lambda_2; a relative position table per
# layer or one shared; with use_mean_pooling the pooler's norm is our
# fc_norm, else the final layernorm the encoder's norm. The mask token
# (masked-image pretraining) is not kept.
def _hf_beit_rows(v4: bool):
  blk = "encoder.layer.{i}." if v4 else "layers.{i}."
  attn = blk + ("attention.attention." if v4 else "attention.")
  q, k, v = ("query", "key", "value") if v4 else ("q_proj", "k_proj", "v_proj")
  table = ".relative_position_bias_table"
  own = Row((attn if v4 else blk) + "relative_position_bias" + table,
            (ATTN + REL_TABLE,))
  norms = (*norm(blk + "layernorm_before.", E + "LayerNorm_0"),
           *norm(blk + "layernorm_after.", E + "LayerNorm_1"))
  return (
      Row("embeddings.cls_token", ("params/cls",)),
      Row("embeddings.position_embeddings", (POS,)),
      *conv("embeddings.patch_embeddings.projection.", "params/embedding"),
      Row(("encoder.relative_position_bias" if v4
           else "shared_position_bias") + table,
          ("params/Transformer" + REL_TABLE,)),
      Repeat((
          Row(blk + "lambda_1", (E + "LayerScale_0/scale",)),
          Row(blk + "lambda_2", (E + "LayerScale_1/scale",)),
          *split_qkv(attn, ATTN, names=(q, k, v)),
          *((own,) if v4 else ()),
          *out_proj(blk + ("attention.output.dense." if v4
                           else "attention.o_proj."), ATTN),
          *(() if v4 else norms),
          *dense(blk + ("intermediate.dense." if v4 else "mlp.fc1."),
                 E + "MlpBlock_0/Dense_0"),
          *dense(blk + ("output.dense." if v4 else "mlp.fc2."),
                 E + "MlpBlock_0/Dense_1"),
          *(norms if v4 else ()),
          *(() if v4 else (own,)),
      )),
      *norm("layernorm.", "params/Transformer/encoder_norm"),
      *norm("pooler.layernorm.", "params/fc_norm"),
      *dense("classifier.", "params/head"),
  )


_HF_BEIT_IGNORED = r"^embeddings\.mask_token$|relative_position_index$"
TRANSFORMERS_BEIT = Layout("transformers_beit", rows=_hf_beit_rows(False),
                           aliases=(
    (r"^module\.", ""), (r"^(beit|data2vec_vision)\.", ""),
    (r"^encoder\.relative_position_bias\.", "shared_position_bias."),
    (r"^encoder\.layer\.(\d+)\.attention\.attention\.relative_position_bias\.",
     r"layers.\1.relative_position_bias."),
    *_HF_ENCODER_ALIASES,
), ignored=_HF_BEIT_IGNORED)
TRANSFORMERS_DATA2VEC_VISION = Layout(
    "transformers_data2vec_vision", rows=_hf_beit_rows(True),
    aliases=((r"^module\.", ""), (r"^data2vec_vision\.", "")),
    ignored=_HF_BEIT_IGNORED)

# transformers' SAM image encoder (SamVisionModel, or a SamModel's
# vision_encoder): timm's SAM under other names, no head; the blocks' norm
# epsilon is the config's (1e-6), the neck's 1e-6.
_HFS = "vision_encoder.layers.{i}."
_HFN = "vision_encoder.neck."
TRANSFORMERS_SAM = Layout("transformers_sam", rows=(
    Row("vision_encoder.pos_embed", (POS,), GRID_TOKENS),
    *conv("vision_encoder.patch_embed.projection.", "params/embedding"),
    Repeat((
        *norm(_HFS + "layer_norm1.", E + "LayerNorm_0"),
        Row(_HFS + "attn.rel_pos_h", (ATTN + "/rel_pos_h",)),
        Row(_HFS + "attn.rel_pos_w", (ATTN + "/rel_pos_w",)),
        *fused_qkv(_HFS + "attn.qkv.weight", _HFS + "attn.qkv.bias", ATTN),
        *out_proj(_HFS + "attn.proj.", ATTN),
        *norm(_HFS + "layer_norm2.", E + "LayerNorm_1"),
        *dense(_HFS + "mlp.lin1.", E + "MlpBlock_0/Dense_0"),
        *dense(_HFS + "mlp.lin2.", E + "MlpBlock_0/Dense_1"),
    )),
    *conv(_HFN + "conv1.", "params/neck/Conv_0")[:1],
    *norm(_HFN + "layer_norm1.", "params/neck/LayerNorm_0"),
    *conv(_HFN + "conv2.", "params/neck/Conv_1")[:1],
    *norm(_HFN + "layer_norm2.", "params/neck/LayerNorm_1"),
), aliases=((r"^module\.", ""),),
   ignored=r"^(shared_image_embedding|prompt_encoder|mask_decoder)\.")

LAYOUTS = {layout.name: layout for layout in (
    TORCHVISION, TIMM, TIMM_EVA, TIMM_BEIT, TIMM_NAFLEX, TIMM_SAM,
    TIMM_RELPOS, TIMM_CAIT, TIMM_VITAMIN, TRANSFORMERS_VIT, TRANSFORMERS_VIT_MAE,
    TRANSFORMERS_IJEPA,
    TRANSFORMERS_DINOV2, TRANSFORMERS_DINOV2_REG, TRANSFORMERS_DINOV3,
    TRANSFORMERS_CLIP, TRANSFORMERS_SIGLIP, TRANSFORMERS_SIGLIP2,
    TRANSFORMERS_AIMV2, TRANSFORMERS_BEIT, TRANSFORMERS_DATA2VEC_VISION,
    TRANSFORMERS_SAM)}
# transformers' model_type -> the layout of its weights.
HF_MODEL_TYPES = {"vit": "transformers", "vit_mae": "transformers_vit_mae",
                  "ijepa": "transformers_ijepa",
                  "dinov2": "transformers_dinov2",
                  "dinov2_with_registers": "transformers_dinov2_reg",
                  "dinov3_vit": "transformers_dinov3",
                  "clip": "transformers_clip",
                  "clip_vision_model": "transformers_clip",
                  "siglip": "transformers_siglip",
                  "siglip_vision_model": "transformers_siglip",
                  "siglip2": "transformers_siglip2",
                  "siglip2_vision_model": "transformers_siglip2",
                  "aimv2": "transformers_aimv2",
                  "aimv2_vision_model": "transformers_aimv2",
                  "beit": "transformers_beit",
                  "data2vec-vision": "transformers_data2vec_vision",
                  "sam": "transformers_sam",
                  "sam_vision_model": "transformers_sam"}


def transformers_layout_of(arch: Mapping[str, Any]) -> str:
  """The transformers model a tree of ours (its :func:`~vit_jax.weights.
  trees.arch_of`) exports to: SigLIP for a MAP head, CLIP for a norm before
  the blocks, AIMv2 for RMSNorm, DINOv3 for RoPE (no position embedding),
  DINOv2 with registers / DINOv2 for LayerScale, else ViT; SigLIP 2's
  NaFlex tower for a NaFlex model; BEiT's for a relative position bias;
  SAM's (SamVisionModel) for its neck, windows or relative positions;
  I-JEPA's (IJepaModel) for the mean of the patches without a class token.
  CaiT (talking heads, class attention), timm's relpos family (a bias
  from an MLP, or without a class token) and ViTamin have no transformers
  model. An
  MAE encoder's tree is a ViTModel's without a pooler, whose state dict
  ViTMAEModel loads as it is ('transformers_vit_mae' names the same keys)."""
  if arch.get("class_attn_layers") or arch.get("talking_heads"):
    raise ValueError("transformers has no CaiT (talking-heads attention, "
                     "class-attention blocks): export it with to_timm "
                     "(timm's Cait) or in our own layout.")
  if arch.get("diff_attn") or arch.get("parallel"):
    raise ValueError("transformers has no differential attention nor "
                     "parallel blocks (timm's vit_dwee_*, vit_pwee_*, "
                     "vit_*_xp_*): export it with to_timm (timm's "
                     "VisionTransformer) or in our own layout.")
  if arch.get("rel_pos_mlp") or (arch.get("rel_pos_bias") and
                                  not arch.get("class_token", True)):
    raise ValueError("transformers has no relative position bias from an "
                     "MLP, nor one without a class token (timm's "
                     "vit_relpos_*): export it with to_timm (timm's "
                     "VisionTransformerRelPos) or in our own layout.")
  if arch.get("mbconv") is not None or arch.get("mlp_input_norm"):
    raise ValueError("transformers has no ViTamin (its convolutional stem, "
                     "the norm of the MLP's input): export it with to_timm "
                     "(timm's vitamin_*) or in our own layout.")
  if arch.get("rel_pos_bias"):
    return "transformers_beit"
  if arch.get("naflex_factorized"):
    raise ValueError("transformers has no factorized position embedding "
                     "(timm's naflexvit_*_parfac_*): export it with to_timm "
                     "(timm's NaFlexVit) or in our own layout.")
  if arch.get("naflex"):
    return "transformers_siglip2"
  if arch.get("neck_chans") or arch.get("rel_pos") or arch.get("window_size"):
    return "transformers_sam"
  if arch.get("classifier") == "map":
    return "transformers_siglip"
  if arch.get("pre_norm"):
    return "transformers_clip"
  if arch.get("norm_type") == "rms":
    return "transformers_aimv2"
  if arch.get("abs_pos_embed") is False:
    return "transformers_dinov3"
  if arch.get("layer_scale_init") or arch.get("gated_mlp"):
    return ("transformers_dinov2_reg" if arch.get("num_registers")
            else "transformers_dinov2")
  if arch.get("classifier") == "gap" and not arch.get("class_token"):
    return "transformers_ijepa"
  return "transformers"


def transformers_layout(config: Optional[Mapping[str, Any]]) -> Optional[str]:
  """The layout of a transformers model from its config's ``model_type``
  (a CLIP / SigLIP config's ``vision_config``); None when there is none."""
  config = config or {}
  model_type = (config.get("vision_config") or config).get("model_type")
  return HF_MODEL_TYPES.get(model_type) if model_type else None


# (a key that only this layout has, the layout), first match wins; keys are
# read without a wrapper's prefix.
_SIGNATURES = (
    (r"^vision_encoder\.(neck\.|patch_embed\.projection\.)",
     "transformers_sam"),
    (r"^(class_token$|conv_proj\.|encoder\.layers\.encoder_layer_)",
     "torchvision"),
    (r"^embeddings\.class_embedding$", "transformers_clip"),
    (r"^embeddings\.patch_embedding\.weight$", "transformers_siglip"),
    (r"^embeddings\.patch_embed\.weight$|\.rms_norm1\.weight$",
     "transformers_aimv2"),
    (r"^embeddings\.patch_embeddings\.weight$|^(model\.)?layer\.\d+\."
     r"layer_scale1", "transformers_dinov3"),
    (r"^embeddings\.register_tokens$", "transformers_dinov2_reg"),
    (r"^(layers|encoder\.layer)\.\d+\.(lambda_1$|(attention\.attention\.)?"
     r"relative_position_bias\.)|^(shared_position_bias|encoder\."
     r"relative_position_bias)\.", "transformers_beit"),
    (r"layer_scale1\.lambda1$|^encoder\.layer\.\d+\.norm1\.",
     "transformers_dinov2"),
    (r"^decoder\.decoder_(embed|pred)\.", "transformers_vit_mae"),
    (r"^embeddings\.patch_embeddings\.projection\.weight$", "transformers"),
    (r"^(patch_embed\.proj\.weight$|blocks\.)", "timm"),
)


def refine(layout: str, state_dict) -> str:
  """What the keys leave open, from a tensor's shape: transformers' SigLIP
  and SigLIP 2 towers have the same names; SigLIP 2's patch embedding is a
  Linear (2-D), SigLIP's a conv (4-D)."""
  w = state_dict.get("embeddings.patch_embedding.weight")
  if layout == "transformers_siglip" and w is not None and np.ndim(w) == 2:
    return "transformers_siglip2"
  return layout


def detect(keys) -> Optional[str]:
  """The layout a state dict's keys are in (None: not a ViT we know).
  timm's two classes are one answer, ``'timm'``: :func:`timm_layout` tells
  them apart. ViT's names without a class token (which every ViTModel
  has) are I-JEPA's."""
  keys = [re.sub(r"^(module|vision_model|vit|dinov2(_with_registers)?|"
                 r"dinov3|beit|data2vec_vision|image_encoder|ijepa)\.", "", k)
          for k in keys]
  for pattern, layout in _SIGNATURES:
    if any(re.search(pattern, k) for k in keys):
      if layout == "transformers" and "embeddings.cls_token" not in keys:
        return "transformers_ijepa"
      return layout
  return None


# --------------------------------------------------------------------------- #
# What the keys cannot say.
# --------------------------------------------------------------------------- #

# The heads of a width, as timm's and torchvision's models have them (head
# width 64 up to ViT-L, then 16 heads).
HEADS_FOR_WIDTH = {192: 3, 256: 4, 320: 5, 384: 6, 512: 8, 640: 10, 768: 12,
                   832: 13, 896: 14, 1024: 16, 1152: 16, 1280: 16, 1408: 16,
                   1536: 16, 1664: 16, 1792: 16}


class Undecided(ValueError):
  """The weights do not show something only a name or a stated size can
  give; ``field`` is what to pass (``'model_name'`` or ``'num_heads'``)."""

  def __init__(self, message: str, field: str):
    super().__init__(message)
    self.field = field


def heads_for_width(width: int) -> int:
  if width not in HEADS_FOR_WIDTH:
    raise Undecided(
        f"The number of attention heads is not stored in these weights and "
        f"width {width} is not a standard ViT width "
        f"({sorted(HEADS_FOR_WIDTH)}): pass num_heads or the model's name.",
        "num_heads")
  return HEADS_FOR_WIDTH[width]


# timm names: vit_{size}_patch{P}[_...]_{res}, deit3_..., deit_...,
# deit_{size}_distilled_..., eva02_..., aimv2_..., vit_pe_{core,lang,spatial}_
# ...; a '.tag' names the weights and does not change the architecture.
TIMM_SIZES = {
    "tiny": (192, 12), "xsmall": (256, 10), "small": (384, 12),
    "medium": (512, 12), "mediumd": (512, 20), "betwixt": (640, 12),
    "base": (768, 12), "large": (1024, 24), "huge": (1280, 32),
    "giant": (1408, 40), "gigantic": (1664, 48), "so400m": (1152, 27),
    "so150m": (896, 18), "so150m2": (832, 21), "little": (320, 14),
    "wee": (256, 14), "giantopt": (1536, 40),
    # timm's SBB ViTs with differential attention (d), parallel blocks (p).
    "dwee": (256, 14), "pwee": (256, 16), "dpwee": (256, 16),
    "dlittle": (320, 14),
    "small_plus": (384, 12), "huge_plus": (1280, 32), "7b": (4096, 40),
    "1b": (2048, 24), "3b": (3072, 24), "enormous": (1792, 64),
}
_TIMM_NAME = re.compile(
    r"^(?P<family>vit_pe_(?:core|lang|spatial)|vit_s?relpos|vit|naflexvit|"
    r"deit3|deit|"
    r"eva02|eva|aimv2|beitv2|beit3|beit|samvit)_"
    r"(?P<size>[a-z0-9]+?(?:_plus)?)(?P<distilled>_distilled)?"
    r"_patch(?P<patch>\d+)(?P<rest>_[a-z0-9_]*)?$")
# The R50+ViT hybrids: vit_{size}_r{resnet depth}_s{stride}[_p{patch}]_{res}.
# ``s`` is the pixels per token, except in vit_tiny_r_s16_p8: the ResNet
# root's /4 with 8x8 patches is /32.
_TIMM_HYBRID_NAME = re.compile(
    r"^vit_(?P<size>tiny|small|base|large)_r(?P<resnet>\d*)_s(?P<stride>\d+)"
    r"(?:_p(?P<patch>\d+))?_(?P<res>\d+)$")
# ViTamin: vitamin_{size}_{res} (16 pixels a token: its stem's reduction).
_TIMM_VITAMIN_NAME = re.compile(r"^vitamin_(?P<size>small|base|large2?|xlarge)"
                                r"_(?P<res>\d+)$")
VITAMIN_SIZES = {"small": (384, 14), "base": (768, 14), "large": (1024, 31),
                 "large2": (1024, 31), "xlarge": (1152, 32)}
# CaiT: cait_{size}{depth}_{res} (patches of 16).
_TIMM_CAIT_NAME = re.compile(r"^cait_(?P<size>xxs|xs|s|m)(?P<depth>\d+)_"
                             r"(?P<res>\d+)$")
CAIT_WIDTHS = {"xxs": 192, "xs": 288, "s": 384, "m": 768}
# FlexiViT: flexivit_{size} (patches of 16 at 240 px, the patch size its
# weights were trained at among others; timm's pretrained configs).
_TIMM_FLEXIVIT_NAME = re.compile(r"^flexivit_(?P<size>small|base|large)$")
# timm's own tiny test ViTs (160 px in patches of 16): (width, depth).
TEST_VIT_SIZES = {"test_vit": (64, 6), "test_vit2": (64, 8),
                  "test_vit3": (96, 9)}
# Widths of a family's size where it is not timm's usual one.
_FAMILY_WIDTHS = (
    (r"^vit_giant_patch14_(reg\d+_)?(dinov2|tipsv2)", 1536),
    (r"^(naflex)?vit_giant_patch16_radio", 1536),
    (r"^vit_pe_\w+_gigantic", 1536),
    (r"^aimv2_huge", 1536),
    (r"^vit_relpos_base_patch(16|32)_plus", 896),
    (r"^vit_giant_patch16_lingbot", 1536),
)
# The resolution a name without one stands for (timm's pretrained configs).
_FAMILY_SIZES = ((r"dinov2", 518), (r"_dinov3", 256), (r"_radio_v\d", 512),
                 (r"^naflexvit_", 384), (r"^samvit_", 1024))

# (pattern on the name, fields) in order; later matches override earlier.
TIMM_FAMILIES = (
    (r"_clip_", dict(layer_norm_eps=1e-5)),
    (r"_quickgelu", dict(act="quick_gelu")),
    # SigLIP 2's own architectures use the tanh GELU in timm.
    (r"^vit_(base_patch32_siglip|large_patch16_siglip(_gap)?_512|"
     r"so400m_patch16_siglip|giantopt_patch16_siglip)", dict(act="gelu_tanh")),
    (r"^vit_base_patch16_gap_224$", dict(num_heads=16)),
    # BEiT, BEiT v2 (timm's Beit): the mean of the patches, then fc_norm.
    (r"^beit(v2)?_", dict(classifier="gap")),
    # BEiT-3's image tower (timm's VisionTransformer with sub-LN norms).
    (r"^beit3_", dict(classifier="gap", layer_norm_eps=1e-5)),
    (r"^vit_giant_patch14_(reg\d+_)?(dinov2|tipsv2)", dict(num_heads=24)),
    (r"^vit_base_patch(16|32)_plus", dict(num_heads=14)),
    # timm's ResPostBlock (and ResPostRelPosBlock): each branch's norm
    # after it (res-post-norm).
    (r"_rpn_", dict(post_norm=True)),
    # timm's VisionTransformerRelPos: the mean of the patches (with or
    # without a class token: _clsgap_), or the class token (_cls_).
    (r"^vit_s?relpos_", dict(classifier="gap")),
    (r"^vit_relpos_\w+_cls_", dict(classifier="token")),
    (r"^vit_relpos_base_patch(16|32)_plus", dict(num_heads=14)),
    # FlexiViT (big_vision's): the class token has no position row.
    (r"^flexivit_", dict(no_embed_class=True)),
    # EVA-01's MIM fine-tunes as timm's VisionTransformer (eva_large_*):
    # the mean of the patches, then fc_norm, beside a class token.
    (r"^eva_large_", dict(classifier="gap")),
    # timm's tiny test ViTs: heads of width 32; test_vit3's MAP head
    # attends to the register token too (pool_include_prefix).
    (r"^test_vit2?$", dict(num_heads=2)),
    (r"^test_vit3$", dict(num_heads=3, pool_include_prefix=True)),
    # EVA-01 (timm's Eva, eva_giant_*): no RoPE, q / v biases, a position
    # row for the class token, timm's LayerNorm (1e-6, the CLIP tower
    # too); the mean of the patches then fc_norm, or (_clip_) the class
    # token after the final norm.
    (r"^eva_giant_", dict(rope=None, layer_norm_eps=1e-6, classifier="gap",
                          no_embed_class=False)),
    (r"^eva_giant_patch14_clip_", dict(classifier="token")),
    # DINOv3 (timm's Eva): RoPE only, LayerNorm 1e-5, mean of the patches
    # (timm's default; upstream pools the class token: classifier='token').
    (r"_dinov3", dict(rope="dinov3", rope_temperature=100.0,
                      layer_norm_eps=1e-5, classifier="gap")),
    (r"^vit_huge_plus_patch16_dinov3", dict(num_heads=20)),
    (r"^vit_7b_patch16_dinov3", dict(num_heads=32)),
    # LingBot-Vision (timm's Eva): DINOv3's RoPE and LayerNorm, the class
    # token pooled (timm's global_pool='token').
    (r"_lingbot$", dict(rope="dinov3", rope_temperature=100.0,
                        layer_norm_eps=1e-5, classifier="token")),
    (r"^vit_giant_patch16_lingbot", dict(num_heads=24)),
    # timm's SBB RoPE ViTs (Eva): EVA's RoPE (T 1e4) on a 16x16 reference
    # grid, no learned position embedding, registers, the mean of the
    # patches (fc_norm).
    (r"_rope_reg\d+_gap_256$", dict(rope="cat", rope_temperature=10000.0,
                                     rope_ref_grid=(16, 16),
                                     classifier="gap")),
    # Naver's RoPE-ViT (Eva, attn_type='rope'): axial RoPE, x first, T 100,
    # the class token pooled; RoPE-Mixed: learned frequencies (T 10 their
    # initial values); _ape_: a learned embedding of the patches only.
    (r"_patch16_rope_(mixed_)?(ape_)?224$",
     dict(rope="cat", rope_temperature=100.0, rope_grid_indexing="xy",
          classifier="token")),
    (r"_patch16_rope_mixed_(ape_)?224$", dict(rope="mixed",
                                              rope_temperature=10.0)),
    (r"_patch16_rope_(mixed_)?ape_224$", dict(no_embed_class=True)),
    # EVA-02: RoPE on a 16x16 reference grid beside a learned embedding.
    (r"^eva02_", dict(rope="cat", rope_temperature=10000.0,
                      rope_ref_grid=(16, 16), layer_norm_eps=1e-6,
                      classifier="gap", no_embed_class=False)),
    (r"^eva02_.*_clip_", dict(classifier="token")),
    # EVA-02-E (EVA-CLIP-18B's tower): post-norm blocks, no RoPE.
    (r"^eva02_enormous", dict(post_norm=True, rope=None,
                              rope_temperature=None, rope_ref_grid=None)),
    # Perception Encoder: RoPE (x first, positions from 1) on the name's
    # grid; core: a MAP head of 8 heads over every token.
    (r"^vit_pe_", dict(rope="cat", rope_temperature=10000.0,
                       rope_grid_offset=1.0, rope_grid_indexing="xy",
                       layer_norm_eps=1e-5, no_embed_class=False)),
    (r"^vit_pe_\w+_gigantic", dict(rope_grid_offset=0.0)),
    (r"^vit_pe_core_", dict(pool_include_prefix=True, map_heads=8)),
    (r"^vit_pe_(lang|spatial)_", dict(classifier="gap")),
    # AIMv2: RMSNorm 1e-5, heads of width 128.
    (r"^aimv2_", dict(layer_norm_eps=1e-5)),
    (r"^aimv2_large", dict(num_heads=8)),
    (r"^aimv2_huge", dict(num_heads=12)),
    (r"^aimv2_1b", dict(num_heads=16)),
    (r"^aimv2_3b", dict(num_heads=24)),
    # RADIO: the class token and the other teachers' tokens (timm's
    # registers) have no position rows.
    (r"_radio_v\d", dict(no_embed_class=True)),
    (r"^(naflex)?vit_giant_patch16_radio", dict(num_heads=24)),
    # timm's NaFlexVit: the position grid resized to each image's patch
    # grid, as its NaFlexEmbeds (default: bicubic, antialiased); SigLIP 2
    # bilinear, antialiased, GELU-tanh; C-RADIO bilinear without
    # antialiasing to the square of the longer side, cropped (align_corners
    # as the checkpoint's own code: True for v3-B and v3-H); the '_par_'
    # models aspect-preserving too.
    (r"^naflexvit_", dict(naflex="bicubic_aa")),
    (r"^naflexvit_.*_par_", dict(naflex_square=True)),
    # The factorized position embedding (its rows and columns resized by
    # linear interpolation), aspect-preserving.
    (r"^naflexvit_.*_parfac_", dict(naflex="bilinear", naflex_square=True)),
    (r"^naflexvit_.*_siglip", dict(naflex="bilinear_aa", act="gelu_tanh")),
    (r"^naflexvit_.*_radio_v\d", dict(naflex="bilinear", naflex_square=True)),
    (r"^naflexvit_(base|huge)_patch16_radio_v3",
     dict(naflex_align_corners=True)),
    # SAM (timm's VisionTransformerSAM): windows of 14 patches but in the
    # global blocks (which the weights' rel-pos tables show where the grid
    # is not the window: those win), torch's LayerNorm epsilon.
    (r"^samvit_", dict(window_size=14, layer_norm_eps=1e-5)),
    (r"^samvit_base", dict(global_attn_indexes=(2, 5, 8, 11))),
    # ViTamin: its GeGluMlp gates by exact GELU (the keys show the stem,
    # the MLP's input norm and the mean pooling with fc_norm).
    (r"^vitamin_", dict(act="gelu")),
    (r"^samvit_large", dict(global_attn_indexes=(5, 11, 17, 23))),
    (r"^samvit_huge", dict(global_attn_indexes=(7, 15, 23, 31))),
)
# Names whose RoPE reference grid is their own native patch grid.
_REF_IS_NATIVE = r"^vit_pe_"
# RADIO's 128x128 position grid is resized bilinearly (align_corners as the
# checkpoint's own code: True for C-RADIOv3-B and -H) to a square, then
# cropped at the top left, as timm's _convert_radio.
_RADIO = r"_radio_v\d"
_RADIO_ALIGN_CORNERS = r"^vit_(base|huge)_patch16_radio_v3"

# What a family's weights expect (timm's pretrained_cfg defaults).
TIMM_PREPROCESSING = tuple(
    (pattern, dict(mean=mean, interpolation="bicubic", crop_pct=crop_pct))
    for pattern, mean, crop_pct in (
        (r"_dinov2", "imagenet", 1.0),
        (r"_dinov3", "imagenet", 1.0),
        (r"^eva02_.*(_clip_|_224$)", "openai_clip", 0.9),
        (r"^eva02_", "openai_clip", 1.0),
        (r"^vit_pe_", "half", 1.0),
        (r"^aimv2_", "openai_clip", 1.0),
        (r"_radio_v\d", "openai_clip", 1.0),
        (r"_clip_", "openai_clip", 1.0),
        (r"^vit_so400m_patch14_siglip_384", "half", 0.9),
        (r"_siglip", "half", 1.0),
        (r"^deit3_.*_384", "imagenet", 1.0),
        (r"^deit_.*_384", "imagenet", 1.0),
        (r"^deit", "imagenet", 0.875),
        (r"^beit3_", "imagenet", 1.0),
        (r"^beitv2_", "imagenet", 0.9),
        (r"^samvit_", "imagenet", 1.0),
        (r"^vitamin_\w+_224$", "openai_clip", 0.9),
        (r"^vitamin_", "openai_clip", 1.0),
        (r"^cait_", "imagenet", 1.0)))


def parse_timm_name(name: str) -> Optional[Dict[str, Any]]:
  """``vit_small_patch14_reg4_dinov2.lvd142m`` -> {family, size, width,
  depth, patch_size, image_size, registers, base, resample, hybrid (a
  ResNet stem: ``vit_base_r50_s16_224`` ...; CaiT: ``cait_s24_224``)};
  None if it is not a timm ViT name. ``resample``: how a checkpoint's
  position embedding is resampled to another grid (``'timm'``, or RADIO's
  ``'radio'`` / ``'radio_ac'``)."""
  base = name.split(".", 1)[0]
  if base.startswith("hf-hub:") or base.startswith("hf_hub:"):
    return None
  m = _TIMM_NAME.match(base)
  if m is None:
    return (_parse_hybrid_name(base) or _parse_cait_name(base) or
            _parse_flexivit_name(base) or _parse_test_vit_name(base) or
            _parse_vitamin_name(base))
  rest = m.group("rest") or ""
  res = re.search(r"_(\d+)$", rest)
  reg = re.search(r"_reg(\d+)", rest)
  size = m.group("size")
  width, depth = TIMM_SIZES.get(size, (None, None))
  for pattern, w in _FAMILY_WIDTHS:
    if re.search(pattern, base):
      width = w
  image_size = int(res.group(1)) if res else next(
      (s for pattern, s in _FAMILY_SIZES if re.search(pattern, base)), 224)
  resample = "timm"
  if re.search(_RADIO, base):
    resample = "radio_ac" if re.search(_RADIO_ALIGN_CORNERS, base) else "radio"
  return dict(family=m.group("family"), size=size, width=width, depth=depth,
              patch_size=int(m.group("patch")), image_size=image_size,
              registers=int(reg.group(1)) if reg else 0, base=base,
              distilled=bool(m.group("distilled")), resample=resample,
              hybrid=False)


def _parse_cait_name(base: str) -> Optional[Dict[str, Any]]:
  m = _TIMM_CAIT_NAME.match(base)
  if m is None:
    return None
  return dict(family="cait", size=m.group("size"),
              width=CAIT_WIDTHS[m.group("size")], depth=int(m.group("depth")),
              patch_size=16, image_size=int(m.group("res")), registers=0,
              base=base, distilled=False, resample="timm", hybrid=False)


def _parse_flexivit_name(base: str) -> Optional[Dict[str, Any]]:
  m = _TIMM_FLEXIVIT_NAME.match(base)
  if m is None:
    return None
  width, depth = TIMM_SIZES[m.group("size")]
  return dict(family="flexivit", size=m.group("size"), width=width,
              depth=depth, patch_size=16, image_size=240, registers=0,
              base=base, distilled=False, resample="timm", hybrid=False)


def _parse_test_vit_name(base: str) -> Optional[Dict[str, Any]]:
  if base not in TEST_VIT_SIZES:
    return None
  width, depth = TEST_VIT_SIZES[base]
  return dict(family="test_vit", size=base, width=width, depth=depth,
              patch_size=16, image_size=160,
              registers=0 if base == "test_vit" else 1, base=base,
              distilled=False, resample="timm", hybrid=False)


def _parse_vitamin_name(base: str) -> Optional[Dict[str, Any]]:
  m = _TIMM_VITAMIN_NAME.match(base)
  if m is None:
    return None
  width, depth = VITAMIN_SIZES[m.group("size")]
  return dict(family="vitamin", size=m.group("size"), width=width,
              depth=depth, patch_size=16, image_size=int(m.group("res")),
              registers=0, base=base, distilled=False, resample="timm",
              hybrid=False)


def _parse_hybrid_name(base: str) -> Optional[Dict[str, Any]]:
  m = _TIMM_HYBRID_NAME.match(base)
  if m is None:
    return None
  size = m.group("size")
  width, depth = TIMM_SIZES[size]
  patch = (4 * int(m.group("patch")) if m.group("patch")
           else int(m.group("stride")))
  return dict(family="vit", size=size, width=width, depth=depth,
              patch_size=patch, image_size=int(m.group("res")), registers=0,
              base=base, distilled=False, resample="timm", hybrid=True)


# timm models of the same classes that vit_jax does not compute (yet): the
# name is refused, saying what it is, rather than loaded as a lookalike.
TIMM_UNSUPPORTED = (
    (r"_sapiens2$", "Sapiens2 (timm's Eva with grouped-query attention "
                    "in its middle blocks: fewer key/value heads than "
                    "query heads there, a number per block (num_kv_heads), "
                    "where vit_jax's blocks share one configuration; and "
                    "LayerScale on the attention branch only)"),
    (r"^vit_\w+_(resnet\d+d|mci)_", "a CNN backbone other than BiT's "
                                   "ResNetV2 stem (the R50+ViT hybrids "
                                   "vit_*_r50_* / _r26_* / vit_tiny_r_* "
                                   "and ViTamin's vitamin_* load)"),
    (r"^samvit_base_patch16_224$", "SAM's ViT without its conv neck (a "
                                   "channel LayerNorm of epsilon 1e-6 after "
                                   "blocks of 1e-5; no released weights)"),
)


def unsupported_timm(name: str) -> Optional[str]:
  """The feature vit_jax lacks for timm's model ``name`` (a ``.tag``
  allowed), or None."""
  base = str(name).split(".", 1)[0]
  for pattern, what in TIMM_UNSUPPORTED:
    if re.search(pattern, base):
      return what
  return None


def refuse_unsupported_timm(name: str, error=ValueError) -> None:
  """Raises ``error`` for a timm name of a model vit_jax does not compute,
  naming the feature it lacks."""
  what = unsupported_timm(name)
  if what is not None:
    raise error(
        f"{name}: {what} is not supported by vit_jax. Supported timm "
        f"families: ViT / AugReg, DeiT (incl. distilled), DeiT-III, "
        f"DINOv2 (incl. giant), DINOv3, EVA-02 (T/S/B/L, CLIP B/L), "
        f"Perception Encoder, AIMv2, CLIP, SigLIP / SigLIP 2 (incl. "
        f"NaFlex), C-RADIO (incl. NaFlex), timm's NaFlexVit (incl. its "
        f"factorized position embedding, naflexvit_*_parfac_*), BEiT / BEiT "
        f"v2 / BEiT-3, SAM's image encoder (samvit_*), CaiT (cait_*), "
        f"timm's relative-position ViTs (vit_relpos_*, vit_srelpos_*), "
        f"FlexiViT (flexivit_*), EVA-01 (eva_giant_*, eva_large_*), timm's "
        f"test_vit / test_vit2 / test_vit3, "
        f"timm's SBB RoPE ViTs (vit_*_rope_reg*_gap_256), Naver's RoPE-ViT "
        f"(vit_*_patch16_rope[_mixed][_ape]_224), LingBot-Vision "
        f"(vit_*_patch16_lingbot), ViTamin (vitamin_*), "
        f"differential attention and parallel blocks (vit_dwee_*, "
        f"vit_dlittle_*, vit_pwee_*, vit_dpwee_*, vit_*_xp_*).")


# timm names whose weights load into another timm class than their tree
# alone says (the tree is also another class's): Naver's axial RoPE ViTs
# with a learned position embedding have DeiT-III's tree (class token,
# position rows of the patches only, LayerScale, q/k/v biases) and are Eva.
TIMM_CLASS_BY_NAME = (
    (r"_patch16_rope_ape_224$", "timm_eva"),
)


def timm_layout_for_name(name: str) -> Optional[str]:
  """The timm layout (class) of timm's model ``name`` where its tree does
  not show it (:data:`TIMM_CLASS_BY_NAME`), else None: the tree's
  (:func:`timm_layout_of`)."""
  base = str(name).split(".", 1)[0]
  for pattern, layout in TIMM_CLASS_BY_NAME:
    if re.search(pattern, base):
      return layout
  return None


SAM_NEEDS_A_NAME = (
    "These are the weights of timm's VisionTransformerSAM (Segment "
    "Anything's image encoder: a neck, rel-pos tables), whose window size, "
    "global blocks and LayerNorm epsilon the weights do not fully show. Pass "
    "the timm name, e.g. 'samvit_base_patch16' (in the CLIs: --model).")

NAFLEX_NEEDS_A_NAME = (
    "These are the weights of a timm NaFlexVit (embeds.*), whose resize of "
    "the position grid to each image (bilinear for SigLIP 2, bicubic for "
    "timm's own, RADIO's square crop) the weights do not store. Pass the "
    "timm name, e.g. 'naflexvit_base_patch16_siglip' or "
    "'naflexvit_base_patch16_radio_v3' (in the CLIs: --model).")

# Families whose RoPE variant and grid the keys cannot show: loading their
# weights without the name would silently drop the rotary embedding.
NEEDS_A_NAME = (
    "These are the weights of a timm Eva model (DINOv3, EVA-02, Perception "
    "Encoder, EVA-01, timm's SBB and Naver's RoPE ViTs, LingBot-Vision: "
    "LayerScale gamma_1, q_bias / v_bias or separate q_proj), whose rotary "
    "position embedding is not stored in the weights (nor that it has none: "
    "EVA-01). Pass the timm name, e.g. 'vit_small_patch16_dinov3', "
    "'eva02_tiny_patch14_224', 'vit_pe_core_tiny_patch16_384', "
    "'eva_giant_patch14_224', 'vit_medium_patch16_rope_reg1_gap_256' or "
    "'vit_small_patch16_rope_mixed_224' (in the CLIs: --model).")


def beit_pooling(keys) -> str:
  """timm's Beit pools by the mean of the patches exactly when it has an
  ``fc_norm`` (its ``use_fc_norm`` defaults to ``global_pool == 'avg'``),
  else by the class token: the classifier of a Beit state dict without a
  name."""
  return "gap" if "fc_norm.weight" in keys else "token"


def timm_hints(name: str) -> Dict[str, Any]:
  """The fields timm's model ``name`` decides that the keys cannot: ``act``
  (not for a gated MLP: its SiLU the keys show), ``layer_norm_eps``,
  ``num_heads`` (when not the width's), the RoPE variant and grid, the
  pooling of a class-token model."""
  parsed = parse_timm_name(name)
  if parsed is None:
    return {}
  out: Dict[str, Any] = {"layer_norm_eps": 1e-6}
  for pattern, fields in TIMM_FAMILIES:
    if re.search(pattern, parsed["base"]):
      out.update(fields)
  if out.get("rope") and re.search(_REF_IS_NATIVE, parsed["base"]):
    grid = parsed["image_size"] // parsed["patch_size"]
    out["rope_ref_grid"] = (grid, grid)
  return out


# timm's NaFlex evaluation pads every image to this many patches
# (create_naflex_loader's max_seq_len; 24 x 24 patches of 16).
NAFLEX_EVAL_SEQ_LEN = 576


def timm_preprocessing_cfg(name: str) -> Dict[str, Any]:
  """A timm-style pretrained_cfg for the family of ``name`` (input size,
  interpolation, crop_pct, mean, std; for a NaFlexVit the token budget
  ``max_seq_len``)."""
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
  out = dict(cfg, mean=mean, std=std, input_size=(3, size, size))
  if parsed.get("family") == "naflexvit":  # timm's NaFlex eval length
    out["max_seq_len"] = NAFLEX_EVAL_SEQ_LEN
  return out


_HF_ACTS = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_new": "gelu_tanh",
            "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
            "silu": "silu", "swish": "silu"}


# transformers' defaults per layout (their configs' defaults): act, epsilon.
_HF_DEFAULTS = {"transformers": ("gelu", 1e-12),
                "transformers_vit_mae": ("gelu", 1e-12),
                "transformers_ijepa": ("gelu", 1e-12),
                "transformers_dinov2": ("gelu", 1e-6),
                "transformers_dinov2_reg": ("gelu", 1e-6),
                "transformers_dinov3": ("gelu", 1e-5),
                "transformers_clip": ("quick_gelu", 1e-5),
                "transformers_siglip": ("gelu_pytorch_tanh", 1e-6),
                "transformers_siglip2": ("gelu_pytorch_tanh", 1e-6),
                "transformers_aimv2": ("silu", 1e-5),
                "transformers_beit": ("gelu", 1e-12),
                "transformers_data2vec_vision": ("gelu", 1e-12),
                "transformers_sam": ("gelu", 1e-6)}


def transformers_hints(config: Mapping[str, Any], layout: str) -> Dict[str, Any]:
  """The fields a Hugging Face ``config.json`` gives (a CLIP, SigLIP or
  AIMv2 config's ``vision_config``): activation, norm epsilon, heads; for
  DINOv3 its RoPE (``rope_theta``) and train-time coordinate augmentations
  (``pos_embed_shift`` / ``_jitter`` / ``_rescale``: only in training, as
  transformers); for DINOv2 with registers, that the position embedding
  covers the class token only."""
  config = config.get("vision_config") or config
  act, eps = _HF_DEFAULTS[layout]
  act = config.get("hidden_act", act)
  if act not in _HF_ACTS:
    raise ValueError(f"config.json hidden_act={act!r} is not supported; "
                     f"supported: {sorted(_HF_ACTS)}")
  eps_key = "rms_norm_eps" if layout == "transformers_aimv2" else "layer_norm_eps"
  out = dict(act=_HF_ACTS[act],
             layer_norm_eps=float(config.get(eps_key, eps)))
  if layout.startswith("transformers_dinov2") and config.get("use_swiglu_ffn"):
    out["act"] = "silu"  # the SwiGLU's gate, whatever hidden_act says
  if "num_attention_heads" in config:
    out["num_heads"] = int(config["num_attention_heads"])
  if config.get("pooler_act", "tanh") != "tanh":
    raise ValueError(f"config.json pooler_act={config['pooler_act']!r}: only "
                     f"the tanh pooler of ViTModel is supported")
  if layout == "transformers_dinov3":
    out.update(rope="dinov3",
               rope_temperature=float(config.get("rope_theta", 100.0)),
               abs_pos_embed=False)
    for key, field in (("pos_embed_shift", "rope_shift"),
                       ("pos_embed_jitter", "rope_jitter"),
                       ("pos_embed_rescale", "rope_rescale")):
      value = config.get(key, 2.0 if key == "pos_embed_rescale" else None)
      if value is not None:
        out[field] = float(value)
  if layout == "transformers_dinov2_reg":
    out["no_embed_registers"] = True
  if layout == "transformers_sam":  # SamVisionConfig's defaults
    out.update(window_size=int(config.get("window_size", 14)),
               global_attn_indexes=tuple(int(i) for i in config.get(
                   "global_attn_indexes", (2, 5, 8, 11))))
  if layout == "transformers_siglip2":  # its resize of the position table
    out["naflex"] = "bilinear_aa"
  if layout in ("transformers_beit", "transformers_data2vec_vision"):
    # The pooler: the mean of the patches (then its norm), or the class token.
    out["classifier"] = "gap" if config.get("use_mean_pooling", True) else "token"
  if layout == "transformers_aimv2":
    if config.get("is_native"):
      raise ValueError("config.json is_native=True: AIMv2's native-resolution "
                       "tower (a fixed 2-D sin-cos position embedding) is not "
                       "supported; the fixed-resolution towers are.")
    out["classifier"] = "gap"
  return out
