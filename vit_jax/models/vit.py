"""Vision Transformer (Dosovitskiy et al., 2021) as Flax linen modules.

The parameter tree is the one of google-research/vision_transformer's linen
``VisionTransformer``, so its checkpoints and torchvision's (through
:mod:`vit_jax.convert`) map onto the same names::

    embedding/{kernel,bias}                 patch embedding conv (P, P, 3, D)
    cls                                     class token (1, 1, D)
    Transformer/posembed_input/pos_embedding  (1, N + 1, D)
    Transformer/encoderblock_{i}/LayerNorm_0, MultiHeadDotProductAttention_0/
        {query,key,value,out}, LayerNorm_1, MlpBlock_0/{Dense_0,Dense_1}
    Transformer/encoder_norm
    pre_logits                              only with ``representation_size``
    head

With ``scan_layers=True`` the blocks live under ``Transformer/encoderblock``
with a leading layer axis; :func:`vit_jax.convert.unstack_layers` and
:func:`vit_jax.convert.stack_layers` move between the two layouts.

Usage::

    model = models.get_model("vit_b_16", num_classes=10)
    variables = model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)))
    logits = model.apply(variables, images, train=False)

Named intermediates are sown into the ``'intermediates'`` collection
(``stem``, ``block00`` ..., ``encoded``, ``pre_logits``, ``logits``)::

    logits, state = model.apply(variables, images, mutable=["intermediates"])

Dense features of chosen blocks, as timm's ``forward_intermediates``::

    final, grids = model.apply(variables, images,
                               method=model.forward_intermediates,
                               indices=4, norm=True)   # last 4: (B, h, w, D)

NaFlex (SigLIP 2, timm's ``NaFlexVit``): images of any aspect ratio in one
padded batch, each with the position grid resized to its own patch grid
and a padding mask in every attention (see :mod:`vit_jax.models.naflex`)::

    model = models.get_model(arch, naflex="bilinear_aa")
    logits = model.apply(variables, {"patches": p, "patch_coord": c,
                                     "patch_valid": v}, train=False)

Any resolution with one set of variables (the position embedding is
resampled in the forward pass, as timm's ``dynamic_img_size``; under
``jax.jit`` each new input shape compiles once)::

    model = models.get_model("vit_b_16", dynamic_img_size=True)
    logits = model.apply(variables, images_384x512)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import (Any, List, Literal, Mapping, Optional, Sequence, Tuple,
                    Union)

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vit_jax.models import cait as cait_lib, diffattn
from vit_jax.models import mbconv as mbconv_lib
from vit_jax.models import naflex as naflex_lib, resnet as resnet_lib
from vit_jax.models import relpos, rope as rope_lib, sam as sam_lib
from vit_jax.models.layers import (  # noqa: F401  (re-exported building blocks)
    LN_EPS, NORMS, AddPositionEmbs, BlockConfig, Dense, Encoder, Encoder1DBlock,
    LayerNorm, MAPHead, MlpBlock, MultiHeadDotProductAttention, PatchEmbed, RMSNorm,
    activation, norm_layer)

Array = Any
Dtype = Any

# How a parallel block projects its attention and MLP outputs (timm's
# ParallelScalingBlock: two projections; fuse_out_proj /
# DiffParallelScalingBlock: one).
PARALLEL = ("split", "fused")

__all__ = ["ConvStemConfig", "VisionTransformer", "feature_take_indices",
           "pair"]


@dataclasses.dataclass(frozen=True)
class ConvStemConfig:
  """One conv + BatchNorm + ReLU layer of torchvision's convolutional stem."""

  out_channels: int
  kernel_size: int
  stride: int


class VisionTransformer(nn.Module):
  """Vision Transformer: patches -> (prefix tokens) -> encoder -> pool -> head.

  The classic ViT (Dosovitskiy et al.; torchvision's, AugReg's) is the
  default; every other option adds parameters only when it is on, so the
  classic tree stays exactly google-research/vision_transformer's.

  Attributes:
    num_classes: outputs of the head; 0 or None for no head (features).
    patch_size: side of the square patches (conv kernel = stride).
    hidden_size, num_layers, num_heads, mlp_dim: the encoder's size.
    image_size: optional fixed input size (int or (H, W)). When ``None`` the
      position embedding takes its size from the input given to ``init``.
      With ``dynamic_img_size`` it is the resolution the position embedding
      is laid out for (needed only when that grid is not square).
    dynamic_img_size: run any input size divisible by the patch (square or
      not) with one set of variables: the position embedding is resampled
      to the input's patch grid inside the forward pass, as timm's
      ``dynamic_img_size=True`` does (antialiased bicubic; see
      :class:`~vit_jax.models.layers.AddPositionEmbs`). Under ``jax.jit`` every new
      input shape is traced and compiled once (then cached).
    dynamic_img_pad: zero-pad the input at the bottom and right to the next
      multiple of the patch size (timm's ``dynamic_img_pad``), so any size
      runs; the patch grid is ``ceil(size / patch)``.
    num_channels: channels of the input images (last axis).
    representation_size: width of an extra Dense + tanh ``pre_logits`` layer
      (ViT i21k checkpoints; Hugging Face's ``ViTModel`` pooler). Applied
      with or without a head: with ``num_classes=0`` the model returns it.
    classifier: how tokens become one vector. ``'token'``: the class token
      (classic ViT, DeiT-III, DINOv2, CLIP); ``'gap'``: mean of the patch
      tokens, no class token (big_vision ``gap``, timm ``global_pool='avg'``);
      ``'map'``: multihead attention pooling (big_vision's ``MAPHead``,
      timm's ``attn_pool``; SigLIP), no class token; ``'unpooled'``: all
      tokens, no head.
    num_registers: register tokens after the class token (Darcet et al.
      2024; DINOv2 with registers): parameter ``registers`` (1, R, D).
    layer_scale_init: LayerScale on both residual branches of every block,
      initialised to this value (CaiT; DeiT-III 1e-6, DINOv2 1e-5):
      parameters ``LayerScale_0/scale``, ``LayerScale_1/scale``.
    no_embed_class: the position embedding covers the patch tokens only; the
      class / register tokens are concatenated after it is added (timm's
      ``no_embed_class``: DeiT-III, DINOv2 with registers; big_vision's).
    pre_norm: a LayerNorm after the position embedding, before the blocks
      (CLIP's ``ln_pre``): ``Transformer/pre_norm``.
    fc_norm: a LayerNorm after pooling instead of the encoder's final one
      (timm's ``fc_norm``, e.g. with ``global_pool='avg'``): ``fc_norm``.
    patch_bias: the patch-embedding conv has a bias (CLIP's has none).
    qkv_bias: the query/key/value projections have biases.
    act: the MLP activation: ``'gelu'`` (exact erf: torchvision, timm,
      DINOv2, OpenCLIP), ``'quick_gelu'`` (OpenAI CLIP), ``'gelu_tanh'``
      (SigLIP, big_vision).
    layer_norm_eps: epsilon of every LayerNorm (1e-6; CLIP 1e-5; Hugging
      Face ViT 1e-12).
    dropout_rate, attention_dropout_rate: dropout probabilities.
    drop_path_rate: stochastic depth of the last block (linear from 0; of
      every block with ``drop_path_schedule='constant'``).
    dtype: compute dtype (e.g. ``jnp.bfloat16``); param_dtype: parameters'.
    conv_stem: torchvision's convolutional stem (``ConvStemConfig`` list)
      in place of the single patchify conv; its strides multiply to
      ``patch_size``.
    resnet: the ViT paper's hybrid (R50+ViT-B/16 ...): a ResNet stem
      (:class:`~vit_jax.models.resnet.ResNetConfig`: stage depths, width,
      and the weight standardisation's and GroupNorm's constants) before
      the patch embedding, which then convolves its feature map with
      kernel ``patch_size // resnet.stride``. ``patch_size`` stays the
      pixels per token (16 for R50+ViT-B/16: the stem's /16, 1x1 kernel).
      Parameters ``conv_root``, ``gn_root``, ``block{s}/unit{u}/...`` at
      the top of the tree, as Google's ``models_vit.VisionTransformer(
      resnet=...)`` has them (see :mod:`vit_jax.models.resnet`).
    mbconv: ViTamin's convolutional stem (timm's ``vitamin_*``:
      :class:`~vit_jax.models.mbconv.MbConvConfig`, the stem width and its
      two stages' widths and depths) in place of the patch embedding: a
      conv stem, two stages of inverted bottlenecks with channel
      LayerNorms, and a strided 3x3 convolution to ``hidden_size`` (timm's
      ``HybridEmbed`` without a projection); ``patch_size`` must be its
      reduction, 16. Parameters under ``mbconv_stem`` (no ``embedding``; see
      :mod:`vit_jax.models.mbconv`).
    scan_layers: run the blocks with ``nn.scan`` (stacked parameters:
      compile time independent of depth).
    remat_policy: rematerialise each block in the backward pass (``'full'``,
      ``'dots'``, ``'dots_no_batch'``, ``'nothing'``) to save memory.
    sow_attention_weights: sow every block's attention probabilities
      (``intermediates/.../attention_weights``, (B, heads, N, N)).
    attention_impl: ``None`` (default) lets
      :func:`vit_jax.models.kernels.choose_attention` pick per backend (the
      hand-written ``'matmul'`` kernels on CPU, cuDNN's fused attention on
      GPU in bfloat16/float16, XLA otherwise); ``'matmul'``, ``'xla'`` or
      ``'cudnn'`` force one. All compute the same function.

  The families of 2024-2026 (DINOv3, EVA-02, Perception Encoder, AIMv2,
  DINOv2 giant, distilled DeiT, RADIO) are points of the same option space;
  each option adds parameters only when it is on:

    class_token: a class token ``cls`` without pooling by it (None: exactly
      when ``classifier='token'``): DINOv3 and EVA-02 average the patches,
      Perception Encoder's MAP head attends to every token.
    distilled: DeiT's distillation token ``dist`` after the class token and
      a second head ``head_dist`` on it; the two heads' logits are averaged
      (timm's ``VisionTransformerDistilled``), or returned as a pair in
      training with ``distilled_training`` (timm's ``set_distilled_training``).
    no_embed_registers: the position embedding covers the class token but
      not the registers (transformers' ``Dinov2WithRegistersModel``).
    abs_pos_embed: a learned position embedding (``False``: DINOv3, whose
      positions are rotary only).
    final_norm: the encoder's final norm (``False``: RADIO, PE lang /
      spatial, whose ``forward_features`` are the last block's output).
    norm_type: ``'layer'`` (LayerNorm) or ``'rms'`` (RMSNorm, AIMv2) for
      every norm of the model.
    patch_norm: a norm after the patch embedding (AIMv2): ``embedding_norm``.
    key_bias: with ``qkv_bias``, whether the key has a bias (EVA / DINOv3:
      query and value biases only).
    proj_bias: biases of the attention's output projection and the MLP
      (``False``: AIMv2).
    qk_norm: a norm over each head's queries and keys.
    attn_norm: a norm of the attention's output before its projection
      (EVA-02 CLIP's ``scale_attn_inner``).
    gated_mlp: ``'packed'`` or ``'split'``: a gated MLP (SwiGLU with
      ``act='silu'``) whose hidden width is ``mlp_dim``; see
      :class:`~vit_jax.models.layers.MlpBlock`.
    mlp_norm: a norm over the MLP's hidden layer (EVA-02 B/L).
    mlp_input_norm: a norm over the MLP's input, after the block's own
      (ViTamin's ``GeGluMlp``: with ``gated_mlp='split'`` and
      ``act='gelu'``): ``MlpBlock_0/InputNorm``.
    post_norm: the blocks' norms close their residual branches instead of
      opening them, x + LN(attn(x)); x + LN(mlp(x)) (timm's
      ``ResPostBlock``: ``vit_base_patch16_rpn_224``); the same parameters.
    pool_include_prefix: ``'gap'`` / ``'map'`` pooling reads the prefix
      tokens too (timm's ``Eva`` feeds every token to its MAP head).
    map_heads, map_mlp_dim: the MAP head's heads and MLP width when they
      are not the encoder's (Perception Encoder: 8 heads).
    rope: rotary position embeddings of the patch tokens: ``'dinov3'``,
      ``'cat'`` (EVA-02 / PE, timm's SBB and Naver's axial RoPE ViTs) or
      ``'mixed'`` (Naver's RoPE-Mixed: learned frequencies, one set per
      block and head, the parameter ``Transformer/rope_freqs`` (2, depth,
      heads, head_dim / 2); ``rope_temperature`` only sets their initial
      values), with ``rope_temperature`` (default 100 / 1e4 / 10),
      ``rope_grid_offset``, ``rope_grid_indexing`` (``'ij'``: the first
      frequencies rotate by y; ``'xy'``: by x) and ``rope_ref_grid`` (EVA's
      rescale of positions onto the pretraining grid; neither these two
      nor an offset for 'mixed', whose positions are the patch indices);
      see :mod:`vit_jax.models.rope`. Any input size works.
    rope_shift, rope_jitter, rope_rescale: DINOv3's train-time coordinate
      augmentations (timm's ``rope_*_coords``; from the ``'dropout'`` rng).
    rel_pos_bias: a relative position bias added to the attention
      logits: BEiT's learned table of one bias per head for each offset
      between two patches (and three for a class token), or with
      ``rel_pos_mlp`` an MLP's: ``'block'``, one in every block's attention
      (timm's ``use_rel_pos_bias``: BEiT, BEiT v2, Data2Vec-Vision,
      ``vit_relpos_*``; ``MultiHeadDotProductAttention_0/rel_pos_bias/
      ...``), or ``'shared'``, one for all blocks (``use_shared_rel_pos_
      bias``, ``vit_srelpos_*``; ``Transformer/rel_pos_bias/...``). Named
      for where the bias lives, the one thing that tells the two apart
      (their function is the same). For the patches and at most one
      prefix token, the class token (timm's ``RelPosBias``: a table
      without the class rows where there is none). The table is laid out
      for the grid of ``image_size`` (else of the ``init`` input);
      ``dynamic_img_size`` resizes it to other grids in the forward pass
      as timm does when built at another size (see
      :mod:`vit_jax.models.relpos`). Attention with the bias runs through
      the paths that take one (XLA's, or the materialised probabilities
      for ``'matmul'``; cuDNN's is refused when requested).
    rel_pos_mlp: the bias from an MLP of the offsets' log-spaced
      coordinates instead of a table (timm's ``RelPosMlp``, Swin v2's
      continuous position bias): ``'cr'`` (timm's ``vit_relpos_*`` /
      ``vit_srelpos_*``) or ``'swin'`` (coordinates scaled by the grid,
      ``16 * sigmoid`` of the MLP); zero for the class token. Parameters
      ``rel_pos_bias/Dense_0`` and ``Dense_1`` (no bias in ``'swin'``);
      any grid gets its bias (no resize). Its hidden units are dropped at
      0.125 in training, as timm's.
    rel_pos_mlp_dim: the MLP's hidden width (timm's ``rel_pos_dim``; 128).
    naflex: NaFlex (SigLIP 2, timm's ``NaFlexVit``): the model also takes
      the dict of pre-cut patches timm's ``NaFlexVit`` takes (``patches``
      (B, N, P*P*C) in (y, x, channel) order, ``patch_coord`` (B, N, 2) as
      (row, column), ``patch_valid`` (B, N)): a batch of images of
      different shapes padded to one length. The position embedding is a
      learned ``naflex_grid`` grid (``Transformer/posembed_input/pos_grid``
      (1, H0, W0, D)) resized to each image's patch grid with this
      ``F.interpolate`` mode: ``'bilinear_aa'`` (SigLIP 2), ``'bicubic_aa'``
      (timm's default), ``'bilinear'`` (RADIO, with
      ``naflex_align_corners``); ``naflex_square``: to the square of the
      longer side, the top-left part kept (timm's ``pos_embed_ar_
      preserving``, RADIO). The prefix tokens get no position; padding is
      masked out of every attention and of the pooling. NHWC images work
      too (one grid for the batch, no mask). See :mod:`vit_jax.models.naflex`.
    naflex_factorized: a factorized position embedding instead of the grid
      (timm's ``pos_embed='factorized'``: ``naflexvit_*_parfac_*``):
      learned rows ``posembed_input/pos_y`` (1, H0, D) and columns
      ``pos_x`` (1, W0, D) of the ``naflex_grid`` size, each resized to the
      image's grid by linear interpolation (``naflex='bilinear'``; with
      ``naflex_square`` both to its longer side, the first kept), and
      patch (y, x) gets row y plus column x.

  Segment Anything's image encoder (timm's ``samvit_*``; ViTDet), whose
  options attend over the patch grid (no prefix tokens; see
  :mod:`vit_jax.models.sam`):

    window_size: attention within non-overlapping windows of this many
      patches a side (the grid zero-padded to a multiple), in every block
      but those of ``global_attn_indexes`` (0: global everywhere).
    global_attn_indexes: the blocks (0-based) that attend globally.
    rel_pos: decomposed relative positions added to every attention's
      logits: parameters ``rel_pos_h`` / ``rel_pos_w`` (2 * S - 1, head
      width) in each attention, S the window or the patch grid
      ``image_size`` gives (else the input's at ``init``).
    neck_chans: SAM's neck to this many channels after the blocks
      (``neck/{Conv_0, LayerNorm_0, Conv_1, LayerNorm_1}``):
      :meth:`forward_features` returns its (B, h, w, C) map, which the head
      pools by its mean.

  CaiT (timm's ``cait_*``; see :mod:`vit_jax.models.cait`):

    talking_heads: talking-heads attention in the blocks: the logits mixed
      across heads before the softmax and the probabilities after it, by
      learned (heads, heads) maps with biases (``proj_l`` / ``proj_w`` in
      each block's attention). Runs as XLA ops with the probabilities
      materialised (``attention_impl='cudnn'`` is refused).
    class_attn_layers: the class token stays out of the blocks (which see
      the patches only; ``no_embed_class=True``) and is updated after them
      by this many class-attention blocks (``Transformer/classblock_{i}``:
      its query attends to [class token, patches], then an MLP, LayerScale
      on both; the blocks' MLP width; no dropout nor stochastic depth), then
      joins the patches for the final norm. :meth:`forward_intermediates`'
      block outputs are patch tokens only, as timm's.
    drop_path_schedule: how ``drop_path_rate`` is spread over the blocks:
      ``'linear'`` (from 0 at the first block to the rate at the last) or
      ``'constant'`` (every block at the rate: CaiT's). Part of the
      architecture record (timm's CaiT fixes it).

  timm's small SBB ViTs (``vit_dwee_*``, ``vit_dlittle_*``, ``vit_pwee_*``,
  ``vit_dpwee_*``), ViT-22B's parallel blocks (``vit_*_xp_*``):

    diff_attn: differential attention in the blocks (timm's
      ``attn_layer='diff'``, ``DiffAttention``): each head's queries and
      keys are two half-width heads whose softmax maps are subtracted, the
      second scaled by a learned lambda, before the values; the heads'
      outputs through an RMSNorm (``sub_norm``, epsilon 1e-5) scaled by
      ``1 - lambda_init`` (``0.8 - 0.6 exp(-0.3 depth)``, the block's
      index). ``'qk'``: lambda from four learned vectors (the paper's;
      ``lambda_q1``, ``lambda_k1``, ``lambda_q2``, ``lambda_k2`` of half a
      head), ``'dual'``: from two learned scalars (timm's ``dual_lambda``;
      ``lambda_a``, ``lambda_b``), in each block's attention with
      ``sub_norm/scale``. Runs as XLA ops with the maps materialised
      (``attention_impl='cudnn'`` is refused). See
      :mod:`vit_jax.models.diffattn`.
    parallel: the attention and the MLP side by side in one residual
      branch from one norm, x + LS(MHSA(LN(x)) + MLP(LN(x))) (timm's
      ``ParallelScalingBlock``, ViT-22B's; its fused ``in_proj`` is our
      query / key / value and ``MlpBlock_0/Dense_0``): no ``LayerNorm_1``,
      one LayerScale (``LayerScale_0``). ``'split'``: the attention's and
      the MLP's output projections each with a bias (timm's
      ``attn_out_proj`` / ``mlp_out_proj``); ``'fused'``: one projection
      of both (timm's ``out_proj``; ``DiffParallelScalingBlock``) whose
      one bias is the attention's ``out`` (``MlpBlock_0/Dense_1`` has
      none).

  ``image_size`` not a multiple of the patch (SigLIP so400m/14 at 384): the
  patch convolution leaves the last pixels out, as timm's and torchvision's
  do; only inputs of exactly that size are accepted.
  """

  patch_size: int = 16
  hidden_size: int = 768
  num_layers: int = 12
  num_heads: int = 12
  mlp_dim: int = 3072
  num_classes: Optional[int] = 1000
  image_size: Optional[Any] = None
  num_channels: int = 3
  representation_size: Optional[int] = None
  classifier: Literal["token", "gap", "map", "unpooled"] = "token"
  num_registers: int = 0
  layer_scale_init: Optional[float] = None
  no_embed_class: bool = False
  pre_norm: bool = False
  fc_norm: bool = False
  patch_bias: bool = True
  qkv_bias: bool = True
  act: str = "gelu"
  layer_norm_eps: float = LN_EPS
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  drop_path_rate: float = 0.0
  head_bias_init: float = 0.0
  dtype: Dtype = jnp.float32
  param_dtype: Dtype = jnp.float32
  conv_stem: Optional[Sequence[ConvStemConfig]] = None
  resnet: Optional[resnet_lib.ResNetConfig] = None
  mbconv: Optional[mbconv_lib.MbConvConfig] = None
  scan_layers: bool = False
  remat_policy: Optional[str] = None
  sow_attention_weights: bool = False
  attention_impl: Optional[str] = None
  dynamic_img_size: bool = False
  dynamic_img_pad: bool = False
  # The newer families (see the class docstring).
  class_token: Optional[bool] = None
  distilled: bool = False
  no_embed_registers: bool = False
  abs_pos_embed: bool = True
  final_norm: bool = True
  norm_type: str = "layer"
  patch_norm: bool = False
  key_bias: bool = True
  proj_bias: bool = True
  qk_norm: bool = False
  attn_norm: bool = False
  gated_mlp: Optional[str] = None
  mlp_norm: bool = False
  mlp_input_norm: bool = False
  post_norm: bool = False
  pool_include_prefix: bool = False
  map_heads: Optional[int] = None
  map_mlp_dim: Optional[int] = None
  rope: Optional[str] = None
  rope_temperature: Optional[float] = None
  rope_grid_offset: float = 0.0
  rope_grid_indexing: str = "ij"
  rope_ref_grid: Optional[Tuple[int, int]] = None
  rope_shift: Optional[float] = None
  rope_jitter: Optional[float] = None
  rope_rescale: Optional[float] = None
  rel_pos_bias: Optional[str] = None
  rel_pos_mlp: Optional[str] = None
  rel_pos_mlp_dim: int = 128
  distilled_training: bool = False
  naflex: Optional[str] = None
  naflex_square: bool = False
  naflex_align_corners: bool = False
  naflex_grid: Tuple[int, int] = (16, 16)
  naflex_factorized: bool = False
  window_size: int = 0
  global_attn_indexes: Tuple[int, ...] = ()
  rel_pos: bool = False
  neck_chans: Optional[int] = None
  talking_heads: bool = False
  class_attn_layers: int = 0
  drop_path_schedule: str = "linear"
  diff_attn: Optional[str] = None
  parallel: Optional[str] = None

  @property
  def has_class_token(self) -> bool:
    return (self.classifier == "token" if self.class_token is None
            else bool(self.class_token))

  @property
  def num_prefix_tokens(self) -> int:
    """Class token (if any), distillation token, registers: the tokens
    before the patches, in that order."""
    return (int(self.has_class_token) + int(self.distilled) +
            int(self.num_registers))

  # ----------------------------------------------------------------- checks
  def _check_config(self):
    if self.classifier not in ("token", "gap", "map", "unpooled"):
      raise ValueError(f"classifier={self.classifier!r}: expected 'token', "
                       f"'gap', 'map' or 'unpooled'")
    if self.hidden_size % self.num_heads:
      raise ValueError(f"hidden_size={self.hidden_size} is not divisible by "
                       f"num_heads={self.num_heads}")
    activation(self.act)  # a clear error for an unknown name
    if self.classifier == "token" and self.class_token is False:
      raise ValueError("classifier='token' pools by the class token: it "
                       "needs class_token=True (or None)")
    if self.distilled and (self.classifier != "token" or
                           not self.has_class_token):
      raise ValueError("distilled=True (DeiT's distillation head) reads the "
                       "class and distillation tokens: it needs "
                       "classifier='token'")
    if self.norm_type not in NORMS:
      raise ValueError(f"norm_type={self.norm_type!r}: expected one of "
                       f"{NORMS}")
    if self.gated_mlp not in (None, "packed", "split"):
      raise ValueError(f"gated_mlp={self.gated_mlp!r}: expected None, "
                       f"'packed' (one Dense of the gate and value halves) "
                       f"or 'split' (Gate_0 and Dense_0)")
    if self.rope is not None:
      rope_lib.check(self.rope, self.hidden_size // self.num_heads,
                     self.rope_grid_indexing)
    if self.rope == "mixed" and (self.rope_grid_offset or
                                 self.rope_ref_grid is not None):
      raise ValueError("rope='mixed' rotates by the patch indices (timm's "
                       "RotaryEmbeddingMixed): rope_grid_offset and "
                       "rope_ref_grid do not apply")
    if self.rel_pos_mlp is not None and self.rel_pos_bias is None:
      raise ValueError(
          f"rel_pos_mlp={self.rel_pos_mlp!r}: the MLP gives a relative "
          f"position bias; say where it lives with rel_pos_bias='block' or "
          f"'shared'")
    if self.rel_pos_bias is not None:
      relpos.check(self.rel_pos_bias, self.rel_pos_mlp)
      if self.num_prefix_tokens != int(self.has_class_token):
        raise ValueError(
            "rel_pos_bias: a relative position bias is for the patches and "
            "at most one class token before them (a table's rows, timm's "
            "zero bias of the MLP): no registers or distillation token")
      if self.naflex is not None:
        raise ValueError("rel_pos_bias: a NaFlex model (images of different "
                         "grids in one batch) has no one relative position "
                         "table; BEiT's is laid out for one patch grid")
    if self.no_embed_registers and (self.no_embed_class or
                                    not self.num_registers):
      raise ValueError("no_embed_registers: the position embedding covers "
                       "the class token but not the registers; it needs "
                       "registers and no_embed_class=False")
    naflex_lib.check_kind(self.naflex, self.naflex_square,
                          self.naflex_align_corners, self.naflex_factorized)
    if self.naflex is not None:
      if self.conv_stem or not self.abs_pos_embed:
        raise ValueError("naflex: a NaFlex model has a single patchify "
                         "layer and a learned position grid (no conv_stem, "
                         "abs_pos_embed=True)")
    if self.resnet is not None:
      self._check_resnet()
    if self.mbconv is not None:
      self._check_mbconv()
    sam_lib.check(self)
    cait_lib.check(self)
    diffattn.check(self)
    if self.parallel is not None:
      self._check_parallel()
    if self.conv_stem:
      stride = int(np.prod([c.stride for c in self.conv_stem]))
      if stride != self.patch_size:
        raise ValueError(
            f"conv_stem strides multiply to {stride}, but patch_size is "
            f"{self.patch_size}: they must be equal")

  def _check_parallel(self):
    if self.parallel not in PARALLEL:
      raise ValueError(f"parallel={self.parallel!r}: expected None, 'split' "
                       f"(the attention's and the MLP's own output "
                       f"projections) or 'fused' (one projection of both, "
                       f"one bias)")
    clash = [k for k, on in (
        ("post_norm", self.post_norm),
        ("proj_bias=False (timm's parallel blocks have output biases)",
         not self.proj_bias),
        ("SAM's windows or relative positions",
         bool(self.window_size) or self.rel_pos),
        ("class_attn_layers", bool(self.class_attn_layers)),
    ) if on]
    if clash:
      raise ValueError(f"parallel (the attention and the MLP side by side) "
                       f"cannot be combined with {', '.join(clash)}")

  def _check_resnet(self):
    if not isinstance(self.resnet, resnet_lib.ResNetConfig):
      raise TypeError(f"resnet: expected a vit_jax.models.resnet.ResNetConfig "
                      f"(get_model also takes its dict or a tuple of stage "
                      f"depths), got {type(self.resnet).__name__}")
    clash = [k for k, on in (("conv_stem", self.conv_stem),
                             ("naflex", self.naflex is not None),
                             ("dynamic_img_pad", self.dynamic_img_pad)) if on]
    if clash:
      raise ValueError(f"resnet: a ResNet stem cannot be combined with "
                       f"{', '.join(clash)}")
    stride = self.resnet.stride
    if self.patch_size % stride:
      raise ValueError(
          f"resnet: the stem reduces by {stride}, which does not divide "
          f"patch_size={self.patch_size} (the pixels per token: the stem's "
          f"reduction times the patch embedding's kernel)")

  def _check_mbconv(self):
    mbconv_lib.check(self.mbconv, self.patch_size)
    clash = [k for k, on in (("conv_stem", self.conv_stem),
                             ("resnet", self.resnet is not None),
                             ("naflex", self.naflex is not None),
                             ("dynamic_img_pad", self.dynamic_img_pad),
                             ("patch_bias=False", not self.patch_bias))
             if on]
    if clash:
      raise ValueError(f"mbconv: ViTamin's stem cannot be combined with "
                       f"{', '.join(clash)}")

  def _check_images(self, images):
    shape = tuple(getattr(images, "shape", ()))
    c = self.num_channels
    if len(shape) != 4:
      raise ValueError(
          f"Expected images of shape (batch, height, width, {c}) (NHWC), got "
          f"shape {shape}.")
    if shape[-1] != c:
      hint = (" It looks like NCHW (channels first, PyTorch's layout); "
              "transpose it with images.transpose(0, 2, 3, 1)."
              if shape[1] == c else "")
      raise ValueError(
          f"Expected {c} channels in the last axis of NHWC images (batch, "
          f"height, width, {c}), got shape {shape}.{hint}")
    h, w = shape[1], shape[2]
    p = self.patch_size
    if (self.image_size is not None and not self.dynamic_img_size and
        self.naflex is None):
      want = pair(self.image_size)
      if (h, w) != want:
        raise ValueError(
            f"This model was built for {want[0]}x{want[1]} images, got "
            f"{h}x{w}. Resample the position embedding "
            f"(vit_jax.convert.resize_posemb) and set image_size to use "
            f"another resolution, or build the model with "
            f"dynamic_img_size=True.")
    built_for = (self.image_size is not None and
                 pair(self.image_size) == (h, w))
    if (h % p or w % p) and not self.dynamic_img_pad and not built_for:
      raise ValueError(
          f"Image size {h}x{w} is not divisible by the patch size {p}: "
          f"expected height and width that are multiples of {p} (e.g. "
          f"{max(p, h // p * p)}x{max(p, w // p * p)}), or a model with "
          f"dynamic_img_pad=True. (A released model at such a size, as "
          f"SigLIP so400m/14 at 384, is built with that image_size: its "
          f"convolution leaves the remainder out, as timm's does.)")
    if not jnp.issubdtype(images.dtype, jnp.floating):
      raise ValueError(
          f"Expected float images (normalised), got dtype {images.dtype}.")

  # ----------------------------------------------------------------- layers
  def setup(self):
    self._check_config()
    norm = norm_layer(self.norm_type, self.layer_norm_eps, self.dtype,
                      self.param_dtype)
    if self.conv_stem:
      self.stem_convs = [
          nn.Conv(c.out_channels, (c.kernel_size,) * 2, (c.stride,) * 2,
                  padding=[((c.kernel_size - 1) // 2,) * 2] * 2, use_bias=False,
                  dtype=self.dtype, param_dtype=self.param_dtype)
          for c in self.conv_stem]
      self.stem_bns = [
          nn.BatchNorm(momentum=0.9, epsilon=1e-5, dtype=self.dtype,
                       param_dtype=self.param_dtype)
          for _ in self.conv_stem]
      kernel = (1, 1)
    elif self.resnet is not None:
      # Google's parameter names at the top of our tree: the stem shares
      # the ViT's scope.
      self.resnet_stem = resnet_lib.ResNetStem(
          config=self.resnet, dtype=self.dtype, param_dtype=self.param_dtype)
      nn.share_scope(self, self.resnet_stem)
      kernel = (self.patch_size // self.resnet.stride,) * 2
    else:
      kernel = (self.patch_size, self.patch_size)
    if self.mbconv is not None:  # ViTamin: the stem ends at the width
      self.mbconv_stem = mbconv_lib.MbConvStem(
          config=self.mbconv, features=self.hidden_size, dtype=self.dtype,
          param_dtype=self.param_dtype)
    else:  # the patchify convolution (1x1 after a stem), as one GEMM
      self.embedding = PatchEmbed(
          self.hidden_size, kernel[0], use_bias=self.patch_bias,
          dtype=self.dtype, param_dtype=self.param_dtype)
    if self.patch_norm:  # AIMv2: a norm of the patch embeddings
      self.embedding_norm = norm(name="embedding_norm")
    d = self.hidden_size
    if self.has_class_token:
      self.cls = self.param("cls", nn.initializers.zeros, (1, 1, d),
                            self.param_dtype)
    if self.distilled:
      self.dist = self.param("dist", nn.initializers.normal(stddev=0.02),
                             (1, 1, d), self.param_dtype)
    if self.num_registers:
      self.registers = self.param(
          "registers", nn.initializers.normal(stddev=1e-6),
          (1, self.num_registers, d), self.param_dtype)
    if self.classifier == "map":
      self.MAPHead_0 = MAPHead(BlockConfig(  # pylint: disable=invalid-name
          num_heads=self.map_heads or self.num_heads,
          mlp_dim=self.map_mlp_dim or self.mlp_dim, dtype=self.dtype,
          param_dtype=self.param_dtype, layer_norm_eps=self.layer_norm_eps,
          act=self.act, attention_impl=self.attention_impl))
    if self.fc_norm and self.classifier != "unpooled":
      self.fc_norm_layer = norm(name="fc_norm")
    if self.representation_size and self.classifier != "unpooled":
      # A Dense layer's {kernel, bias} declared as one parameter, so that
      # the 'pre_logits' intermediate can be sown under the same name.
      r = self.representation_size
      self.pre_logits_params = self.param(
          "pre_logits", lambda key: {
              "kernel": nn.initializers.lecun_normal()(key, (d, r),
                                                       self.param_dtype),
              "bias": jnp.zeros((r,), self.param_dtype)})
    if self.neck_chans:  # SAM's neck
      self.neck = sam_lib.Neck(self.neck_chans, dtype=self.dtype,
                               param_dtype=self.param_dtype)
    if self.num_classes and self.classifier != "unpooled":
      head = functools.partial(
          nn.Dense, self.num_classes, dtype=self.dtype,
          param_dtype=self.param_dtype, kernel_init=nn.initializers.zeros,
          bias_init=nn.initializers.constant(self.head_bias_init))
      self.head = head()
      if self.distilled:
        self.head_dist = head()

    augment = tuple((k, getattr(self, f"rope_{k}")) for k in
                    ("shift", "jitter", "rescale")
                    if getattr(self, f"rope_{k}") is not None)
    # The encoder's fields are the model's of the same names, but for these;
    # what the blocks share is one record (BlockConfig), built once.
    own = dict(
        block=BlockConfig.of(self),
        final_norm=self.final_norm and not self.fc_norm,
        base_grid=self.base_grid,
        no_embed_registers=(self.num_registers if self.no_embed_registers
                            else 0),
        rope_ref_grid=(None if self.rope_ref_grid is None
                       else pair(self.rope_ref_grid)),
        rope_augment=augment or None, naflex_grid=pair(self.naflex_grid))
    # Attribute name = submodule name, as in vision_transformer's tree.
    self.Transformer = Encoder(  # pylint: disable=invalid-name
        **{name: own[name] if name in own else getattr(self, name)
           for name in _ENCODER_FIELDS})

  @property
  def base_grid(self) -> Optional[Tuple[int, int]]:
    """The patch grid of ``image_size`` (None when it is not set)."""
    if self.image_size is None:
      return None
    h, w = pair(self.image_size)
    return h // self.patch_size, w // self.patch_size  # timm's grid_size

  def _prefix(self, n, c, dtype):
    prefix = []
    if self.has_class_token:
      prefix.append(jnp.broadcast_to(self.cls.astype(dtype), (n, 1, c)))
    if self.distilled:
      prefix.append(jnp.broadcast_to(self.dist.astype(dtype), (n, 1, c)))
    if self.num_registers:
      prefix.append(jnp.broadcast_to(self.registers.astype(dtype),
                                     (n, self.num_registers, c)))
    return jnp.concatenate(prefix, axis=1) if prefix else None

  def _embed_naflex(self, inputs):
    """A NaFlex dict -> (patch tokens (B, N, D), prefix tokens, coord,
    valid)."""
    if self.naflex is None:
      raise ValueError(
          "This model takes NHWC images: a NaFlex dict (patches, "
          "patch_coord, patch_valid) needs a NaFlex model, built with "
          "naflex='bilinear_aa' (SigLIP 2) or loaded from timm's "
          "naflexvit_* / transformers' Siglip2VisionModel weights.")
    if self.rope is not None:
      raise ValueError("NaFlex dict inputs with rotary position embeddings "
                       "are not supported; pass NHWC images.")
    patches, coord, valid = naflex_lib.unpack(inputs, self.patch_size,
                                              self.num_channels)
    x = self.embedding(patches, patches=True)
    if self.patch_norm:
      x = self.embedding_norm(x)
    self.sow("intermediates", "stem", x)
    return x, self._prefix(x.shape[0], x.shape[-1], x.dtype), coord, valid

  def _encode(self, inputs, train: bool, **kw):
    """Inputs -> (encoded tokens, block outputs, patch grid or None, valid
    mask or None) through :meth:`embed` and the encoder."""
    if naflex_lib.is_naflex_input(inputs):
      x, prefix, coord, valid = self._embed_naflex(inputs)
      encoded, blocks = self.Transformer(x, prefix=prefix, grid=None,
                                         train=train, coord=coord,
                                         valid=valid, **kw)
      return encoded, blocks, None, valid
    x, prefix, grid = self.embed(inputs, train=train)
    encoded, blocks = self.Transformer(x, prefix=prefix, grid=grid,
                                       train=train, **kw)
    return encoded, blocks, grid, None

  def embed(self, images, *, train: bool = False):
    """Images (B, H, W, C) -> (patch tokens (B, N, D), prefix tokens
    (B, P, D) or None: class token, distillation token, registers; (h, w)
    patch grid)."""
    self._check_images(images)
    x = images
    if self.dynamic_img_pad:  # bottom / right to a multiple of the patch
      p = self.patch_size
      pad_h, pad_w = -x.shape[1] % p, -x.shape[2] % p
      if pad_h or pad_w:
        x = jnp.pad(x, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)))
    if self.conv_stem:
      for conv, bn in zip(self.stem_convs, self.stem_bns):
        x = nn.relu(bn(conv(x), use_running_average=not train))
    if self.resnet is not None:
      x = self.resnet_stem(x)
    if self.mbconv is not None:
      x = self.mbconv_stem(x)
    else:
      x = self.embedding(x)
    if self.patch_norm:
      x = self.embedding_norm(x)
    self.sow("intermediates", "stem", x)
    n, h, w, c = x.shape
    x = jnp.reshape(x, (n, h * w, c))
    return x, self._prefix(n, c, x.dtype), (h, w)

  def forward_features(self, images, *, train: bool = False):
    """Images -> all tokens (B, prefix + N, D): class token, registers, then
    patches, after the final LayerNorm (timm's ``forward_features``).

    A NaFlex dict -> ``{'patches': (B, prefix + N, D), 'patch_valid':
    (B, N)}`` as timm's: every token, the padding's included (whatever the
    padding computes; it never changes the valid tokens), and the mask.
    With SAM's neck (``neck_chans``): the neck's (B, h, w, C) map (timm's
    NCHW map, transposed). :meth:`forward_head` takes any of them."""
    encoded, blocks, grid, valid = self._encode(images, train)
    for i, y in enumerate(blocks):
      self.sow("intermediates", f"block{i:02d}", y)
    self.sow("intermediates", "encoded", encoded)
    if valid is not None:
      return {"patches": encoded, "patch_valid": valid}
    if self.neck_chans:  # SAM: the neck's (B, h, w, C) map
      return self._neck_map(encoded, grid)
    return encoded

  def _neck_map(self, tokens, grid):
    """Patch tokens (B, h*w, D) -> SAM's neck's (B, h, w, C) map."""
    return self.neck(tokens.reshape(tokens.shape[0], *grid, tokens.shape[-1]))

  def forward_intermediates(
      self, images, *, indices: Union[None, int, Sequence[int]] = None,
      norm: bool = False, output_fmt: str = "NHWC",
      return_prefix_tokens: bool = False, intermediates_only: bool = False,
      train: bool = False):
    """Chosen blocks' outputs as dense features (timm's
    ``forward_intermediates``, with its argument semantics).

    Args:
      images: (B, H, W, C) float images.
      indices: ``None``: every block; an int ``n``: the last ``n`` blocks; a
        sequence: those blocks (0-based; negative counts from the end).
        Returned in block order. Python ints (static under ``jit``).
      norm: pass each intermediate through the final LayerNorm (none for
        an ``fc_norm`` model, as timm).
      output_fmt: ``'NHWC'``: patch tokens as (B, h, w, D) grids;
        ``'NLC'``: as (B, h*w, D) sequences; ``'NCHW'``: timm's layout.
      return_prefix_tokens: each intermediate becomes a pair (patch
        tokens, prefix tokens (B, P, D): class token, then registers).
      intermediates_only: return the list of intermediates only.
      train: dropout / drop-path on (needs a ``'dropout'`` rng).

    Returns:
      ``(final features, intermediates)``: the final features are
      :meth:`forward_features`'s (B, prefix + N, D) tokens; or the list of
      intermediates only. Works with ``scan_layers=True`` and with
      ``dynamic_img_size`` (the grid is the input's). A hybrid's (``resnet``)
      intermediates are its transformer blocks' too, as timm's hybrid
      ``forward_intermediates``: the ResNet stem's stages are not among
      them (their output is the ``'stem'`` intermediate's input; the
      patch embedding of it is sown as ``'stem'``). A NaFlex dict (whose
      images have grids of their own: ``output_fmt='NLC'`` only, as timm)
      gives :meth:`forward_features`' dict (the padded tokens and
      ``patch_valid``, which also marks the intermediates' padding). A
      CaiT's (``class_attn_layers``) are its blocks' patch tokens, as
      timm's (the class token joins them after the blocks).
    """
    if output_fmt not in ("NHWC", "NLC", "NCHW"):
      raise ValueError(f"output_fmt={output_fmt!r}: expected 'NHWC', 'NLC' "
                       f"or 'NCHW'")
    if naflex_lib.is_naflex_input(images) and output_fmt != "NLC":
      raise ValueError(
          f"output_fmt={output_fmt!r}: a NaFlex batch's images have patch "
          f"grids of their own, so there is no one spatial layout; use "
          f"output_fmt='NLC' (patch_valid marks the padding; patch_coord "
          f"places each token).")
    if return_prefix_tokens and self.class_attn_layers:
      raise ValueError(
          "return_prefix_tokens: a CaiT's blocks (class_attn_layers) see the "
          "patch tokens only; its class token joins them after the blocks, "
          "so no intermediate has prefix tokens (as timm's Cait).")
    take = feature_take_indices(self.num_layers, indices)
    encoded, blocks, grid, valid = self._encode(images, train, take=take,
                                                norm_taken=norm)
    if valid is not None:
      encoded = {"patches": encoded, "patch_valid": valid}
    elif self.neck_chans:  # SAM: the final features are the neck's map
      encoded = self._neck_map(encoded, grid)
    # CaiT's blocks see the patches only (the class token joins after them).
    p = 0 if self.class_attn_layers else self.num_prefix_tokens
    out: List[Any] = []
    for y in blocks:
      tokens = y[:, p:]
      if norm and self.neck_chans:  # timm: SAM's neck is its norm
        tokens = self._neck_map(tokens, grid).reshape(
            y.shape[0], -1, self.neck_chans)
      if output_fmt != "NLC":
        tokens = tokens.reshape(y.shape[0], *grid, tokens.shape[-1])
        if output_fmt == "NCHW":
          tokens = tokens.transpose(0, 3, 1, 2)
      out.append((tokens, y[:, :p]) if return_prefix_tokens and p else tokens)
    if intermediates_only:
      return out
    return encoded, out

  def pool(self, encoded, valid=None):
    """Tokens (B, T, D) -> (B, D) by the ``classifier`` (then ``fc_norm``).
    ``valid`` (B, N): a NaFlex batch's patch mask, whose padding the mean
    and the MAP head leave out (the prefix tokens are valid)."""
    p = 0 if self.pool_include_prefix else self.num_prefix_tokens
    if valid is not None and self.pool_include_prefix:
      valid = naflex_lib.key_mask(valid, self.num_prefix_tokens)
    if self.classifier == "token":
      x = encoded[:, 0]
    elif self.classifier == "gap":
      x = (jnp.mean(encoded[:, p:], axis=1) if valid is None else
           naflex_lib.masked_mean(encoded[:, p:], valid))
    elif self.classifier == "map":
      tokens = encoded[:, p:] if p else encoded
      x = (self.MAPHead_0(tokens) if valid is None else
           self.MAPHead_0(tokens, valid))
    else:
      return encoded
    if self.fc_norm:
      x = self.fc_norm_layer(x)
    return x

  def forward_head(self, encoded, *, pre_logits: bool = False,
                   train: bool = False):
    """Encoded tokens -> pooled -> (pre_logits) -> logits. A distilled
    model (DeiT) averages its two heads, or returns both ``(logits,
    dist_logits)`` in training with ``distilled_training``, as timm.
    ``encoded`` may be :meth:`forward_features`' NaFlex dict (its padding
    is left out of the pooling)."""
    valid = None
    if naflex_lib.is_naflex_input(encoded):
      encoded, valid = encoded["patches"], encoded["patch_valid"]
    if self.classifier == "unpooled":
      return encoded
    if encoded.ndim == 4:  # SAM's neck's (B, h, w, C) map
      encoded = encoded.reshape(encoded.shape[0], -1, encoded.shape[-1])
    if self.distilled:
      return self._distilled_head(encoded, pre_logits, train)
    x = self.pool(encoded, valid)
    if self.representation_size:
      p = self.pre_logits_params
      x, kernel, bias = nn.dtypes.promote_dtype(x, p["kernel"], p["bias"],
                                                dtype=self.dtype)
      x = jnp.tanh(x @ kernel + bias)
    self.sow("intermediates", "pre_logits", x)
    if pre_logits or not self.num_classes:
      return x
    logits = self.head(x)
    self.sow("intermediates", "logits", logits)
    return logits

  def _distilled_head(self, encoded, pre_logits: bool, train: bool):
    x, x_dist = encoded[:, 0], encoded[:, 1]
    if pre_logits or not self.num_classes:
      x = (x + x_dist) / 2
      self.sow("intermediates", "pre_logits", x)
      return x
    logits, dist_logits = self.head(x), self.head_dist(x_dist)
    if self.distilled_training and train:
      return logits, dist_logits
    logits = (logits + dist_logits) / 2
    self.sow("intermediates", "logits", logits)
    return logits

  def __call__(self, images, *, train: bool = False):
    """NHWC images (B, H, W, C), or (a NaFlex model) timm's NaFlex dict ->
    logits (or the pooled features without a head)."""
    return self.forward_head(self.forward_features(images, train=train),
                             train=train)


# Encoder's fields (each one of VisionTransformer's, or set in its setup).
_ENCODER_FIELDS = tuple(f.name for f in dataclasses.fields(Encoder)
                        if f.name not in ("parent", "name"))


def feature_take_indices(num_blocks: int,
                         indices: Union[None, int, Sequence[int]] = None
                         ) -> List[int]:
  """timm's ``feature_take_indices``: ``None`` -> every block, an int
  ``n`` -> the last ``n``, a sequence -> those (negative from the end);
  returned sorted and unique (the order the blocks produce them)."""
  if indices is None:
    indices = num_blocks
  if isinstance(indices, (int, np.integer)):
    n = int(indices)
    if not 0 < n <= num_blocks:
      raise ValueError(f"indices={n}: the last n blocks needs 1 <= n <= "
                       f"{num_blocks} (the model's num_layers)")
    return list(range(num_blocks - n, num_blocks))
  take = []
  for i in indices:
    idx = int(i) + num_blocks if int(i) < 0 else int(i)
    if not 0 <= idx < num_blocks:
      raise ValueError(f"indices: block {i} is out of range for a model of "
                       f"{num_blocks} blocks (0..{num_blocks - 1}, or "
                       f"negative from the end)")
    take.append(idx)
  if not take:
    raise ValueError("indices=[]: name at least one block")
  return sorted(set(take))


def pair(v) -> Tuple[int, int]:
  """``image_size`` as (height, width): an int is a square."""
  if isinstance(v, (tuple, list)):
    if len(v) != 2:
      raise ValueError(f"image_size must be an int or (height, width), got {v}")
    return int(v[0]), int(v[1])
  return int(v), int(v)
