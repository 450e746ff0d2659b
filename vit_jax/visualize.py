r"""Pictures of what a ViT does: attention maps, attention rollout, the
similarity of its learned position embeddings, and the principal components
of its patch features (matplotlib, PNG).

    python -m vit_jax.visualize --checkpoint /tmp/digits --out docs/images \
        --layer -1 --pca digit.png

writes, per image, ``<name>_attention_layer<L>.png`` (what the class token
attends to in layer L, one panel per head, over the image the model sees) and
``<name>_rollout.png`` (attention rollout across all layers, Abnar & Zuidema
2020), and once ``posemb_similarity.png`` (cosine similarity of each patch
position's embedding with all others, as in figure 7 of the ViT paper; not
for a model whose positions are rotary only, as DINOv3's). With
``--pca``, also ``<name>_feature_pca.png``: the first three principal
components of layer L's patch features (through the final LayerNorm) as
RGB, the picture DINOv2 made familiar. It is drawn at a high resolution
(``--pca-size``, default 32 patches on the short side, keeping the image's
aspect ratio) through dynamic resolution: the model is run with
``dynamic_img_size=True``, its position embedding resampled to that grid in
the forward pass. The components are fitted jointly on all the images given,
so the same colour means the same direction in feature space across them.

The attention probabilities come from the model itself: it is cloned with
``sow_attention_weights=True`` and the probabilities are read from the
``intermediates`` collection (``.../MultiHeadDotProductAttention_0/
attention_weights``, shape (batch, heads, tokens, tokens)). For a
``classifier='gap'`` model (no class token) the maps show the attention each
patch receives, averaged over all query tokens.
"""

from __future__ import annotations

import math
import os
import sys
from typing import List, Optional, Sequence

import numpy as np

from vit_jax import cli, weights
from vit_jax.data import console, images as image_files
from vit_jax.models.analysis import (  # noqa: F401  (the numbers drawn here)
    attention_rollout, attention_weights, class_attention, feature_pca,
    make_attention_fn, make_patch_features_fn, num_prefix_tokens,
    posemb_prefix_rows, posemb_similarity)


def pca_input(image: np.ndarray, pre, size: int, patch: int) -> np.ndarray:
  """uint8 (H, W, 3) -> float32 model input whose short side is ``size``
  and both sides multiples of ``patch`` (aspect ratio kept up to a patch),
  resized with the weights' interpolation and normalised with their
  mean / std."""
  from PIL import Image  # pylint: disable=import-outside-toplevel

  from vit_jax.data import preprocessing  # pylint: disable=import-outside-toplevel

  h, w = image.shape[:2]
  scale = size / min(h, w)
  new_h = max(patch, int(round(h * scale / patch)) * patch)
  new_w = max(patch, int(round(w * scale / patch)) * patch)
  interp = preprocessing._PIL_FILTERS.get(  # pylint: disable=protected-access
      str(pre.interpolation).lower(), "BICUBIC")
  im = Image.fromarray(np.asarray(image, np.uint8)).resize(
      (new_w, new_h), getattr(Image.Resampling, interp))
  x = np.asarray(im, np.float32) / 255.0
  return ((x - np.asarray(pre.mean, np.float32)) /
          np.asarray(pre.std, np.float32)).astype(np.float32)


# --------------------------------------------------------------------------- #
# Pictures.
# --------------------------------------------------------------------------- #


def _plt():
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def _save(fig, path: str, title: Optional[str] = None) -> str:
  """Titles, lays out, writes and closes ``fig``; returns ``path``."""
  if title is not None:
    fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  _plt().close(fig)
  return path


def _show(ax, image, overlay=None, title=None, interpolation="nearest",
          alpha=0.6, cmap="inferno"):
  h, w = image.shape[:2]
  ax.imshow(image, extent=(0, w, h, 0), interpolation="nearest")
  if overlay is not None:
    ax.imshow(overlay, extent=(0, w, h, 0), cmap=cmap, alpha=alpha,
              interpolation=interpolation)
  ax.set_xticks([])
  ax.set_yticks([])
  if title:
    ax.set_title(title, fontsize=9)


def plot_heads(image: np.ndarray, maps: np.ndarray, path: str, *,
               title: str = "", interpolation: str = "nearest") -> str:
  """The image, then one panel per head with its map overlaid."""
  plt = _plt()
  heads = maps.shape[0]
  cols = min(heads + 1, 7)
  rows = math.ceil((heads + 1) / cols)
  fig, axes = plt.subplots(rows, cols, figsize=(2.1 * cols, 2.3 * rows + 0.4),
                           squeeze=False)
  for ax in axes.flat:
    ax.axis("off")
  _show(axes.flat[0], image, title="input")
  axes.flat[0].axis("on")
  for h in range(heads):
    ax = axes.flat[h + 1]
    ax.axis("on")
    _show(ax, image, maps[h] / max(maps[h].max(), 1e-12), f"head {h}",
          interpolation)
  return _save(fig, path, title)


def plot_rollout(image: np.ndarray, rollout: np.ndarray, path: str, *,
                 title: str = "", interpolation: str = "nearest") -> str:
  """Input | rollout map | map overlaid on the input."""
  plt = _plt()
  fig, axes = plt.subplots(1, 3, figsize=(7.5, 2.9))
  norm = rollout / max(rollout.max(), 1e-12)
  _show(axes[0], image, title="input")
  axes[1].imshow(norm, cmap="inferno", interpolation=interpolation)
  axes[1].set_xticks([])
  axes[1].set_yticks([])
  axes[1].set_title("attention rollout", fontsize=9)
  _show(axes[2], image, norm, "overlay", interpolation)
  return _save(fig, path, title)


def plot_posemb_similarity(sim: np.ndarray, path: str, *, title: str = "") -> str:
  """ViT paper fig. 7: a (gh x gw) grid of small (gh x gw) maps; tile (i, j)
  is the cosine similarity of position (i, j)'s embedding with all others."""
  plt = _plt()
  gh, gw = sim.shape[:2]
  gap = 1
  canvas = np.full((gh * (gh + gap) - gap, gw * (gw + gap) - gap), np.nan)
  for i in range(gh):
    for j in range(gw):
      y, x = i * (gh + gap), j * (gw + gap)
      canvas[y:y + gh, x:x + gw] = sim[i, j]
  size = min(9.0, 2.0 + 0.45 * max(gh, gw))
  fig, ax = plt.subplots(figsize=(size + 1.2, size))
  cmap = plt.get_cmap("viridis").with_extremes(bad="white")
  im = ax.imshow(canvas, cmap=cmap, vmin=-1, vmax=1, interpolation="nearest")
  ax.set_xticks([j * (gw + gap) + (gw - 1) / 2 for j in range(gw)])
  ax.set_xticklabels([str(j + 1) for j in range(gw)], fontsize=7)
  ax.set_yticks([i * (gh + gap) + (gh - 1) / 2 for i in range(gh)])
  ax.set_yticklabels([str(i + 1) for i in range(gh)], fontsize=7)
  ax.set_xlabel("Input patch column")
  ax.set_ylabel("Input patch row")
  for s in ax.spines.values():
    s.set_visible(False)
  fig.colorbar(im, ax=ax, fraction=0.04, label="Cosine similarity")
  ax.set_title(title or "Position embedding similarity", fontsize=10)
  return _save(fig, path)


def plot_feature_pca(image: np.ndarray, rgb: np.ndarray, path: str, *,
                     title: str = "", interpolation: str = "nearest") -> str:
  """Input | its patch features' first three principal components as RGB."""
  plt = _plt()
  h, w = image.shape[:2]
  panel = min(5.5, 3.2 * w / h)  # inches per panel, at the image's aspect
  fig, axes = plt.subplots(1, 2, figsize=(2 * panel + 0.3,
                                          panel * h / w + 0.9))
  _show(axes[0], image, title=f"input ({h}x{w})")
  axes[1].imshow(rgb, extent=(0, w, h, 0), interpolation=interpolation)
  axes[1].set_xticks([])
  axes[1].set_yticks([])
  axes[1].set_title(f"patch features: PCA 1-3 as RGB ({rgb.shape[0]}x"
                    f"{rgb.shape[1]} patches)", fontsize=9)
  return _save(fig, path, title)


# --------------------------------------------------------------------------- #
# Images and checkpoints.
# --------------------------------------------------------------------------- #


def _display(x: np.ndarray, pre) -> np.ndarray:
  """Normalised model input -> [0, 1] RGB, as the model sees it."""
  img = x * np.asarray(pre.std, np.float32) + np.asarray(pre.mean, np.float32)
  return np.clip(img, 0.0, 1.0)


def _prediction(loaded: weights.Loaded, logits) -> str:
  """``'; predicted 'cat' (91.0%)'`` for a model whose head gives class
  scores; nothing for an embedding or a backbone (``loaded.head``), whose
  outputs are no classes."""
  import jax  # pylint: disable=import-outside-toplevel

  if not loaded.num_classes:  # a backbone, or an embedding head
    return ""
  probs = np.asarray(jax.nn.softmax(np.asarray(logits, np.float32),
                                    axis=-1))[0]
  best = int(np.argmax(probs))
  return f"; predicted {loaded.label(best)!r} ({100 * probs[best]:.1f}%)"


def visualize(loaded: weights.Loaded, image_paths: Sequence[str],
              out_dir: str, *, layer: int = -1, interpolation: str = "nearest",
              posemb: bool = True, pca: bool = False,
              pca_size: Optional[int] = None, on_error=None) -> List[str]:
  """Writes the pictures for ``image_paths`` (and the position-embedding
  grid) into ``out_dir``; returns the paths written. With ``pca``, also
  each image's feature-PCA picture at ``pca_size`` pixels on the short side
  (default: 32 patches). An unreadable image raises
  :class:`vit_jax.data.images.ImageError`, or, with ``on_error``, is passed
  to it and the other images are still drawn. The titles name the
  predicted class only for a model whose head gives classes (not for an
  embedding head or a backbone)."""
  if loaded.naflex:
    raise weights.CheckpointError(
        f"{loaded.description}: visualize draws fixed-size models' attention "
        f"grids; a NaFlex model's images each have a grid of their own. Its "
        f"features: python -m vit_jax.features; its predictions: python -m "
        f"vit_jax.predict.")
  os.makedirs(out_dir, exist_ok=True)
  model = loaded.model
  layer = cli.resolve_layer(layer, model.num_layers)
  prefix = num_prefix_tokens(model)
  size = loaded.image_size
  grid = (size // model.patch_size, size // model.patch_size)
  written = []
  if posemb and getattr(model, "abs_pos_embed", True):  # DINOv3: RoPE only
    sim = posemb_similarity(loaded.variables, posemb_prefix_rows(model), grid)
    written.append(plot_posemb_similarity(
        sim, os.path.join(out_dir, "posemb_similarity.png"),
        title=f"Position embedding similarity ({grid[0]}x{grid[1]} patches)"))
  run = make_attention_fn(model) if image_paths else None
  features = (make_patch_features_fn(model, layer)
              if pca and image_paths else None)
  pca_size = int(pca_size or max(size, 32 * model.patch_size))
  pca_items = []  # (stem, display image, patch features)
  for path in image_paths:
    try:
      raw = image_files.read_image(path)
      x = loaded.preprocess(raw)[None]
    except image_files.ImageError as e:
      if on_error is None:
        raise
      on_error(e)
      continue
    logits, w = run(loaded.variables, x)
    w = np.asarray(w, np.float32)[:, 0]  # (L, H, N, N)
    guess = _prediction(loaded, logits)
    stem = os.path.splitext(os.path.basename(path))[0]
    img = _display(x[0], loaded.preprocessing)
    what = "class token attention" if prefix else "mean attention received"
    written.append(plot_heads(
        img, class_attention(w[layer], grid, prefix),
        os.path.join(out_dir, f"{stem}_attention_layer{layer}.png"),
        title=f"{os.path.basename(path)}: {what}, layer {layer} of "
              f"{model.num_layers}{guess}", interpolation=interpolation))
    written.append(plot_rollout(
        img, attention_rollout(w, grid, prefix),
        os.path.join(out_dir, f"{stem}_rollout.png"),
        title=f"{os.path.basename(path)}: rollout over {model.num_layers} "
              f"layers{guess}", interpolation=interpolation))
    if features is not None:
      big = pca_input(raw, loaded.preprocessing, pca_size, model.patch_size)
      feats = np.asarray(features(loaded.variables, big[None]), np.float32)
      pca_items.append((stem, _display(big, loaded.preprocessing), feats[0]))
  if pca_items:
    rgbs = feature_pca([f for _, _, f in pca_items])
    for (stem, img, _), rgb in zip(pca_items, rgbs):
      written.append(plot_feature_pca(
          img, rgb, os.path.join(out_dir, f"{stem}_feature_pca.png"),
          title=f"{stem}: layer {layer} of {model.num_layers} at "
                f"{img.shape[0]}x{img.shape[1]}px (trained at {size}px)",
          interpolation=interpolation))
  return written


def _parser():
  ap = cli.parser("vit_jax.visualize",
                  "Attention maps, attention rollout, position-embedding "
                  "similarity and feature PCA of a ViT checkpoint, as PNG "
                  "files.")
  ap.add_argument("images", nargs="*", metavar="IMAGE",
                  help="image files or directories (none: only the "
                       "position-embedding picture)")
  cli.add_checkpoint(ap)
  ap.add_argument("--out", default="vit_pictures", help="output directory")
  ap.add_argument("--layer", type=int, default=-1,
                  help="layer of the per-head maps and of the feature PCA "
                       "(0-based; -1 = last)")
  ap.add_argument("--interpolation", default="nearest",
                  help="how maps are drawn over the image (nearest shows the "
                       "patches; bilinear is smoother)")
  ap.add_argument("--no-posemb", action="store_true",
                  help="skip the position-embedding picture")
  ap.add_argument("--pca", action="store_true",
                  help="also draw each image's patch features (layer "
                       "--layer) as their first 3 principal components")
  ap.add_argument("--pca-size", type=int, default=None,
                  help="short side in pixels of the PCA pictures' input "
                       "(any size: dynamic resolution; default 32 patches)")
  return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
  console.lean_start_up()
  console.quiet_native_logs()
  args = _parser().parse_args(argv)
  paths = image_files.expand_image_paths(args.images)
  gone = image_files.missing(paths)
  if paths and len(gone) == len(paths):  # nothing to draw: no model loaded
    for e in gone:
      cli.error(e)
    return 1
  try:
    loaded = cli.load(args)
    cli.resolve_layer(args.layer, loaded.model.num_layers)
  except cli.USER_ERRORS as e:
    cli.error(e)
    return 1
  errors = []

  def report(e):
    cli.error(e)
    errors.append(e)

  written = visualize(loaded, paths, args.out, layer=args.layer,
                      interpolation=args.interpolation,
                      posemb=not args.no_posemb, pca=args.pca,
                      pca_size=args.pca_size, on_error=report)
  for w in written:
    print(w)
  return 1 if errors else 0


if __name__ == "__main__":
  console.one_line_warnings()
  sys.exit(main())
