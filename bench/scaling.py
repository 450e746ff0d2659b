"""Scaling study: throughput and cost as batch size, resolution and model size
grow, JAX and torch side by side, analytic FLOPs beside the measured time.

    .venv/bin/python bench/scaling.py --png docs/images/scaling.png
    .venv/bin/python bench/scaling.py --sweep resolution --rounds 5
    .venv/bin/python bench/scaling.py --mode train --no-torch

Every point is one alternating run of ``bench/harness.py`` (the same one
``bench/bench.py`` does), so each JAX/torch pair is measured seconds apart.
Three sweeps (``--sweep``, default all):

  batch       vit_b_16, 224 px, batch 1 .. 32
  resolution  vit_b_16, batch 4, 224 -> 384 -> 512 px (197 -> 577 -> 1025
              tokens). The table splits the analytic FLOPs into the part
              linear in the number of tokens (projections, MLP) and the
              quadratic attention products (QK^T, AV), and gives the time
              per image the 224-px point predicts if time followed FLOPs.
  model       vit_ti/s/b/l_16, batch 8, 224 px
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import flops as flops_lib  # noqa: E402
from bench import harness  # noqa: E402
from bench import machine  # noqa: E402
from vit_jax.data import console  # noqa: E402
from vit_jax import models  # noqa: E402

SWEEPS = {
    "batch": [dict(name="vit_b_16", batch=b, image_size=224)
              for b in (1, 2, 4, 8, 16, 32)],
    "resolution": [dict(name="vit_b_16", batch=4, image_size=s)
                   for s in (224, 384, 512)],
    "model": [dict(name=n, batch=8, image_size=224)
              for n in ("vit_ti_16", "vit_s_16", "vit_b_16", "vit_l_16")],
}


def run_point(point, args):
  workload = harness.Workload(mode=args.mode, dtype=args.dtype, **point)
  cs = [harness.Contestant("jax", "jax")]
  if not args.no_torch:
    cs.append(harness.Contestant("torch", "torch"))
  res = harness.run(workload, cs, rounds=args.rounds,
                    round_s=args.round_seconds, quiet_load=args.quiet_load,
                    wait_quiet_s=args.wait_quiet)
  v = models.decode_variant(point["name"])
  fb = flops_lib.vit_forward_flops(image_size=point["image_size"],
                                   **dataclasses.asdict(v))
  mult = 3.0 if args.mode == "train" else 1.0
  row = dict(point, mode=args.mode, dtype=args.dtype, tokens=fb.tokens,
             gflop_per_image=fb.total * mult / 1e9,
             attention_gflop=fb.attention * mult / 1e9,
             attention_fraction=fb.attention_fraction,
             load_avg_1m=res["load_avg_1m"])
  for lab, c in res["contestants"].items():
    ips = c["img_per_sec"]["median"]
    row[f"{lab}_img_per_sec"] = ips
    row[f"{lab}_img_per_sec_min"] = c["img_per_sec"]["min"]
    row[f"{lab}_img_per_sec_max"] = c["img_per_sec"]["max"]
    row[f"{lab}_ms_per_image"] = 1000.0 / ips
    row[f"{lab}_gflop_per_sec"] = row["gflop_per_image"] * ips
  if "torch" in res["contestants"]:
    r = res["contestants"]["jax"]["ratio_vs_reference"]
    row["ratio"], row["ratio_min"], row["ratio_max"] = (r["median"], r["min"],
                                                        r["max"])
  return row


def print_table(sweep, rows, best=None):
  """One sweep's table; ``best``: the roofline (:func:`machine.roofline`)
  for the '% GEMM' columns."""
  has_torch = "torch_img_per_sec" in rows[0]
  print(f"\n## {sweep} ({rows[0]['mode']}, {rows[0]['dtype']})")
  head = (f"{'model':10s} {'batch':>5s} {'px':>4s} {'tokens':>6s} "
          f"{'GFLOP/img':>9s} {'attn%':>6s} {'jax img/s':>10s} "
          f"{'jax ms/img':>10s} {'jax GFLOP/s':>11s} {'% GEMM':>6s}")
  if has_torch:
    head += (f" {'torch img/s':>11s} {'torch GFLOP/s':>13s} {'% GEMM':>6s}"
             f" {'ratio':>17s}")
  if sweep == "resolution":
    head += f" {'jax ms/img if ~FLOPs':>20s}"
  print(head)
  base = rows[0]
  for r in rows:
    line = (f"{r['name']:10s} {r['batch']:5d} {r['image_size']:4d} "
            f"{r['tokens']:6d} {r['gflop_per_image']:9.1f} "
            f"{100 * r['attention_fraction']:5.1f}% "
            f"{r['jax_img_per_sec']:10.2f} {r['jax_ms_per_image']:10.1f} "
            f"{r['jax_gflop_per_sec']:11.0f} "
            f"{machine.percent_of(r['jax_gflop_per_sec'], best):>6s}")
    if has_torch:
      line += (f" {r['torch_img_per_sec']:11.2f} "
               f"{r['torch_gflop_per_sec']:13.0f} "
               f"{machine.percent_of(r['torch_gflop_per_sec'], best):>6s} "
               f"{r['ratio']:6.2f}x [{r['ratio_min']:.2f}-"
               f"{r['ratio_max']:.2f}]")
    if sweep == "resolution":
      pred = base["jax_ms_per_image"] * r["gflop_per_image"] / base[
          "gflop_per_image"]
      line += f" {pred:20.1f}"
    print(line)


def plot(results, path, mode, dtype):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  sweeps = [s for s in ("batch", "resolution", "model") if s in results]
  fig, axes = plt.subplots(1, len(sweeps), figsize=(5.2 * len(sweeps), 4.2),
                           squeeze=False)
  styles = {"jax": ("o-", "tab:blue", "JAX (this repo)"),
            "torch": ("s-", "tab:orange", "torchvision eager")}
  for ax, sweep in zip(axes[0], sweeps):
    rows = results[sweep]
    labs = [l for l in ("jax", "torch") if f"{l}_img_per_sec" in rows[0]]
    if sweep == "batch":
      x = [r["batch"] for r in rows]
      for l in labs:
        st, col, name = styles[l]
        ax.plot(x, [r[f"{l}_img_per_sec"] for r in rows], st, color=col,
                label=name)
      ax.set_xscale("log", base=2)
      ax.set(xlabel="batch size", ylabel="images / s",
             title=f"{rows[0]['name']}, {rows[0]['image_size']} px")
    elif sweep == "resolution":
      x = [r["image_size"] for r in rows]
      for l in labs:
        st, col, name = styles[l]
        ms = [r[f"{l}_ms_per_image"] for r in rows]
        ax.plot(x, ms, st, color=col, label=name)
        b = rows[0]
        ax.plot(x, [b[f"{l}_ms_per_image"] * r["gflop_per_image"] /
                    b["gflop_per_image"] for r in rows], ":", color=col,
                alpha=0.7, label=f"{name}: if time ~ FLOPs")
      for i, r in enumerate(rows):
        last = i == len(rows) - 1
        ax.annotate(f"{r['tokens']} tok\nattn {100 * r['attention_fraction']:.0f}%"
                    " of FLOPs", (r["image_size"], r["jax_ms_per_image"]),
                    textcoords="offset points", xytext=(-6 if last else 6, 8),
                    ha="right" if last else "left", fontsize=7)
      ax.set(xlabel="image side (px)", ylabel="ms / image",
             title=f"{rows[0]['name']}, batch {rows[0]['batch']}")
    else:
      names = [r["name"].replace("vit_", "").replace("_16", "/16").upper()
               for r in rows]
      x = range(len(rows))
      for l in labs:
        st, col, name = styles[l]
        ax.plot(x, [r[f"{l}_gflop_per_sec"] for r in rows], st, color=col,
                label=name)
      ax.set_xticks(list(x))
      ax.set_xticklabels(names)
      ax.set(xlabel="model", ylabel="achieved GFLOP/s (analytic FLOPs)",
             title=f"batch {rows[0]['batch']}, {rows[0]['image_size']} px")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  cpu = results.get("machine", {}).get("cpu")
  fig.suptitle(f"ViT {mode} ({dtype}), JAX vs PyTorch, "
               + (machine.describe(cpu).replace("CPU: ", "")
                  if cpu else f"{os.cpu_count()} CPU cores"), fontsize=9)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None):
  console.quiet_native_logs()
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sweep", nargs="+", choices=sorted(SWEEPS),
                 default=["batch", "resolution", "model"])
  p.add_argument("--mode", choices=("infer", "train"), default="infer")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--round-seconds", type=float, default=2.0)
  p.add_argument("--quiet-load", type=float, default=0.3)
  p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS")
  p.add_argument("--no-torch", action="store_true")
  p.add_argument("--png", help="write the plot here "
                               "(e.g. docs/images/scaling.png)")
  p.add_argument("--json-out", help="write all rows as JSON here")
  p.add_argument("--from-json", metavar="PATH",
                 help="don't measure: print and plot the rows of an earlier "
                      "--json-out file")
  machine.add_gemm_args(p)
  machine.add_isa_arg(p)
  args = p.parse_args(argv)

  results = {}
  isa_line = None
  if args.from_json:
    with open(args.from_json) as f:
      results = json.load(f)
  else:
    isa_line = machine.set_isa(args.isa)
  points = [] if args.from_json else [
      (s, pt) for s in args.sweep for pt in SWEEPS[s]]
  for i, (sweep, point) in enumerate(points):
    harness.log(f"[scaling {i + 1}/{len(points)}] {sweep}: {point}")
    results.setdefault(sweep, []).append(run_point(point, args))
  if not args.from_json:
    results["machine"] = {"cpu": machine.cpu_info(),
                          "gemms": machine.gemms_for(args),
                          "isa_line": isa_line}
  meta = results.get("machine", {})
  if meta.get("cpu"):
    print(machine.describe(meta["cpu"]))
  if meta.get("isa_line"):
    print(meta["isa_line"])
  if meta.get("gemms"):
    print(machine.format_gemms(meta["gemms"], args.dtype))
  best = machine.roofline(meta.get("gemms"), args.dtype)
  for sweep, rows in results.items():
    if sweep in SWEEPS:
      print_table(sweep, rows, best)
  if args.png:
    plot(results, args.png, args.mode, args.dtype)
    print(f"\nwrote {args.png}")
  if args.json_out and not args.from_json:
    with open(args.json_out, "w") as f:
      json.dump(results, f, indent=1)
    print(f"wrote {args.json_out}")
  return results


if __name__ == "__main__":
  main()
