"""ONNX export through the model's exact torch twin (``vit_jax.export``'s
``onnx`` format).

The parameters go through the project's exact converters into torchvision's
``VisionTransformer`` (:func:`vit_jax.convert.to_torchvision_model`: class
token, conv stem, pre-logits) or timm's (:func:`vit_jax.formats.to_timm`:
global average pooling), both loaded with ``strict=True`` and checked
against JAX on a random batch (:func:`check_twin`), behind a layer that
takes NHWC images; ``torch.onnx.export`` (the ``torch.export``-based
exporter) writes the graph with symbolic batch (and, with preprocessing,
height and width) dimensions. This route was measured against jax2onnx
(docs/export.md): the same parity, a graph onnxruntime runs faster, and no
conflicting pins (jax2onnx requires orbax-checkpoint < 0.11.37).

The preprocessing is the same code as the JAX artifacts'
(:func:`vit_jax.export.preprocessing.preprocess_with`) run with torch ops:
the resampling weights are computed in the graph from the input's height and
width.
"""

from __future__ import annotations

import functools

import numpy as np

from vit_jax.export import base, types
from vit_jax.export import preprocessing as export_preprocessing
from vit_jax.weights import twins

_OPSET = 18
_ONE_FILE_MAX_BYTES = 1_800_000_000  # protobuf's limit is 2 GiB


# --------------------------------------------------------------------------- #
# Preprocessing in torch: export_preprocessing.preprocess_with, torch ops.
# --------------------------------------------------------------------------- #


class _TorchOps:
  """The array operations ``export_preprocessing.preprocess_with`` needs,
  in torch (sizes may be symbolic under ``torch.export``)."""

  def __init__(self):
    import torch  # pylint: disable=import-outside-toplevel
    self.torch = torch
    self.abs, self.where, self.sin = torch.abs, torch.where, torch.sin

  def maximum(self, a, b):
    def as_tensor(v):
      return v if isinstance(v, self.torch.Tensor) else self.scalar(v)
    return self.torch.maximum(as_tensor(a), as_tensor(b))

  def arange(self, n):
    return self.torch.arange(n, dtype=self.torch.int64)

  def scalar(self, n):
    return self.torch.full((), n, dtype=self.torch.int64)

  def to_f32(self, x):
    return x.to(self.torch.float32)

  def relu(self, x):
    return self.torch.clamp(x, min=0.0)

  def sum0(self, x):
    return x.sum(dim=0, keepdim=True)

  def clip(self, x, lo, hi):
    return self.torch.clamp(x, lo, hi)

  def einsum(self, spec, a, b):
    return self.torch.einsum(spec, a, b)


def _torch_preprocessing(pre):
  """A torch module: uint8 (B, H, W, 3) -> float32 (B, S, S, 3), the
  function of :func:`vit_jax.export.preprocessing.preprocess`."""
  import torch  # pylint: disable=import-outside-toplevel

  export_preprocessing.resize_method(pre)  # a clear error for others

  class Preprocess(torch.nn.Module):

    def __init__(self):
      super().__init__()
      self.register_buffer("mean", torch.tensor(pre.mean, dtype=torch.float32))
      self.register_buffer("std", torch.tensor(pre.std, dtype=torch.float32))

    def forward(self, images):
      return export_preprocessing.preprocess_with(
          _TorchOps(), images, pre, self.mean, self.std)

  return Preprocess()


# --------------------------------------------------------------------------- #
# The model's torch twin.
# --------------------------------------------------------------------------- #


def torch_model(s):
  """The torchvision or timm ``VisionTransformer`` computing the servable
  ``s`` (NCHW in, logits out), loaded with ``strict=True``
  (:mod:`vit_jax.weights.twins`)."""
  try:
    return twins.torch_model(s.model, s.variables, s.image_size)
  except twins.NoTwin as e:
    raise types.ExportError(
        f"ONNX export traces a PyTorch twin of the model, and {e} Use "
        f"--format stablehlo or savedmodel.") from None


def check_twin(s, net, tol: float = 1e-4):
  """Raises ExportError unless the torch twin ``net`` (NCHW in) gives the
  logits of ``s.model.apply`` (or its features) on a random batch (a layout the converters map only in
  part, e.g. parameters torchvision has no place for, would not)."""
  import jax  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel

  x = np.random.RandomState(0).standard_normal(
      (2, s.image_size, s.image_size, s.model.num_channels)).astype(np.float32)
  method = s.model.forward_features if s.output == "features" else None
  want = np.asarray(jax.jit(functools.partial(
      s.model.apply, train=False, method=method))(s.variables, x), np.float64)
  with torch.no_grad():
    got = net(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
  err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
  if not err < tol:
    raise types.ExportError(
        f"The torch twin of this model ({type(net).__module__}."
        f"{type(net).__name__}) does not compute it (relative error {err:.1e}"
        f"); ONNX export cannot hold this layout. Use --format stablehlo or "
        f"savedmodel.")


def _features_of(s, net):
  """torch module: NCHW images -> ``s.model``'s ``forward_features`` from
  the twin ``net``: timm's ``forward_features`` (SAM's NCHW neck map made
  NHWC), torchvision's encoder output."""
  import torch  # pylint: disable=import-outside-toplevel

  sam = bool(s.model.neck_chans)

  class Features(torch.nn.Module):

    def __init__(self):
      super().__init__()
      self.net = net

    def forward(self, x):
      if hasattr(self.net, "forward_features"):  # timm's
        y = self.net.forward_features(x)
        return y.permute(0, 2, 3, 1) if sam else y
      n = x.shape[0]  # torchvision's VisionTransformer
      y = self.net._process_input(x)  # pylint: disable=protected-access
      y = torch.cat([self.net.class_token.expand(n, -1, -1), y], dim=1)
      return self.net.encoder(y)

  return Features().eval()


def _explicit_windowed_attention(net):
  """timm's SAM attends within windows through torch's fused attention on
  3-D (windows x heads, tokens, width) tensors, which the ONNX exporter
  refuses (4-D only): its explicit path computes the same function."""
  for module in net.modules():
    if (type(module).__module__.endswith("vision_transformer_sam") and
        hasattr(module, "fused_attn")):
      module.fused_attn = False


def serving_module(s, *, with_preprocessing: bool = False):
  """torch module: images (as the artifact takes them) -> logits (or
  features: ``s.output``)."""
  import torch  # pylint: disable=import-outside-toplevel

  net = torch_model(s)
  _explicit_windowed_attention(net)
  if s.output == "features":
    net = _features_of(s, net)
  check_twin(s, net)
  pre = _torch_preprocessing(s.preprocessing) if with_preprocessing else None

  class Serving(torch.nn.Module):

    def __init__(self):
      super().__init__()
      self.net = net
      self.pre = pre

    def forward(self, images):
      x = self.pre(images) if self.pre is not None else images
      return self.net(x.permute(0, 3, 1, 2))

  return Serving().eval()


def export_onnx(s, out: str, *, batch=None, dtype: str = "float32",
                with_preprocessing: bool = False) -> str:
  """Writes the ONNX artifact (see the module docstring)."""
  import torch  # pylint: disable=import-outside-toplevel

  if dtype != "float32":
    raise types.ExportError(
        f"ONNX export is float32 only: onnxruntime's CPU kernels (Conv, "
        f"MatMul) have no {dtype}. Use --format stablehlo or savedmodel for "
        f"{dtype}.")
  if with_preprocessing and s.preprocessing is None:
    raise types.ExportError(
        "--with-preprocessing needs the weights' preprocessing: pass a "
        "checkpoint, or (model, variables, preprocessing).")
  module = serving_module(s, with_preprocessing=with_preprocessing)
  spec = base.input_spec(s, batch=batch,
                               with_preprocessing=with_preprocessing)
  # Example sizes distinct from each other and from 0/1, so that no dynamic
  # dimension is specialised to the example.
  example_dims = [d if d is not None else e for d, e in
                  zip(spec.shape, (2, s.image_size + 5, s.image_size + 11))]
  example_dims.append(spec.shape[3])
  example = torch.zeros(example_dims, dtype=getattr(torch, spec.dtype))
  names = ("batch", "height", "width")
  dynamic = {i: torch.export.Dim(names[i]) for i, d in
             enumerate(spec.shape[:3]) if d is None}
  # One file, unless the weights pass protobuf's 2 GiB limit (ViT-H): then
  # they go to an external data file next to it.
  weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
  with torch.no_grad():
    torch.onnx.export(
        module, (example,), out, input_names=["images"],
        output_names=[s.output], opset_version=_OPSET, dynamo=True,
        dynamic_shapes={"images": dynamic},
        external_data=weight_bytes > _ONE_FILE_MAX_BYTES, verbose=False)
  return out
