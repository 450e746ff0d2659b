r"""Top-k predictions for image files.

    python -m vit_jax.predict --checkpoint /tmp/digits IMAGE.png ...
    python -m vit_jax.predict --checkpoint vit_b_16.pth --model vit_b_16 cat.jpg
    python -m vit_jax.predict --checkpoint augreg_Ti_16.npz photos/

``--checkpoint`` is anything :func:`vit_jax.weights.load` reads (a training
workdir, a torchvision/timm ``.pth``, a Google ``.npz``, a ``.safetensors``
file); it can be repeated. Images are decoded (JPEG, PNG, ...), prepared the
way the weights expect, run in batches, and the top-k labels are printed with
their probabilities. A NaFlex model (SigLIP 2 NaFlex, timm's ``naflexvit_*``)
takes every image at its own aspect ratio: resized to the weights' token
budget and padded to one sequence length (:mod:`vit_jax.data.naflex`). A missing or unreadable image, or a checkpoint that
cannot be used, is reported on stderr with the reason, and the remaining
files are still processed; the exit status is 1 if anything failed.

From Python::

    from vit_jax import predict
    for p in predict.predict("/tmp/digits", ["a.png", "b.png"]):
      print(p.path, p.error or p.top[0])
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from vit_jax import cli, weights
from vit_jax.data import console, images as image_files


@dataclasses.dataclass
class Prediction:
  """The result for one image: ``top`` is [(class index, label, probability)]
  best first, or ``error`` says why there is none."""

  path: str
  top: List[Tuple[int, str, float]] = dataclasses.field(default_factory=list)
  error: Optional[str] = None

  def as_dict(self) -> dict:
    if self.error is not None:
      return {"image": self.path, "error": self.error}
    return {"image": self.path, "top": [
        {"index": i, "label": name, "probability": p} for i, name, p in self.top]}


ImageLike = Union[str, os.PathLike, np.ndarray]


def predict(checkpoint: Union[str, weights.Loaded],
            images: Sequence[ImageLike], *, top_k: int = 5,
            batch_size: int = 32, model_name: Optional[str] = None,
            image_size: Optional[int] = None,
            label_file: Optional[str] = None) -> List[Prediction]:
  """Top-``top_k`` predictions for each image, in order.

  Args:
    checkpoint: a path :func:`vit_jax.weights.load` accepts, or an already
      loaded :class:`~vit_jax.weights.Loaded`.
    images: file paths, or decoded uint8 (H, W, 3) arrays.
    top_k: how many classes to report (at most the number of classes).
    batch_size: images per forward pass.
    model_name, image_size, label_file: passed to
      :func:`vit_jax.weights.load`.

  Returns:
    One :class:`Prediction` per image; images that cannot be read carry
    ``error`` instead of ``top``. A checkpoint that cannot be loaded raises
    :class:`vit_jax.weights.CheckpointError`.
  """
  if top_k < 1:
    raise ValueError(f"top_k={top_k}: expected >= 1")
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size}: expected >= 1")
  loaded = (checkpoint if isinstance(checkpoint, weights.Loaded) else
            weights.load(checkpoint, model_name=model_name,
                           image_size=image_size, label_file=label_file))
  if not loaded.num_classes:  # a backbone, or an embedding head
    raise weights.CheckpointError(
        f"{loaded.description}: {loaded.head_summary()}, so there is no "
        f"class to predict. Image embeddings: python -m vit_jax.features "
        f"(and vit_jax.visualize for its attention and feature PCA); a "
        f"classifier: fine-tune with train.py --config.init_weights=... (or "
        f"load weights fine-tuned on classes).")
  results, arrays, where = [], [], []
  for i, item in enumerate(images):
    name = (f"<array {i}>" if isinstance(item, np.ndarray) else os.fspath(item))
    results.append(Prediction(name))
    try:
      raw = (np.asarray(item) if isinstance(item, np.ndarray) else
             image_files.read_image(name))
      arrays.append(loaded.preprocess(raw))
      where.append(i)
    except image_files.ImageError as e:
      results[i].error = str(e)
    except ValueError as e:  # an array that is not one decoded image
      results[i].error = f"{name}: {e}"
  if arrays:
    fn = cli.make_probabilities_fn(loaded.model)
    probs = cli.run_batches(fn, loaded.variables, loaded.batch(arrays),
                            batch_size)
    k = min(top_k, probs.shape[-1])
    for i, p in zip(where, probs):
      best = np.argsort(-p, kind="stable")[:k]
      results[i].top = [(int(c), loaded.label(int(c)), float(p[c])) for c in best]
  return results


def format_prediction(p: Prediction) -> str:
  lines = [p.path]
  for rank, (index, label, prob) in enumerate(p.top, 1):
    lines.append(f"  {rank}. {100 * prob:6.2f}%  {label} ({index})")
  return "\n".join(lines)


def _parser():
  ap = cli.parser("vit_jax.predict",
                  "Top-k predictions of a ViT checkpoint for image files.")
  ap.add_argument("images", nargs="+", metavar="IMAGE",
                  help="image files (JPEG, PNG, ...) or directories of them")
  cli.add_checkpoint(ap, repeat=True, labels=True)
  ap.add_argument("--top-k", type=int, default=5)
  ap.add_argument("--batch-size", type=int, default=32)
  ap.add_argument("--json", action="store_true",
                  help="one JSON object per image on stdout")
  return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
  console.lean_start_up()
  console.quiet_native_logs()
  args = _parser().parse_args(argv)
  images = image_files.expand_image_paths(args.images)
  gone = image_files.missing(images)
  if len(gone) == len(images):  # nothing to predict: no model loaded
    for e in gone:
      cli.error(e)
    return 1
  failed = False
  for ckpt in args.checkpoint:
    try:
      loaded = cli.load(args, ckpt, label_file=args.labels)
      results = predict(loaded, images, top_k=args.top_k,
                        batch_size=args.batch_size)
    except cli.USER_ERRORS as e:
      cli.error(e)
      failed = True
      continue
    if not args.json:
      print(f"== {ckpt}: {loaded.description}")
      print(f"   preprocessing: {loaded.preprocessing_summary()}")
    for r in results:
      if r.error is not None:
        failed = True
        cli.error(r.error)
        if args.json:
          print(json.dumps({"checkpoint": ckpt, **r.as_dict()}))
      elif args.json:
        print(json.dumps({"checkpoint": ckpt, **r.as_dict()}))
      else:
        print(format_prediction(r))
    sys.stdout.flush()
  return 1 if failed else 0


if __name__ == "__main__":
  console.one_line_warnings()
  sys.exit(main())
