"""Compile time of the train step, nn.scan vs unrolled layers, by depth.

    .venv/bin/python bench/compile_time.py --model vit_b_16 --depth 1 2 4 8 12 24
    .venv/bin/python bench/compile_time.py --png docs/images/compile_time.png

For each depth the train step (forward, backward, AdamW) is traced,
lowered and compiled from shapes only (nothing runs), with
``scan_layers=True`` and ``False`` alternately, ``--repeats`` times each
(caches cleared in between); the table shows the fastest of the repeats of
trace+lower and of XLA compile. With ``nn.scan`` the program holds one block
body whatever the depth, so its compile time stays flat; unrolled, it grows
linearly with depth.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from bench import machine  # noqa: E402
from bench import steps  # noqa: E402
from vit_jax.data import console  # noqa: E402
from vit_jax import models  # noqa: E402


def measure(name, depth, scan, batch, image_size, remat=None):
  jax.clear_caches()
  model = models.get_model(name, num_layers=depth, scan_layers=scan,
                           remat_policy=remat)
  tx = steps.adamw()
  args = steps.abstract_train_args(model, tx, batch, image_size)
  t0 = time.perf_counter()
  lowered = steps.make_train_step(model, tx).lower(*args)
  t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}


def main(argv=None):
  console.quiet_native_logs()
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="vit_b_16")
  p.add_argument("--depth", type=int, nargs="+", default=[1, 2, 4, 8, 12, 24])
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--remat", default=None, help="remat policy for both")
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--png", help="also plot compile time vs depth to this file")
  p.add_argument("--json", action="store_true")
  args = p.parse_args(argv)

  rows = []
  for depth in args.depth:
    best = {}
    for r in range(args.repeats):
      for scan in ((True, False) if r % 2 == 0 else (False, True)):
        print(f"[compile] {args.model} depth {depth} "
              f"{'scan' if scan else 'unrolled'} (repeat {r + 1}) ...",
              file=sys.stderr, flush=True)
        m = measure(args.model, depth, scan, args.batch, args.image_size,
                    args.remat)
        b = best.setdefault(scan, m)
        for k in m:
          b[k] = min(b[k], m[k])
    rows.append({"depth": depth, "scan": best[True], "unrolled": best[False],
                 "ratio": best[True]["total_s"] / best[False]["total_s"]})

  print("\n" + machine.describe())
  print(f"{args.model} train step (fwd+bwd+AdamW), batch {args.batch}, "
        f"{args.image_size}px: seconds (best of {args.repeats}), "
        f"trace+lower / XLA compile / total")
  print(f"{'depth':>5s} {'scan':>22s} {'unrolled':>22s} {'scan/unrolled':>14s}")
  for r in rows:
    s, u = r["scan"], r["unrolled"]
    print(f"{r['depth']:5d} {s['lower_s']:6.1f} {s['compile_s']:6.1f} "
          f"{s['total_s']:7.1f}  {u['lower_s']:6.1f} {u['compile_s']:6.1f} "
          f"{u['total_s']:7.1f}  {r['ratio']:13.2f}")
  if args.png:
    plot(rows, args, args.png)
    print(f"wrote {args.png}")
  if args.json:
    print(json.dumps({"model": args.model, "batch": args.batch,
                      "image_size": args.image_size, "rows": rows}))
  return rows


def plot(rows, args, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(6, 4))
  d = [r["depth"] for r in rows]
  ax.plot(d, [r["unrolled"]["total_s"] for r in rows], "o-",
          label="unrolled (encoderblock_0..N-1)")
  ax.plot(d, [r["scan"]["total_s"] for r in rows], "s-",
          label="nn.scan (scan_layers=True)")
  ax.set(xlabel="encoder depth (layers)",
         ylabel="trace + lower + compile (s)",
         title=f"{args.model} train step compile time")
  ax.grid(alpha=0.3)
  ax.legend()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  main()
