r"""Embeddings (and patch grids) of every example of a dataset split, or of
every image in a folder, to .npz.

    python -m vit_jax.features --checkpoint runs/digits --split train \
        --out runs/digits/feats_train.npz
    python -m vit_jax.features --checkpoint runs/digits --split test \
        --out runs/digits/feats_test.npz
    python -m vit_jax.probe --train runs/digits/feats_train.npz \
        --test runs/digits/feats_test.npz              # k-NN + linear probe
    python -m vit_jax.features --checkpoint vit_small_patch14_reg4_dinov2.lvd142m \
        --dataset folder:~/photos --out photos.npz     # any folder of images

Any checkpoint :func:`vit_jax.weights.load` accepts (``--patch-size`` and
``--image-size`` as there); ``--dataset`` is a tfds name or
``folder:DIR``, default the run's. A folder is a ``DIR/<split>/<label>/``
tree (every image two levels down; ``--split`` picks one), or any other
folder of images, flat or nested, read whole (sorted by path; no
``--split``), labelled by its first-level subdirectories when every image
is in one (``DIR/<label>/*.jpg``), else unlabelled (label -1)
(:mod:`vit_jax.data.sources`). The data goes through the evaluation
pipeline
(:func:`vit_jax.data.batches.eval_dataset`: resize, center crop, the
weights' mean/std; the last batch padded with ``mask == 0`` examples, which
are dropped), batched over all devices (a ``('data',)`` mesh; each process
reads its own slice), so every example is embedded exactly once; the count
is checked against the split's size. A NaFlex model (SigLIP 2 NaFlex,
timm's ``naflexvit_*``) embeds every image at its own aspect ratio within
its recipe's token budget (``max_seq_len`` patches), one sequence length.

The ``.npz`` holds ``embeddings`` (N, D) float32: the pooled features
before the head (timm's ``forward_head(pre_logits=True)``: the class token
after the final LayerNorm, or the mean / MAP pooling, ``fc_norm`` and
``pre_logits`` where the model has them), ``labels`` (N,) int32 (-1: an
unlabelled folder), ``label_names`` (where there are labels), ``paths``
(N,) str: the file each embedding came from (image folders, and tfds
datasets with a file-name feature), and with ``--patch-grids`` the patch
tokens of one block
(``--layer``, default the last) through the final LayerNorm as a (N, h, w,
D) grid (:meth:`~vit_jax.models.VisionTransformer.forward_intermediates`;
kept in memory: mind N * h * w * D). Rows are in the split's order (on
several processes: grouped by process within each batch).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Dict, Optional, Sequence, Union

import numpy as np

from vit_jax import cli, weights


def make_feature_fn(model, grid_layer: Optional[int] = None) -> Callable:
  """``fn(variables, images) -> (embeddings (B, D), grids (B, h, w, D) or
  None)``, to be jitted: the pooled pre-logits features, and with
  ``grid_layer`` that block's patch tokens through the final LayerNorm."""

  def pooled(mdl, encoded):
    if mdl.classifier == "unpooled":  # no pooling of its own: patch mean
      if isinstance(encoded, dict):  # NaFlex: of the valid patches
        from vit_jax.models import naflex  # pylint: disable=import-outside-toplevel
        return naflex.masked_mean(
            encoded["patches"][:, mdl.num_prefix_tokens:],
            encoded["patch_valid"])
      return encoded[:, mdl.num_prefix_tokens:].mean(axis=1)
    return mdl.forward_head(encoded, pre_logits=True)

  def features(mdl, images):
    if grid_layer is None:
      return pooled(mdl, mdl.forward_features(images)), None
    encoded, (grid,) = mdl.forward_intermediates(
        images, indices=[grid_layer], norm=True)
    return pooled(mdl, encoded), grid

  def fn(variables, images):
    return model.apply(variables, images, method=features)  # train=False

  return fn


def _eta(seconds: float) -> str:
  seconds = int(round(max(seconds, 0)))
  return f"{seconds // 60}m{seconds % 60:02d}s"


def extract(checkpoint: Union[str, weights.Loaded], *,
            dataset: Optional[str] = None, split: Optional[str] = None,
            data_dir: Optional[str] = None, batch_size: int = 256,
            download: bool = True, model_name: Optional[str] = None,
            image_size: Optional[int] = None,
            patch_size: Optional[int] = None, patch_grids: bool = False,
            layer: int = -1, log_every: int = 20,
            log: Callable[[str], None] = print) -> Dict[str, np.ndarray]:
  """Embeds every example of ``dataset[split]``; returns the arrays of the
  ``.npz`` (see the module docstring). For a training checkpoint,
  ``dataset`` / ``split`` / ``data_dir`` default to its run's (its eval
  split). ``batch_size`` is global (rounded up to a multiple of the device
  count); ``log`` gets a progress line every ``log_every`` batches."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel

  from vit_jax import evaluate, train as train_lib  # pylint: disable=import-outside-toplevel
  from vit_jax.data import batches  # pylint: disable=import-outside-toplevel

  if isinstance(checkpoint, weights.Loaded):
    loaded = checkpoint
  else:
    overrides = {"patch_size": patch_size} if patch_size else {}
    loaded = weights.load(checkpoint, model_name=model_name,
                          image_size=image_size, **overrides)
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size}: expected >= 1")
  config, src = evaluate.eval_source(loaded, dataset, split, data_dir,
                                     download)
  dataset, split = config.dataset, config.eval_split
  model = loaded.model
  if patch_grids and loaded.naflex:
    raise ValueError("--patch-grids: a NaFlex model's images each have a "
                     "patch grid of their own (their aspect ratios); only "
                     "the embeddings are written for it.")
  grid_layer = (cli.resolve_layer(layer, model.num_layers)
                if patch_grids else None)

  # Mesh and input: every device, every process its own slice.
  mesh = train_lib.make_mesh()
  n_dev, n_proc = jax.device_count(), jax.process_count()
  global_batch = -(-int(batch_size) // n_dev) * n_dev
  pre = loaded.preprocessing
  # A NaFlex model: every image at its aspect ratio, within the recipe's
  # token budget, one sequence length.
  ds, num_batches = batches.eval_dataset(
      config, src, local_batch=global_batch // n_proc,
      process_index=jax.process_index(), process_count=n_proc,
      mean=tuple(pre.mean), std=tuple(pre.std),
      naflex=((model.patch_size, int(pre.max_seq_len)) if loaded.naflex
              else None), with_paths=True)
  data_sh = train_lib.batch_sharding(mesh)
  variables = jax.device_put(loaded.variables,
                             NamedSharding(mesh, PartitionSpec()))
  fn = jax.jit(make_feature_fn(model, grid_layer))

  out = {"embeddings": [], "labels": [], "patch_grids": [], "paths": []}
  start = time.time()
  seen = 0
  for step, batch in enumerate(batches.as_numpy(ds), 1):
    # Host values of all processes, in the global batch's row order.
    keep = multihost_utils.process_allgather(batch["mask"], tiled=True) > 0
    labels = multihost_utils.process_allgather(batch["label"], tiled=True)
    inputs = ({k: batch[k] for k in ("patches", "patch_coord", "patch_valid")}
              if loaded.naflex else batch["image"])
    emb, grid = fn(variables, jax.make_array_from_process_local_data(
        data_sh, inputs))
    out["embeddings"].append(np.asarray(
        multihost_utils.process_allgather(emb, tiled=True), np.float32)[keep])
    out["labels"].append(np.asarray(labels, np.int32)[keep])
    if "path" in batch:
      out["paths"].append(_gather_strings(batch["path"])[keep])
    if grid is not None:
      out["patch_grids"].append(np.asarray(
          multihost_utils.process_allgather(grid, tiled=True),
          np.float32)[keep])
    seen += int(keep.sum())
    if log and (step % max(1, log_every) == 0 or step == num_batches):
      took = time.time() - start
      rate = seen / max(took, 1e-9)
      log(f"features: step {step}/{num_batches}, {seen}/{src.num_eval} "
          f"images, {rate:.1f} img/s, ETA "
          f"{_eta((src.num_eval - seen) / max(rate, 1e-9))}")
  if seen != src.num_eval:
    raise RuntimeError(f"Embedded {seen} examples, but {dataset}[{split}] "
                       f"has {src.num_eval}.")
  result = {
      "embeddings": np.concatenate(out["embeddings"]),
      "labels": np.concatenate(out["labels"]),
      "dataset": np.array(str(dataset)), "split": np.array(str(split)),
      "checkpoint": np.array(str(checkpoint) if isinstance(checkpoint, str)
                             else ""),
      "description": np.array(str(loaded.description)),
      "image_size": np.array(int(pre.crop_size)),
      # NaFlex: each image within this many patches (0: a fixed size).
      "max_seq_len": np.array(int(pre.max_seq_len or 0)),
      "seconds": np.array(time.time() - start),
  }
  if out["paths"]:
    result["paths"] = np.concatenate(out["paths"])
  if src.is_folder and not src.label_names:
    names = None  # an unlabelled folder: its labels are -1, no classes
  else:
    names = src.label_names or loaded.label_names
  if names:
    result["label_names"] = np.array([str(n) for n in names])
  if out["patch_grids"]:
    result["patch_grids"] = np.concatenate(out["patch_grids"])
    result["layer"] = np.array(int(grid_layer))
  return result


def _gather_strings(local) -> np.ndarray:
  """This process's strings (bytes) -> every process's, in the global
  batch's row order, as str: UTF-8 bytes padded to the longest, gathered
  like the other columns (jax gathers numbers only)."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  raw = [bytes(b) for b in np.asarray(local).reshape(-1)]
  width = int(np.max(multihost_utils.process_allgather(
      np.array([max([len(b) for b in raw] + [1])], np.int32))))
  codes = np.zeros((len(raw), width + 1), np.uint8)  # +1: a final zero
  for i, b in enumerate(raw):
    codes[i, :len(b)] = np.frombuffer(b, np.uint8)
  codes = np.asarray(multihost_utils.process_allgather(codes, tiled=True))
  return np.array([bytes(row[:np.argmin(row)]).decode("utf-8",
                                                      "surrogateescape")
                   for row in codes])


def save(path: str, arrays: Dict[str, np.ndarray]) -> str:
  """Writes ``arrays`` as an ``.npz`` (no pickled objects: ``np.load(path,
  allow_pickle=False)`` reads it)."""
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  np.savez(path, **arrays)
  return path if path.endswith(".npz") else path + ".npz"


def _parser():
  ap = cli.parser("vit_jax.features",
                  "Embeddings (and optionally patch grids) of every example "
                  "of a dataset split, batched over all devices, to .npz.")
  cli.add_checkpoint(ap)
  cli.add_dataset(ap)
  ap.add_argument("--out", required=True, help="output .npz file")
  ap.add_argument("--patch-grids", action="store_true",
                  help="also store one block's (N, h, w, D) patch tokens")
  ap.add_argument("--layer", type=int, default=-1,
                  help="block of --patch-grids (0-based; -1 = last)")
  ap.add_argument("--log-every", type=int, default=20,
                  help="progress line every this many batches")
  return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
  from vit_jax.data import console  # pylint: disable=import-outside-toplevel
  console.lean_start_up()
  console.quiet_native_logs()
  args = _parser().parse_args(argv)

  def log(line):
    print(line, file=sys.stderr, flush=True)

  try:
    arrays = extract(
        args.checkpoint, dataset=args.dataset, split=args.split,
        data_dir=args.data_dir, batch_size=args.batch_size,
        download=not args.no_download, model_name=args.model,
        image_size=args.image_size, patch_size=args.patch_size,
        patch_grids=args.patch_grids, layer=args.layer,
        log_every=args.log_every, log=log)
  except cli.USER_ERRORS as e:
    cli.error(e)
    return 1
  import jax  # pylint: disable=import-outside-toplevel
  if jax.process_index() == 0:
    path = save(args.out, arrays)
    e = arrays["embeddings"]
    print(f"{path}: {e.shape[0]} embeddings of width {e.shape[1]} from "
          f"{arrays['dataset']}[{arrays['split']}]"
          + (f", patch grids {arrays['patch_grids'].shape[1:3]}"
             if "patch_grids" in arrays else "")
          + f" in {float(arrays['seconds']):.1f}s")
  return 0


if __name__ == "__main__":
  from vit_jax.data import console  # pylint: disable=ungrouped-imports
  console.one_line_warnings()
  sys.exit(main())
