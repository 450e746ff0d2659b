"""The 2026 families (issue 21) against timm eager on the same weights:
inference, alternating rounds (bench/harness.py), e.g. DINOv3-S/16 and
EVA-02-T at 224 px.

timm's model is built by name (random weights, its head given weights so the
logits mean something) and saved; JAX loads the same weights with
``formats.from_timm(state_dict, name)``, RoPE and all. The table gives img/s,
the per-round paired ratio, the CPU-time ratio (CPU-seconds per image:
the load-robust cross-check on a shared machine) and the largest logit
difference.

    .venv/bin/python bench/families.py --model vit_small_patch16_dinov3 \\
        --model eva02_tiny_patch14_224 --batch 8 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from bench import machine  # noqa: E402
from vit_jax.data import console  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", action="append", metavar="TIMM_NAME",
                 help="timm model name (repeatable); default DINOv3-S/16 and "
                      "EVA-02-T")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--round-seconds", type=float, default=3.0)
  p.add_argument("--quiet-load", type=float, default=0.3)
  p.add_argument("--max-retries", type=int, default=1)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS")
  p.add_argument("--json", action="store_true")
  machine.add_isa_arg(p)
  return p


def run_one(name: str, args) -> dict:
  workload = harness.Workload(
      name=name, mode="infer", dtype=args.dtype, batch=args.batch,
      image_size=args.image_size, warmup=args.warmup, timm=True)
  contestants = [harness.Contestant("jax", "jax"),
                 harness.Contestant("timm", "torch")]
  return harness.run(workload, contestants, rounds=args.rounds,
                     round_s=args.round_seconds, quiet_load=args.quiet_load,
                     max_retries=args.max_retries,
                     wait_quiet_s=args.wait_quiet, reference="timm")


def format_table(results) -> str:
  first = next(iter(results.values()))
  w = first["workload"]
  lines = [machine.describe(first["machine"]),
           *([first["isa_line"]] if first.get("isa_line") else []),
           f"inference, {w['dtype']}, batch {w['batch']}, {w['image_size']}x"
           f"{w['image_size']}; {len(first['rounds'])} alternating rounds; "
           f"{first['cpu_count']} CPUs",
           "",
           f"{'model':32s} {'JAX img/s':>10s} {'timm img/s':>11s} "
           f"{'ratio [min-max]':>20s} {'CPU-time ratio':>15s} "
           f"{'others':>7s} {'max |dlogit|':>13s}"]
  for name, res in results.items():
    jx, tm = res["contestants"]["jax"], res["contestants"]["timm"]
    r, cr = jx["ratio_vs_reference"], jx["cpu_ratio_vs_reference"]
    lines.append(
        f"{name:32s} {jx['img_per_sec']['median']:10.2f} "
        f"{tm['img_per_sec']['median']:11.2f} "
        f"{r['median']:7.2f}x [{r['min']:.2f}-{r['max']:.2f}] "
        f"{cr['median']:14.2f}x {jx['other_load']['median']:7.2f} "
        f"{jx.get('check_max_abs_diff', float('nan')):13.2e}")
  lines += ["", "ratio = JAX img/s / timm img/s (median of per-round paired "
            "ratios); CPU-time ratio = timm CPU-s per image / JAX's; others "
            "= cores used by other processes meanwhile (median)."]
  return "\n".join(lines)


def main(argv=None):
  console.quiet_native_logs()
  args = build_parser().parse_args(argv)
  isa_line = machine.set_isa(args.isa)
  names = args.model or ["vit_small_patch16_dinov3", "eva02_tiny_patch14_224"]
  results = {name: dict(run_one(name, args), isa_line=isa_line)
             for name in names}
  table = format_table(results)
  if args.json:
    print(table, file=sys.stderr)
    print(json.dumps(results))
  else:
    print(table)
  return results


if __name__ == "__main__":
  main()
