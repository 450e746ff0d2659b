r"""How good are frozen embeddings? k-NN and linear-probe top-1 accuracy.

    python -m vit_jax.probe --train feats_train.npz --test feats_test.npz

on two ``.npz`` files written by :mod:`vit_jax.features` (``embeddings``
(N, D), ``labels`` (N,)), the two evaluations DINO and DINOv2 report for
frozen features:

* **k-NN** (:func:`knn_accuracy`; Wu et al. 2018, DINO's ``eval_knn.py``):
  embeddings L2-normalised, each test example's ``k`` most cosine-similar
  training examples vote for their labels with weight ``exp(sim / T)``
  (T = 0.07); top-1 (and top-5) of the summed votes. ``--knn-k 10,20``
  evaluates several k (DINO reports 20).
* **linear probe** (:func:`linear_probe_accuracy`): multinomial logistic
  regression (scikit-learn, L-BFGS) on standardised embeddings; the L2
  strength ``C`` is chosen on a stratified 20% of the training set held
  out, then the probe is refit on all of it (CLIP's protocol). Full-batch:
  meant for up to ~10^5 examples; for ImageNet-scale sets use k-NN.

Both files need labels (an unlabelled folder's rows, label -1, are
refused). Where they name their classes differently (two folders labelled
by their own ``<label>/`` subdirectories, one lacking a class), the test
labels are matched to the training ones by name (:func:`align_labels`).
"""

from __future__ import annotations

import json
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from vit_jax import cli

C_GRID = (0.01, 0.1, 1.0, 10.0, 100.0)


def read(path: str) -> Tuple[np.ndarray, np.ndarray]:
  """(embeddings (N, D) float32, labels (N,) int64) of a features .npz
  (read without pickle)."""
  try:
    with np.load(path, allow_pickle=False) as f:
      missing = [k for k in ("embeddings", "labels") if k not in f.files]
      if missing:
        raise ValueError(f"{path}: no {missing} in it (it has {f.files}); "
                         f"expected a file written by python -m "
                         f"vit_jax.features.")
      x, y = np.asarray(f["embeddings"], np.float32), np.asarray(f["labels"])
  except (OSError, EOFError) as e:  # zipfile.BadZipFile is an OSError
    raise ValueError(f"{path}: not a readable .npz ({e})") from None
  if x.ndim != 2 or y.shape != (len(x),):
    raise ValueError(f"{path}: embeddings {x.shape} and labels {y.shape}: "
                     f"expected (N, D) and (N,)")
  return x, y.astype(np.int64)


def read_label_names(path: str) -> Optional[List[str]]:
  """The ``label_names`` of a features .npz, or None."""
  with np.load(path, allow_pickle=False) as f:
    return ([str(n) for n in f["label_names"]] if "label_names" in f.files
            else None)


def _labelled(path: str, y: np.ndarray) -> None:
  n = int((y < 0).sum())
  if n:
    raise ValueError(
        f"{path}: {n} of its {len(y)} embeddings have no label (-1: from a "
        f"folder of images without label subdirectories). k-NN and the "
        f"linear probe need labelled sets: folders laid out as "
        f"DIR/<label>/<image> (or DIR/<split>/<label>/<image>).")


def align_labels(train_names: Optional[Sequence[str]],
                 test_names: Optional[Sequence[str]],
                 test_y: np.ndarray) -> np.ndarray:
  """``test_y`` as indices of ``train_names`` where the two files name
  their classes differently (two folders labelled by their own
  subdirectories: a class missing from one shifts the indices); a
  ValueError for test classes the training set lacks."""
  if not train_names or not test_names or list(train_names) == list(
      test_names):
    return test_y
  index = {n: i for i, n in enumerate(train_names)}
  used = sorted({test_names[i] for i in np.unique(test_y)})
  lacking = [n for n in used if n not in index]
  if lacking:
    raise ValueError(
        f"The test set has classes the training set lacks: {lacking[:10]}"
        f"{' ...' if len(lacking) > 10 else ''}; no k-NN vote or linear "
        f"probe can give them.")
  table = np.array([index.get(n, -1) for n in test_names], np.int64)
  return table[test_y]


def _check(train_x, train_y, test_x, test_y):
  if train_x.shape[1] != test_x.shape[1]:
    raise ValueError(f"Train embeddings have width {train_x.shape[1]}, test "
                     f"{test_x.shape[1]}: from different models?")
  if not len(train_x) or not len(test_x):
    raise ValueError("Empty train or test set.")
  del train_y, test_y


def knn_accuracy(train_x, train_y, test_x, test_y, k: int = 20,
                 temperature: float = 0.07, num_classes: Optional[int] = None,
                 chunk: int = 1024) -> Dict[str, float]:
  """DINO's weighted k-NN classifier; returns ``top1``, ``top5`` (fractions;
  ``top5`` None for k < 5, where fewer than 5 classes get votes) and ``k``.
  Cosine similarities in chunks of ``chunk`` test rows."""
  _check(train_x, train_y, test_x, test_y)
  if not 1 <= k <= len(train_x):
    raise ValueError(f"k={k}: expected 1 <= k <= {len(train_x)} (the "
                     f"training examples)")
  c = int(num_classes or max(train_y.max(), test_y.max()) + 1)
  unit = lambda a: a / np.maximum(  # noqa: E731
      np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
  bank, queries = unit(np.asarray(train_x, np.float32)), unit(
      np.asarray(test_x, np.float32))
  top1 = top5 = 0
  for s in range(0, len(queries), chunk):
    sim = queries[s:s + chunk] @ bank.T  # (q, N)
    idx = np.argpartition(-sim, k - 1, axis=1)[:, :k]
    near = np.take_along_axis(sim, idx, axis=1)
    votes = np.zeros((len(sim), c), np.float64)
    np.add.at(votes, (np.arange(len(sim))[:, None], train_y[idx]),
              np.exp(near.astype(np.float64) / temperature))
    order = np.argsort(-votes, axis=1, kind="stable")
    y = test_y[s:s + chunk, None]
    top1 += int((order[:, :1] == y).any(axis=1).sum())
    top5 += int((order[:, :5] == y).any(axis=1).sum())
  n = len(test_x)
  return {"k": int(k), "top1": top1 / n, "top5": top5 / n if k >= 5 else None}


def linear_probe_accuracy(train_x, train_y, test_x, test_y,
                          c_grid: Sequence[float] = C_GRID, seed: int = 0,
                          max_iter: int = 1000) -> Dict[str, float]:
  """Logistic-regression probe; returns ``top1``, the chosen ``C`` and the
  held-out accuracy of every C tried (``val``)."""
  from sklearn.linear_model import LogisticRegression  # pylint: disable=import-outside-toplevel
  from sklearn.model_selection import train_test_split  # pylint: disable=import-outside-toplevel
  from sklearn.preprocessing import StandardScaler  # pylint: disable=import-outside-toplevel

  _check(train_x, train_y, test_x, test_y)
  counts = np.bincount(train_y)
  stratify = train_y if counts[counts > 0].min() >= 2 else None
  fit_x, val_x, fit_y, val_y = train_test_split(
      train_x, train_y, test_size=0.2, random_state=seed, stratify=stratify)

  def fit(x, y, c):
    scaler = StandardScaler().fit(x)
    clf = LogisticRegression(C=c, max_iter=max_iter, random_state=seed)
    return scaler, clf.fit(scaler.transform(x), y)

  def score(model, x, y):
    scaler, clf = model
    return float((clf.predict(scaler.transform(x)) == y).mean())

  val = {float(c): score(fit(fit_x, fit_y, c), val_x, val_y) for c in c_grid}
  best = max(val, key=lambda c: (val[c], -c))  # ties: the stronger L2
  final = fit(train_x, train_y, best)
  return {"top1": score(final, test_x, test_y), "C": best, "val": val}


def probe(train_path: str, test_path: str, ks: Sequence[int] = (20,),
          temperature: float = 0.07, linear: bool = True) -> dict:
  """Both evaluations on two features files; a JSON-able dict."""
  train_x, train_y = read(train_path)
  test_x, test_y = read(test_path)
  _labelled(train_path, train_y)
  _labelled(test_path, test_y)
  test_y = align_labels(read_label_names(train_path),
                        read_label_names(test_path), test_y)
  result = {"train": train_path, "test": test_path,
            "num_train": len(train_x), "num_test": len(test_x),
            "width": int(train_x.shape[1]),
            "knn": [knn_accuracy(train_x, train_y, test_x, test_y, k,
                                 temperature) for k in ks]}
  if linear:
    result["linear"] = linear_probe_accuracy(train_x, train_y, test_x, test_y)
  return result


def format_result(r: dict) -> str:
  lines = [f"{r['num_test']} test / {r['num_train']} train embeddings of "
           f"width {r['width']}"]
  for knn in r["knn"]:
    top5 = ("" if knn["top5"] is None else
            f", top-5 {100 * knn['top5']:.2f}%")
    lines.append(f"k-NN (k={knn['k']}, cosine, T-weighted): top-1 "
                 f"{100 * knn['top1']:.2f}%{top5}")
  if "linear" in r:
    lin = r["linear"]
    lines.append(f"linear probe (logistic regression, C={lin['C']:g} chosen "
                 f"on 20% of train): top-1 {100 * lin['top1']:.2f}%")
  return "\n".join(lines)


def _parser():
  ap = cli.parser("vit_jax.probe",
                  "k-NN and linear-probe top-1 of frozen embeddings written "
                  "by python -m vit_jax.features.")
  ap.add_argument("--train", required=True, help="features .npz of the bank "
                  "/ the probe's training set")
  ap.add_argument("--test", required=True, help="features .npz to classify")
  ap.add_argument("--knn-k", default="20",
                  help="comma-separated k values (DINO: 20)")
  ap.add_argument("--temperature", type=float, default=0.07)
  ap.add_argument("--no-linear", action="store_true",
                  help="k-NN only (no logistic-regression probe)")
  ap.add_argument("--json", action="store_true", help="print a JSON object")
  return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  try:
    ks = [int(k) for k in args.knn_k.split(",") if k.strip()]
    r = probe(args.train, args.test, ks, args.temperature,
              linear=not args.no_linear)
  except (FileNotFoundError, ValueError) as e:
    cli.error(e)
    return 1
  print(json.dumps(r) if args.json else format_result(r))
  return 0


if __name__ == "__main__":
  from vit_jax.data import console  # pylint: disable=ungrouped-imports
  console.lean_start_up()
  console.one_line_warnings()
  sys.exit(main())
