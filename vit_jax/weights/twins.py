"""The PyTorch twin of a model: torchvision's or timm's module with the same
architecture, our weights loaded into it with ``strict=True``.

The ONNX export traces the twin (:mod:`vit_jax.export.onnx`), and
:func:`vit_jax.convert.to_torchvision_model` hands it to users. torch,
torchvision and timm are imported here only (after TensorFlow too:
:func:`vit_jax.weights.files.torch_after_tensorflow`).
"""

from __future__ import annotations

import functools
from typing import Optional

from vit_jax import models
from vit_jax.weights import build, files, saving, trees


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


def timm_model(model, variables, image_size: Optional[int] = None):
  """timm's ``VisionTransformer`` with the architecture of ``model`` (every
  family option: registers, LayerScale, no_embed_class, pre-norm, fc_norm,
  MAP head, activation, LayerNorm epsilon), loaded with ``strict=True``."""
  files.torch_after_tensorflow()
  import torch  # pylint: disable=import-outside-toplevel
  from timm.models.vision_transformer import VisionTransformer  # pylint: disable=import-outside-toplevel

  m = model
  if m.patch_bias == m.pre_norm:  # timm: PatchEmbed(bias=not pre_norm)
    raise NoTwin(
        f"timm's ViT has a patch-embedding bias exactly when it has no "
        f"pre-norm (CLIP); this model has patch_bias={m.patch_bias}, "
        f"pre_norm={m.pre_norm}.")
  image_size = image_size or trees.native_image_size(
      trees.unstack_layers(dict(variables)), model)
  net = VisionTransformer(
      img_size=image_size, patch_size=m.patch_size, embed_dim=m.hidden_size,
      depth=m.num_layers, num_heads=m.num_heads,
      mlp_ratio=m.mlp_dim / m.hidden_size, qkv_bias=m.qkv_bias,
      class_token=m.classifier == "token", reg_tokens=m.num_registers,
      no_embed_class=m.no_embed_class, init_values=m.layer_scale_init,
      pre_norm=m.pre_norm, fc_norm=m.fc_norm,
      global_pool={"token": "token", "gap": "avg", "map": "map"}[m.classifier],
      num_classes=m.num_classes, act_layer=m.act,
      norm_layer=functools.partial(torch.nn.LayerNorm, eps=m.layer_norm_eps))
  net.load_state_dict(saving.to_torch(saving.to_state_dict(variables, "timm")),
                      strict=True)
  return net.eval()


def torch_model(model, variables, image_size: Optional[int] = None):
  """The twin that holds ``model``: torchvision's for a conv stem or a
  representation layer (timm has neither), else timm's."""
  if model.conv_stem or model.representation_size:
    if model.classifier != "token":
      raise NoTwin(
          f"neither torchvision's nor timm's ViT holds a "
          f"classifier={model.classifier!r} model with a conv stem or a "
          f"representation layer.")
    variant = models.Variant(model.hidden_size, model.num_layers,
                             model.num_heads, model.mlp_dim, model.patch_size)
    return torchvision_model(variables, variant, conv_stem=model.conv_stem)
  return timm_model(model, variables, image_size)
