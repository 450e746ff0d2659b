"""The model room: the linen Vision Transformer with every option, its
variants table and :func:`get_model`, the one constructor.

    from vit_jax import models
    model = models.get_model("vit_b_16", num_classes=1000)

Modules: :mod:`~vit_jax.models.vit` (the module), :mod:`~vit_jax.models.variants`
(names, sizes, ``get_model``), :mod:`~vit_jax.models.layers` (attention, MLP,
norms, position embeddings, the encoder), :mod:`~vit_jax.models.kernels`
(the fast paths, chosen per backend), :mod:`~vit_jax.models.interpolate`
(PyTorch's resizing as matrices), :mod:`~vit_jax.models.naflex` (NaFlex
inputs: the per-image resize of the position grid, the padding masks),
:mod:`~vit_jax.models.resnet` (the hybrids' ResNet stem),
:mod:`~vit_jax.models.mbconv` (ViTamin's convolutional stem),
:mod:`~vit_jax.models.relpos` (relative position biases: BEiT's
table, timm's relpos family's table or MLP),
:mod:`~vit_jax.models.sam` (SAM's windows, decomposed relative positions
and neck), :mod:`~vit_jax.models.cait` (CaiT's talking heads and class
attention), :mod:`~vit_jax.models.diffattn` (differential attention),
:mod:`~vit_jax.models.analysis` (attention maps, rollout, feature PCA). This room imports nothing else of vit_jax, nor
torch or TensorFlow.
"""

from vit_jax.models.layers import (  # noqa: F401  (building blocks)
    LN_EPS, AddPositionEmbs, BlockConfig, ClassAttentionBlock, Encoder,
    Encoder1DBlock, LayerNorm, MAPHead, MlpBlock, MultiHeadDotProductAttention,
    PatchEmbed, activation)
from vit_jax.models.mbconv import MbConvConfig  # noqa: F401
from vit_jax.models.resnet import ResNetConfig  # noqa: F401
from vit_jax.models.variants import (  # noqa: F401
    ARCH_FIELDS, FIELDS, OPTION_FIELDS, SIZES, VARIANTS, Variant, arch_record,
    count_params, decode_variant, from_record, get_model, init_params,
    variant_name)
from vit_jax.models.vit import (  # noqa: F401
    ConvStemConfig, VisionTransformer, feature_take_indices, pair)

__all__ = [
    "ARCH_FIELDS", "FIELDS", "OPTION_FIELDS", "SIZES", "VARIANTS", "Variant",
    "ConvStemConfig", "MbConvConfig", "ResNetConfig", "VisionTransformer", "arch_record",
    "count_params",
    "decode_variant", "feature_take_indices", "from_record", "get_model",
    "init_params",
    "pair", "variant_name",
]
