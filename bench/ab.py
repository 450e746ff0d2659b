"""A/B of JAX configurations, alternating round by round (how each
optimisation in bench/README.md was measured).

Each ``--config`` is ``LABEL:KEY=VALUE;KEY=VALUE...`` with keys
  flags=...     XLA_FLAGS for that child (e.g. flags=--xla_cpu_use_onednn=true)
  src=PATH      import vit_jax from another checkout (e.g. the last commit,
                exported with ``git worktree add /tmp/base HEAD``)
  opt.FIELD=V   a model override (opt.scan_layers=true, opt.remat_policy=dots)
  donate=false  don't donate the train state
  release_wait=false  dispatch each step as soon as the last one's result
                is ready, without waiting for XLA to free its temporaries
                (bench/worker.py's ReleaseWait)
  env.NAME=V    an environment variable for that child
The first config is the reference; ratios are per-round paired ratios.
``--processes N`` runs each config in N child processes (``a``, ``a/2``,
...): alternating rounds cancel a slow spell of the machine, not a slow
process, and on a VM the same config has differed by 0.86x between two
processes (bench/README.md); the summary gives each config's spread over
its processes.

    .venv/bin/python bench/ab.py --model vit_b_16 --mode infer --batch 8 \\
        --config "base:" --config "onednn:flags=--xla_cpu_use_onednn=true"
    .venv/bin/python bench/ab.py --config "old:src=/tmp/base" --config "new:"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import os
import sys

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import flops as flops_lib  # noqa: E402
from bench import harness  # noqa: E402
from bench import machine  # noqa: E402
from vit_jax.data import console  # noqa: E402


def parse_config(text: str) -> harness.Contestant:
  label, _, rest = text.partition(":")
  options = {"model_overrides": {}}
  flags = []
  env = {}
  for item in filter(None, (s.strip() for s in rest.split(";"))):
    k, _, v = item.partition("=")
    if k == "flags":
      flags.append(v)
    elif k == "src":
      options["src"] = os.path.abspath(v)
    elif k in ("donate", "release_wait"):
      options[k] = v.lower() in ("1", "true", "yes")
    elif k.startswith("env."):
      env[k[4:]] = v
    elif k.startswith("opt."):
      try:
        options["model_overrides"][k[4:]] = json.loads(v)
      except json.JSONDecodeError:
        options["model_overrides"][k[4:]] = v
    else:
      raise ValueError(f"unknown key {k!r} in --config {text!r}")
  return harness.Contestant(label, "jax", options=options,
                            xla_flags=" ".join(f for f in flags if f),
                            env=env)


def replicate(cs, processes: int):
  """Each config ``processes`` times: ``a``, ``a/2``, ``a/3``, ..."""
  if processes < 1:
    raise ValueError(f"--processes {processes}: expected 1 or more")
  return [c if i == 0 else dataclasses.replace(c, label=f"{c.label}/{i + 1}")
          for c in cs for i in range(processes)]


def format_processes(res, labels, processes: int) -> str:
  """Per config, over its processes: each process's median img/s and
  paired ratio against the reference's first process, then their median
  and range."""
  if processes < 2:
    return ""
  lines = [f"per config over its {processes} processes (ratio: each "
           f"process against {labels[0]}, the reference's first)"]
  for lab in labels:
    got = [res["contestants"][lab if i == 0 else f"{lab}/{i + 1}"]
           for i in range(processes)]
    rates = [c["img_per_sec"]["median"] for c in got]
    ratios = [c["ratio_vs_reference"]["median"] for c in got]
    lines.append(
        f"{lab:14s} img/s {statistics.median(rates):7.2f} "
        f"[{min(rates):.2f}-{max(rates):.2f}]   vs {labels[0]} "
        f"{statistics.median(ratios):.3f}x [{min(ratios):.2f}-"
        f"{max(ratios):.2f}]   ({', '.join(f'{r:.3f}x' for r in ratios)})")
  return "\n".join(lines)


def format_table(res, reference: str, rounds: int) -> str:
  """The A/B table: throughput, paired ratio against ``reference``, CPU
  time, analytic GFLOP/s and its share of the machine's best GEMM."""
  from vit_jax import models  # pylint: disable=import-outside-toplevel
  w = res["workload"]
  gflop = flops_lib.step_flops(models.decode_variant(w["name"]),
                               w["image_size"], w["mode"],
                               w["num_classes"]) / 1e9
  best = machine.roofline(res.get("gemms"), w["dtype"])
  lines = [
      machine.describe(res["machine"]),
      f"{w['name']} {w['mode']} {w['dtype']} batch {w['batch']} "
      f"{w['image_size']}px, {rounds} alternating rounds, load avg "
      f"{res['load_avg_1m']:.1f}",
      f"{'config':14s} {'img/s':>8s} {'min-max':>15s} "
      f"{'vs ' + reference:>20s} {'cpu ms/img':>10s} {'cpu ratio':>9s} "
      f"{'GFLOP/s':>8s} {'% GEMM':>7s} {'compile':>8s} {'others':>7s}  "
      f"max|diff| vs ref"]
  for lab, c in res["contestants"].items():
    r = c["ratio_vs_reference"]
    diff = c.get("check_max_abs_diff")
    rate = gflop * c["img_per_sec"]["median"]
    lines.append(
        f"{lab:14s} {c['img_per_sec']['median']:8.2f} "
        f"{c['img_per_sec']['min']:7.2f}-{c['img_per_sec']['max']:<7.2f} "
        f"{r['median']:8.3f}x [{r['min']:.2f}-{r['max']:.2f}] "
        f"{c['cpu_ms_per_img']['median']:10.1f} "
        f"{c['cpu_ratio_vs_reference']['median']:8.3f}x "
        f"{rate:8.1f} {machine.percent_of(rate, best):>7s} "
        f"{c['compile_s']:7.1f}s {c['other_load']['median']:7.2f}  "
        f"{'' if diff is None else f'{diff:.1e}'}")
  if res.get("gemms"):
    lines += ["", machine.format_gemms(res["gemms"], w["dtype"])]
  return "\n".join(lines)


def main(argv=None):
  console.quiet_native_logs()
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="vit_b_16")
  p.add_argument("--mode", choices=("infer", "train"), default="infer")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--rounds", type=int, default=6)
  p.add_argument("--round-seconds", type=float, default=3.0)
  p.add_argument("--quiet-load", type=float, default=0.3)
  p.add_argument("--max-retries", type=int, default=1)
  p.add_argument("--cpus", type=lambda v: [int(c) for c in v.split(",")],
                 default=None, metavar="0,1",
                 help="pin both frameworks to these CPUs (default: all)")
  p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS")
  p.add_argument("--config", action="append", required=True)
  p.add_argument("--processes", type=int, default=1, metavar="N",
                 help="run each config in N child processes and give its "
                      "spread over them (a slow process is not cancelled "
                      "by alternating rounds)")
  machine.add_gemm_args(p)
  machine.add_isa_arg(p)
  p.add_argument("--json", action="store_true")
  args = p.parse_args(argv)
  isa_line = machine.set_isa(args.isa)
  base = [parse_config(c) for c in args.config]
  cs = replicate(base, args.processes)
  workload = harness.Workload(name=args.model, mode=args.mode,
                              dtype=args.dtype, batch=args.batch,
                              image_size=args.image_size)
  res = harness.run(workload, cs, rounds=args.rounds,
                    round_s=args.round_seconds, reference=cs[0].label,
                    quiet_load=args.quiet_load, max_retries=args.max_retries,
                    wait_quiet_s=args.wait_quiet, cpus=args.cpus)
  res["gemms"] = machine.gemms_for(args, args.model, args.batch,
                                   args.image_size, dtypes=(args.dtype,))
  res["isa"], res["isa_line"] = args.isa, isa_line
  table = format_table(res, cs[0].label, args.rounds).split("\n", 1)
  print("\n".join([table[0], isa_line] + table[1:]))
  summary = format_processes(res, [c.label for c in base], args.processes)
  if summary:
    print("\n" + summary)
  if args.json:
    print(json.dumps(res))
  return res


if __name__ == "__main__":
  main()
