"""What the command-line tools share (``python -m vit_jax.predict``,
``evaluate``, ``visualize``, ``features``, ``probe``, ``export``,
``weights``): one spelling of every option, the checkpoint and dataset
options, loading, batched runs, and the one-line error a user sees.

Options are spelled with dashes (``--image-size``); the underscore
spelling (``--image_size``) is accepted everywhere too.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

import numpy as np

from vit_jax.data.console import Parser

# What a tool reports as one line (``error: ...``) rather than a traceback
# (vit_jax.weights.CheckpointError is a ValueError).
USER_ERRORS = (FileNotFoundError, ValueError)
SUPPORTED = (
    "a pretrained name (timm's architecture.tag, e.g. "
    "vit_small_patch14_reg4_dinov2.lvd142m, downloaded once; "
    "vit_jax.list_models(pretrained=True) lists them), a training workdir, "
    "a .pth / .npz / .safetensors file, a Hugging Face model directory, "
    "hf-hub:org/name, or torchvision:WEIGHTS")


def parser(prog: str, description: str) -> Parser:
  return Parser(prog=f"python -m {prog}", description=description)


def add_checkpoint(ap: argparse.ArgumentParser, *, repeat: bool = False,
                   labels: bool = False) -> None:
  """``--checkpoint`` (anything :func:`vit_jax.weights.load` reads),
  ``--model``, ``--image-size``, ``--patch-size`` (and ``--labels``)."""
  ap.add_argument("--checkpoint", required=True,
                  action="append" if repeat else "store",
                  help=SUPPORTED + ("; may be repeated" if repeat else ""))
  ap.add_argument("--model", default=None,
                  help="the model's name where the weights cannot tell: ours "
                       "(vit_b_16, B/16) or timm's (vit_base_patch16_224); "
                       "checked against the weights")
  ap.add_argument("--image-size", type=int, default=None,
                  help="run at this resolution (position embedding "
                       "resampled)")
  ap.add_argument("--patch-size", type=int, default=None,
                  help="run at this patch size (FlexiViT resampling of the "
                       "patch embedding)")
  if labels:
    ap.add_argument("--labels", default=None,
                    help="class names, one per line (or a JSON list)")


def add_dataset(ap: argparse.ArgumentParser, *, batch_size: int = 256,
                what: str = "split") -> None:
  """``--dataset``, ``--split``, ``--data-dir``, ``--batch-size``,
  ``--no-download``."""
  ap.add_argument("--dataset", default=None,
                  help="tfds name, or folder:DIR: a DIR/<split>/<label>/ "
                       "tree, or any folder of images, read whole (labels: "
                       "DIR/<label>/) (default: the training run's)")
  ap.add_argument("--split", default=None,
                  help=f"{what} (default: the run's eval split), e.g. test, "
                       f"validation, 'train[:10%%]'")
  ap.add_argument("--data-dir", default=None,
                  help="tfds data directory (default: tfds' own)")
  ap.add_argument("--batch-size", type=int, default=batch_size,
                  help="global batch (split over all devices)")
  ap.add_argument("--no-download", action="store_true",
                  help="fail instead of downloading a missing dataset")


def load(args, source=None, **kwargs):
  """:func:`vit_jax.weights.load` of ``source`` (default:
  ``args.checkpoint``) with the shared options."""
  from vit_jax import weights  # pylint: disable=import-outside-toplevel
  options = {"model_name": args.model, "image_size": args.image_size}
  if getattr(args, "patch_size", None) is not None:
    options["patch_size"] = args.patch_size
  options.update(kwargs)
  return weights.load(source or args.checkpoint, **options)


def resolve_layer(layer: int, num_layers: int) -> int:
  """``--layer`` (0-based; negative from the end) as a block index."""
  idx = layer + num_layers if layer < 0 else layer
  if not 0 <= idx < num_layers:
    raise ValueError(f"layer={layer}: the model has {num_layers} layers "
                     f"(0..{num_layers - 1}, or -1 for the last)")
  return idx


def error(e) -> None:
  """The one line a user sees for a user error."""
  sys.stdout.flush()
  print(f"error: {e}", file=sys.stderr, flush=True)


def run(main: Callable[[], int]) -> int:
  """``main()``, with a user error reported as one line (exit status 1)."""
  try:
    return main()
  except USER_ERRORS as e:
    error(e)
    return 1


def make_probabilities_fn(model) -> Callable:
  """jit(variables, images) -> softmax probabilities (float32)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  @jax.jit
  def fn(variables, images):
    logits = model.apply(variables, images, train=False)
    return jax.nn.softmax(logits.astype(jnp.float32), axis=-1)

  return fn


def run_batches(fn, variables, images, batch_size: int) -> np.ndarray:
  """Applies ``fn`` to ``images`` (N, H, W, 3), or a dict of (N, ...) arrays
  (a NaFlex batch), in batches of one fixed shape (the last one padded
  with zeros: a NaFlex row of padding only), so it compiles once."""
  leaves = list(images.values()) if isinstance(images, dict) else [images]
  n = len(leaves[0])
  if n == 0:
    return np.zeros((0,), np.float32)
  b = max(1, min(int(batch_size), n))

  def take(x, start):
    chunk = x[start:start + b]
    if len(chunk) < b:
      chunk = np.concatenate([chunk, np.zeros((b - len(chunk),) +
                                              chunk.shape[1:], chunk.dtype)])
    return chunk

  outs = []
  for start in range(0, n, b):
    k = min(b, n - start)
    chunk = ({key: take(v, start) for key, v in images.items()}
             if isinstance(images, dict) else take(images, start))
    outs.append(np.asarray(fn(variables, chunk))[:k])
  return np.concatenate(outs)
