"""What a ViT attends to and what its features look like, as numbers:
every layer's attention probabilities (sown by the model itself), the class
token's attention per head, attention rollout (Abnar & Zuidema 2020), the
cosine similarity of the learned position embeddings (figure 7 of the ViT
paper), and the principal components of patch features (DINOv2's picture).
:mod:`vit_jax.visualize` draws them.
"""

from __future__ import annotations

import math
from typing import List, Sequence

import numpy as np


def make_attention_fn(model):
  """jit(variables, images) -> (logits, attention probabilities of every
  layer, (layers, batch, heads, N, N)), read from the model's own sown
  ``intermediates``."""
  import jax  # pylint: disable=import-outside-toplevel

  sowing = model.clone(sow_attention_weights=True)

  @jax.jit
  def run(variables, images):
    logits, state = sowing.apply(variables, images, train=False,
                                 mutable=["intermediates"])
    tr = state["intermediates"]["Transformer"]
    if "encoderblock" in tr:  # scan_layers: stacked along a leading axis
      return logits, tr["encoderblock"]["MultiHeadDotProductAttention_0"][
          "attention_weights"][0]
    blocks = sorted((k for k in tr if k.startswith("encoderblock_")),
                    key=lambda k: int(k.rsplit("_", 1)[1]))
    return logits, jax.numpy.stack([
        tr[k]["MultiHeadDotProductAttention_0"]["attention_weights"][0]
        for k in blocks])

  return run


def attention_weights(model, variables, images) -> np.ndarray:
  """Attention probabilities of every layer: (layers, batch, heads, N, N)."""
  return np.asarray(make_attention_fn(model)(variables, images)[1], np.float32)


def num_prefix_tokens(model) -> int:
  """Tokens before the patches in the blocks' attention: the class token,
  then registers (none in a CaiT's blocks: its class token joins the
  patches after them)."""
  if getattr(model, "class_attn_layers", 0):
    return 0
  return int(model.num_prefix_tokens)


def posemb_prefix_rows(model) -> int:
  """Rows of the position embedding before the patches' (none with
  ``no_embed_class``; only the class token's with ``no_embed_registers``)."""
  if model.no_embed_class:
    return 0
  if getattr(model, "no_embed_registers", False):
    return num_prefix_tokens(model) - int(model.num_registers)
  return num_prefix_tokens(model)


def class_attention(weights: np.ndarray, grid, prefix: int) -> np.ndarray:
  """One layer's (heads, N, N) probabilities -> (heads, gh, gw): what the
  class token attends to among the patches (without a class token: the
  attention each patch receives, averaged over the queries)."""
  if prefix:
    att = weights[:, 0, prefix:]
  else:
    att = weights.mean(axis=1)
  return att.reshape(weights.shape[0], *grid)


def attention_rollout(weights: np.ndarray, grid, prefix: int) -> np.ndarray:
  """Attention rollout (Abnar & Zuidema, 2020) of one image's (layers,
  heads, N, N) probabilities: per layer the head-averaged attention plus the
  identity (the residual path), rows renormalised, multiplied through the
  layers; returns the class token's row over the patches, (gh, gw)."""
  n = weights.shape[-1]
  eye = np.eye(n, dtype=np.float64)
  joint = eye
  for layer in weights:
    a = 0.5 * layer.mean(axis=0).astype(np.float64) + 0.5 * eye
    a /= a.sum(axis=-1, keepdims=True)
    joint = a @ joint
  row = joint[0, prefix:] if prefix else joint.mean(axis=0)
  return row.reshape(grid)


def posemb_similarity(variables, prefix: int, grid=None) -> np.ndarray:
  """Cosine similarity of each patch position's embedding with every other
  one: (gh, gw, gh, gw), ``[i, j]`` being position (i, j)'s map."""
  p = variables["params"] if "params" in variables else variables
  pe = np.asarray(p["Transformer"]["posembed_input"]["pos_embedding"],
                  np.float64)[0, prefix:]
  if grid is None:
    side = math.isqrt(pe.shape[0])
    if side * side != pe.shape[0]:
      raise ValueError(f"{pe.shape[0]} patch positions are not a square grid; "
                       f"pass grid=(rows, cols)")
    grid = (side, side)
  unit = pe / np.maximum(np.linalg.norm(pe, axis=-1, keepdims=True), 1e-12)
  sim = unit @ unit.T
  return sim.reshape(*grid, *grid)


def feature_pca(grids: Sequence[np.ndarray], n_components: int = 3
                ) -> List[np.ndarray]:
  """Patch features -> their first principal components, scaled to [0, 1].

  ``grids`` are (h, w, D) arrays (any grid sizes); the components are fitted
  on all their patches together (scikit-learn's PCA: signs fixed, so the
  result is deterministic) and each is min-max scaled over all patches.
  Returns one (h, w, n_components) array per grid."""
  from sklearn.decomposition import PCA  # pylint: disable=import-outside-toplevel

  flat = np.concatenate([np.asarray(g, np.float64).reshape(-1, g.shape[-1])
                         for g in grids])
  if flat.shape[0] < n_components:
    raise ValueError(f"{flat.shape[0]} patches: too few for "
                     f"{n_components} principal components")
  proj = PCA(n_components=n_components, svd_solver="full").fit_transform(flat)
  lo, hi = proj.min(axis=0), proj.max(axis=0)
  proj = (proj - lo) / np.maximum(hi - lo, 1e-12)
  out, start = [], 0
  for g in grids:
    n = g.shape[0] * g.shape[1]
    out.append(proj[start:start + n].reshape(g.shape[0], g.shape[1], -1))
    start += n
  return out


def make_patch_features_fn(model, layer: int):
  """jit(variables, images) -> layer ``layer``'s patch tokens through the
  final LayerNorm, (B, h, w, D), at any input size (the model runs with
  ``dynamic_img_size=True``; each new size compiles once)."""
  import jax  # pylint: disable=import-outside-toplevel

  dynamic = model.clone(dynamic_img_size=True)

  @jax.jit
  def run(variables, images):
    (grid,) = dynamic.apply(variables, images,
                            method=dynamic.forward_intermediates,
                            indices=[layer], norm=True,
                            intermediates_only=True)
    return grid

  return run
