r"""Top-1 / top-5 accuracy of a checkpoint on a tfds split.

    python -m vit_jax.evaluate --checkpoint /tmp/digits      # its own test split
    python -m vit_jax.evaluate --checkpoint vit_b_16.pth --model vit_b_16 \
        --dataset imagenet2012 --split validation --data-dir ~/tensorflow_datasets

The data goes through the training pipeline's eval path
(:func:`vit_jax.data.batches.eval_dataset`: resize the short side, center
crop, normalise with the weights' mean/std; the last batch padded with
``mask == 0`` examples) and training's eval step and loop
(:func:`vit_jax.train.step.evaluate`), so every example of the split is
counted exactly once. The resize/crop and mean/std are those of the weights
(a run's own config; torchvision's 256 -> 224 and ImageNet statistics; 0.5 /
0.5 for Google and timm weights). Label indices must follow the dataset's
order (for ImageNet weights on tfds ``imagenet2012`` they do).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Optional, Sequence, Union

from vit_jax import cli, weights
from vit_jax.data import console


def _eval_config(dataset: str, split: str, data_dir: Optional[str],
                 download: bool, loaded: weights.Loaded):
  import ml_collections  # pylint: disable=import-outside-toplevel

  pre = loaded.preprocessing
  return ml_collections.ConfigDict({
      "dataset": dataset, "data_dir": data_dir, "download": download,
      # Only the evaluated split is read (get_source also checks the train
      # split, so it is the same one).
      "train_split": split, "eval_split": split,
      "image_size": int(pre.crop_size), "cache": False, "prefetch": 2,
      "pp": {"eval_crop_fraction": float(pre.crop_size) / float(pre.resize_size)},
      "flags": ("--data-dir", "--no-download was given"),  # named in errors
  })


def eval_source(loaded: weights.Loaded, dataset: Optional[str] = None,
                split: Optional[str] = None, data_dir: Optional[str] = None,
                download: bool = True, needs_head: bool = False):
  """(config, :class:`~vit_jax.data.sources.DataSource`) of
  ``dataset[split]`` as the evaluation pipeline reads it for ``loaded``
  (its preprocessing's crop and resize). For a training checkpoint,
  ``dataset`` / ``split`` / ``data_dir`` default to its run's (its eval
  split); ``needs_head``: refuse a model without a classification head."""
  from vit_jax.data import batches, sources  # pylint: disable=import-outside-toplevel

  run = loaded.info.get("config") or {}  # a training run's config
  dataset = dataset or run.get("dataset")
  if data_dir is None:
    data_dir = run.get("data_dir")
  if not dataset:
    raise ValueError("Which dataset? Pass --dataset (dataset=), e.g. "
                     "'imagenet2012' with split 'validation', or "
                     "'folder:/path/to/images'.")
  if needs_head and not loaded.num_classes:  # a backbone, or an embedding
    raise ValueError(f"{loaded.description}: {loaded.head_summary()}, so "
                     f"there is no class accuracy to evaluate. Its "
                     f"embeddings' k-NN and linear-probe accuracy: python -m "
                     f"vit_jax.features, then python -m vit_jax.probe.")
  flags = ("--data-dir", "--no-download was given")
  builder = sources.get_builder(dataset, data_dir, download, flags)
  if isinstance(builder, sources.ImageFiles):  # one split: all of it
    split = split or sources.ALL_SPLIT
  else:
    split = split or run.get("eval_split") or "test"
  config = _eval_config(dataset, split, data_dir, download, loaded)
  return config, sources.get_source(config, builder)


def evaluate(checkpoint: Union[str, weights.Loaded], *,
             dataset: Optional[str] = None, split: Optional[str] = None,
             data_dir: Optional[str] = None, batch_size: int = 256,
             download: bool = True, model_name: Optional[str] = None,
             image_size: Optional[int] = None) -> dict:
  """Evaluates a checkpoint on ``dataset[split]``.

  For a training checkpoint, ``dataset`` / ``split`` / ``data_dir`` default
  to its run's. Returns a dict with ``top1``, ``top5`` (fractions),
  ``loss`` (mean cross-entropy), ``correct``, ``correct5``, ``count`` (=
  the number of examples in the split), ``dataset``, ``split``, ``seconds``.
  """
  import jax  # pylint: disable=import-outside-toplevel

  from vit_jax.data import batches, sources  # pylint: disable=import-outside-toplevel
  from vit_jax.train import step as train_step  # pylint: disable=import-outside-toplevel

  loaded = (checkpoint if isinstance(checkpoint, weights.Loaded) else
            weights.load(checkpoint, model_name=model_name,
                         image_size=image_size))
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size}: expected >= 1")
  config, src = eval_source(loaded, dataset, split, data_dir, download,
                            needs_head=True)
  dataset, split = config.dataset, config.eval_split
  num_classes = loaded.num_classes
  if not src.num_classes:
    raise ValueError(
        f"{dataset!r} has no labels (a folder's images are labelled by "
        f"their subdirectories: DIR/<label>/ or DIR/<split>/<label>/), so "
        f"there is nothing to score; its embeddings: python -m "
        f"vit_jax.features.")
  if src.num_classes != num_classes:
    raise ValueError(
        f"The model has {num_classes} classes but {dataset!r} has "
        f"{src.num_classes}: this checkpoint was not trained for it.")
  pre = loaded.preprocessing
  ds, num_batches = batches.eval_dataset(  # uint8 images (or patches)
      config, src, local_batch=int(batch_size), process_index=0,
      process_count=1,
      naflex=((loaded.model.patch_size, int(pre.max_seq_len))
              if loaded.naflex else None))
  eval_step = jax.jit(train_step.make_eval_step(
      loaded.model, num_classes, mean=tuple(pre.mean), std=tuple(pre.std)))
  start = time.time()
  totals = train_step.evaluate(eval_step, loaded.variables["params"],
                               loaded.variables.get("batch_stats", {}),
                               batches.as_numpy(ds))
  count = int(round(totals["count"]))
  if count != src.num_eval:
    raise RuntimeError(f"Counted {count} examples, but {dataset}[{split}] has "
                       f"{src.num_eval}.")
  return {
      "dataset": dataset, "split": split, "count": count,
      "top1": totals["correct"] / max(count, 1),
      "top5": totals["correct5"] / max(count, 1),
      "correct": int(round(totals["correct"])),
      "correct5": int(round(totals["correct5"])),
      "top5_k": min(5, num_classes),
      "loss": totals["loss"] / max(count, 1), "batches": int(num_batches),
      "batch_size": int(batch_size), "seconds": time.time() - start,
  }


def format_result(r: dict) -> str:
  k = r["top5_k"]
  return (f"{r['dataset']}[{r['split']}]: top-1 {100 * r['top1']:.2f}% "
          f"({r['correct']}/{r['count']}), top-{k} {100 * r['top5']:.2f}% "
          f"({r['correct5']}/{r['count']}), loss {r['loss']:.4f} "
          f"[{r['count']} examples in {r['batches']} batches of "
          f"{r['batch_size']}, {r['seconds']:.1f}s]")


def _parser():
  ap = cli.parser("vit_jax.evaluate",
                  "Top-1/top-5 accuracy of a ViT checkpoint on a tfds split.")
  cli.add_checkpoint(ap)
  cli.add_dataset(ap, what="split to evaluate")
  ap.add_argument("--json", action="store_true", help="print a JSON object")
  return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
  console.lean_start_up()
  console.quiet_native_logs()
  args = _parser().parse_args(argv)

  def run():
    result = evaluate(cli.load(args), dataset=args.dataset, split=args.split,
                      data_dir=args.data_dir, batch_size=args.batch_size,
                      download=not args.no_download)
    print(json.dumps(result) if args.json else format_result(result))
    return 0
  return cli.run(run)


if __name__ == "__main__":
  console.one_line_warnings()
  sys.exit(main())
