r"""Pictures of what a ViT does: attention maps, attention rollout, and the
similarity of its learned position embeddings (matplotlib, PNG).

    python -m vit_jax.visualize --checkpoint /tmp/digits --out docs/images \
        --layer -1 digit.png

writes, per image, ``<name>_attention_layer<L>.png`` (what the class token
attends to in layer L, one panel per head, over the image the model sees) and
``<name>_rollout.png`` (attention rollout across all layers, Abnar & Zuidema
2020), and once ``posemb_similarity.png`` (cosine similarity of each patch
position's embedding with all others, as in figure 7 of the ViT paper).

The attention probabilities come from the model itself: it is cloned with
``sow_attention_weights=True`` and the probabilities are read from the
``intermediates`` collection (``.../MultiHeadDotProductAttention_0/
attention_weights``, shape (batch, heads, tokens, tokens)). For a
``classifier='gap'`` model (no class token) the maps show the attention each
patch receives, averaged over all query tokens.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import List, Optional, Sequence

import numpy as np

from vit_jax import console, inference


# --------------------------------------------------------------------------- #
# Numbers.
# --------------------------------------------------------------------------- #


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
  return 1 if model.classifier == "token" else 0


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
  from vit_jax import convert  # pylint: disable=import-outside-toplevel

  p = convert.unstack_layers(dict(variables))
  p = p["params"] if "params" in p else p
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


# --------------------------------------------------------------------------- #
# Pictures.
# --------------------------------------------------------------------------- #


def _plt():
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


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
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


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
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


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
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


# --------------------------------------------------------------------------- #
# Images and checkpoints.
# --------------------------------------------------------------------------- #


def _display(x: np.ndarray, pre) -> np.ndarray:
  """Normalised model input -> [0, 1] RGB, as the model sees it."""
  img = x * np.asarray(pre.std, np.float32) + np.asarray(pre.mean, np.float32)
  return np.clip(img, 0.0, 1.0)


def resolve_layer(layer: int, num_layers: int) -> int:
  idx = layer + num_layers if layer < 0 else layer
  if not 0 <= idx < num_layers:
    raise ValueError(f"layer={layer}: the model has {num_layers} layers "
                     f"(0..{num_layers - 1}, or -1 for the last)")
  return idx


def visualize(loaded: inference.Loaded, image_paths: Sequence[str],
              out_dir: str, *, layer: int = -1, interpolation: str = "nearest",
              posemb: bool = True, on_error=None) -> List[str]:
  """Writes the pictures for ``image_paths`` (and the position-embedding
  grid) into ``out_dir``; returns the paths written. An unreadable image
  raises :class:`vit_jax.inference.ImageError`, or, with ``on_error``, is
  passed to it and the other images are still drawn."""
  import jax  # pylint: disable=import-outside-toplevel

  os.makedirs(out_dir, exist_ok=True)
  model = loaded.model
  layer = resolve_layer(layer, model.num_layers)
  prefix = num_prefix_tokens(model)
  size = loaded.image_size
  grid = (size // model.patch_size, size // model.patch_size)
  written = []
  if posemb:
    sim = posemb_similarity(loaded.variables, prefix, grid)
    written.append(plot_posemb_similarity(
        sim, os.path.join(out_dir, "posemb_similarity.png"),
        title=f"Position embedding similarity ({grid[0]}x{grid[1]} patches)"))
  run = make_attention_fn(model) if image_paths else None
  for path in image_paths:
    try:
      x = loaded.preprocess(inference.read_image(path))[None]
    except inference.ImageError as e:
      if on_error is None:
        raise
      on_error(e)
      continue
    logits, w = run(loaded.variables, x)
    w = np.asarray(w, np.float32)[:, 0]  # (L, H, N, N)
    probs = np.asarray(jax.nn.softmax(logits.astype("float32"), axis=-1))[0]
    best = int(np.argmax(probs))
    guess = f"predicted {loaded.label(best)!r} ({100 * probs[best]:.1f}%)"
    stem = os.path.splitext(os.path.basename(path))[0]
    img = _display(x[0], loaded.preprocessing)
    what = "class token attention" if prefix else "mean attention received"
    written.append(plot_heads(
        img, class_attention(w[layer], grid, prefix),
        os.path.join(out_dir, f"{stem}_attention_layer{layer}.png"),
        title=f"{os.path.basename(path)}: {what}, layer {layer} of "
              f"{model.num_layers}; {guess}", interpolation=interpolation))
    written.append(plot_rollout(
        img, attention_rollout(w, grid, prefix),
        os.path.join(out_dir, f"{stem}_rollout.png"),
        title=f"{os.path.basename(path)}: rollout over {model.num_layers} "
              f"layers; {guess}", interpolation=interpolation))
  return written


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(
      prog="python -m vit_jax.visualize",
      description="Attention maps, attention rollout and position-embedding "
                  "similarity of a ViT checkpoint, as PNG files.")
  ap.add_argument("images", nargs="*", metavar="IMAGE",
                  help="image files or directories (none: only the "
                       "position-embedding picture)")
  ap.add_argument("--checkpoint", required=True, help=inference.SUPPORTED)
  ap.add_argument("--model", default=None,
                  help="variant when the weights cannot tell (vit_b_16, ...)")
  ap.add_argument("--out", default="vit_pictures", help="output directory")
  ap.add_argument("--layer", type=int, default=-1,
                  help="layer of the per-head maps (0-based; -1 = last)")
  ap.add_argument("--interpolation", default="nearest",
                  help="how maps are drawn over the image (nearest shows the "
                       "patches; bilinear is smoother)")
  ap.add_argument("--image_size", type=int, default=None)
  ap.add_argument("--no_posemb", action="store_true",
                  help="skip the position-embedding picture")
  return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
  console.quiet_native_logs()
  args = _parser().parse_args(argv)
  try:
    loaded = inference.load(args.checkpoint, model_name=args.model,
                            image_size=args.image_size)
    resolve_layer(args.layer, loaded.model.num_layers)
  except (inference.CheckpointError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  errors = []

  def report(e):
    print(f"error: {e}", file=sys.stderr, flush=True)
    errors.append(e)

  written = visualize(loaded, inference.expand_image_paths(args.images),
                      args.out, layer=args.layer,
                      interpolation=args.interpolation,
                      posemb=not args.no_posemb, on_error=report)
  for w in written:
    print(w)
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
