"""Peak memory of a compiled train step per batch size, with and without
rematerialisation (XLA's ``compiled.memory_analysis()``; nothing is run).

    .venv/bin/python bench/memory.py --model vit_b_16 --batch 8 16 32 64
    .venv/bin/python bench/memory.py --remat none dots full --png docs/images/memory.png

``peak`` = arguments + outputs - aliased (donated) + temporaries: the bytes
XLA's buffer assignment reserves for one step. Arguments are the parameters,
AdamW's two moments and the batch; temporaries are mostly the activations
kept for the backward pass, which is what ``remat_policy`` trades for
recomputation (``dots``: keep matmul outputs, recompute the rest; ``full``:
keep only each block's input).
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

MiB = 2 ** 20


def measure(name, batch, image_size, remat, scan=True, dtype="float32"):
  overrides = {"scan_layers": scan,
               "remat_policy": None if remat == "none" else remat}
  if dtype == "bfloat16":
    overrides["dtype"] = jax.numpy.bfloat16
  model = models.get_model(name, **overrides)
  tx = steps.adamw()
  args = steps.abstract_train_args(model, tx, batch, image_size)
  t = time.perf_counter()
  compiled = steps.make_train_step(model, tx).lower(*args).compile()
  return dict(steps.peak_bytes(compiled), compile_s=time.perf_counter() - t)


def main(argv=None):
  console.quiet_native_logs()
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="vit_b_16")
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--batch", type=int, nargs="+", default=[8, 16, 32, 64])
  p.add_argument("--remat", nargs="+", default=["none", "dots", "full"],
                 help="remat policies: none, dots, dots_no_batch, full")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  p.add_argument("--unrolled", action="store_true",
                 help="measure the unrolled model (default: nn.scan)")
  p.add_argument("--png", help="also plot peak MiB vs batch to this file")
  p.add_argument("--json", action="store_true")
  args = p.parse_args(argv)

  rows = []
  for remat in args.remat:
    for b in args.batch:
      print(f"[memory] {args.model} batch {b} remat {remat} ...",
            file=sys.stderr, flush=True)
      r = measure(args.model, b, args.image_size, remat, not args.unrolled,
                  args.dtype)
      rows.append(dict(r, model=args.model, batch=b, remat=remat,
                       image_size=args.image_size, dtype=args.dtype))

  print("\n" + machine.describe())
  print(f"{args.model} train step (AdamW), {args.image_size}px, "
        f"{args.dtype}, {'unrolled' if args.unrolled else 'nn.scan'}; "
        f"XLA memory_analysis, MiB")
  print(f"{'remat':>6s} {'batch':>6s} {'peak':>9s} {'temp':>9s} "
        f"{'args':>9s} {'out-alias':>9s} {'temp/img':>9s}")
  for r in rows:
    print(f"{r['remat']:>6s} {r['batch']:6d} {r['peak'] / MiB:9.0f} "
          f"{r['temp'] / MiB:9.0f} {r['argument'] / MiB:9.0f} "
          f"{(r['output'] - r['alias']) / MiB:9.0f} "
          f"{r['temp'] / MiB / r['batch']:9.1f}")
  if args.png:
    plot(rows, args.png)
    print(f"wrote {args.png}")
  if args.json:
    print(json.dumps(rows))
  return rows


def plot(rows, path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(6, 4))
  for remat in dict.fromkeys(r["remat"] for r in rows):
    rs = [r for r in rows if r["remat"] == remat]
    ax.plot([r["batch"] for r in rs], [r["peak"] / 2 ** 30 for r in rs],
            "o-", label=f"remat={remat}")
  r0 = rows[0]
  ax.set(xlabel="batch size", ylabel="peak memory of one step (GiB)",
         title=f"{r0['model']} train step, {r0['image_size']}px, "
               f"{r0['dtype']}")
  ax.set_xscale("log", base=2)
  ax.grid(alpha=0.3)
  ax.legend()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  main()
