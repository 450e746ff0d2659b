"""A/B of JAX configurations: which is faster, smaller, or the same program.

    python bench/ab.py --config "old:src=/tmp/base" --config "new:" --processes 2
    python bench/ab.py --in-process --model vit_ti_16 --mode train --batch 16 \
        --config "default:" --config "memopt:flags=--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
    python bench/ab.py --in-process --steps 0 --mode train --batch 32 \
        --config "none:" --config "dots:opt.remat_policy=dots"
    python bench/ab.py --same-graph --config "main:src=/tmp/base" --config "new:"

``--config LABEL:KEY=VALUE;...`` (the first is the reference): ``flags=``
XLA_FLAGS (in-process: compile options), ``src=PATH`` vit_jax from another
checkout, ``opt.FIELD=V`` a model override, ``donate=false``,
``release_wait=false`` (worker.ReleaseWait), ``env.NAME=V``,
``input=square|naflex_square|naflex`` (in-process: a NaFlex model's inputs
of one token count). ``--in-process`` resolves ~2 % where processes differ
by 10 %; its medians skip steps that faulted their pages in. The modes:
bench/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from typing import Any, Dict, List

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import (  # noqa: E402
    bench as bench_lib, harness, machine)
from vit_jax.data import console  # noqa: E402

FAULTED = 1000  # page faults that make a step "faulted" (fresh memory)
INPUTS = ("square", "naflex_square", "naflex")


def parse_config(text: str) -> harness.Contestant:
  label, _, rest = text.partition(":")
  options: Dict[str, Any] = {"model_overrides": {}}
  flags, env = [], {}
  for item in filter(None, (s.strip() for s in rest.split(";"))):
    k, _, v = item.partition("=")
    if k == "flags":
      flags.append(v)
    elif k == "src":
      options["src"] = os.path.abspath(v)
    elif k in ("donate", "release_wait"):
      options[k] = v.lower() in ("1", "true", "yes")
    elif k == "input" and v in INPUTS:
      options["input"] = v
    elif k.startswith("env."):
      env[k[4:]] = v
    elif k.startswith("opt."):
      options["model_overrides"].update(bench_lib.parse_overrides([item[4:]]))
    else:
      raise ValueError(f"unknown key {k!r} (or value) in --config {text!r}")
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
  """Per config, over its processes: each one's median img/s and paired
  ratio against the reference's first process; their median and range."""
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


# --in-process.
def compile_options(flags: str) -> Dict[str, Any]:
  """``--xla_a=true --xla_b=3 --xla_c=NAME`` -> ``{"xla_a": True,
  "xla_b": 3, "xla_c": "NAME"}``: XLA_FLAGS as jax.jit compile options."""
  bad = [f for f in flags.split() if not f.startswith("--") or "=" not in f]
  if bad:
    raise ValueError(f"flag {bad[0]!r}: expected --xla_name=value")
  return {k: str(v).lower() == "true" if str(v).lower() in ("true", "false")
          else v
          for k, v in bench_lib.parse_overrides(
              f[2:] for f in flags.split()).items()}


def inprocess_config(c: harness.Contestant, common: Dict[str, Any],
                     own_process: bool = False):
  """One config as the in-process child takes it (src= and env. only in a
  process of its own)."""
  if (c.env or "src" in c.options) and not own_process:
    raise ValueError(f"--config {c.label!r}: src= and env. need a process of "
                     f"their own; compare them without --in-process")
  return {"label": c.label, "compiler_options": compile_options(c.xla_flags),
          "model_overrides": dict(common, **c.options["model_overrides"]),
          "donate": c.options.get("donate", True),
          "input": c.options.get("input", "square")}


def summarize(times: Dict[str, List[float]], faults: Dict[str, List[int]],
              reference: str) -> Dict[str, Dict[str, Any]]:
  """Per config: median step time over its clean steps, the steps that
  faulted, the paired ratio (its time / the reference's in the same
  rotation, both clean) with its range."""
  out = {}
  for k in times:
    clean = [t for t, f in zip(times[k], faults[k]) if f < FAULTED]
    pairs = [t / r for t, r, f, g in zip(times[k], times[reference],
                                         faults[k], faults[reference])
             if f < FAULTED and g < FAULTED]
    out[k] = {"median_s": statistics.median(clean) if clean else None,
              "steps": len(times[k]), "faulted": len(times[k]) - len(clean),
              **({"time_ratio": statistics.median(pairs),
                  "time_ratio_min": min(pairs), "time_ratio_max": max(pairs)}
                 if pairs else {"time_ratio": None})}
  return out


def format_inprocess(res: Dict[str, Any], spec: Dict[str, Any]) -> str:
  ref, mib = spec["configs"][0]["label"], 2 ** 20
  lines = [f"{spec['name']} {spec['mode']} {spec['dtype']} batch "
           f"{spec['batch']} {spec['image_size']}px, one process; compiled "
           f"from shapes (XLA memory analysis, MiB)" + (
               f", then {spec['steps']} steps each in rotation; medians "
               f"over steps that faulted < {FAULTED} pages"
               if spec["steps"] else ""),
           f"{'config':14s} {'lower s':>8s} {'compile s':>9s} "
           f"{'peak MiB':>9s} {'temp MiB':>9s}" + (
               f" {'ms/step':>9s} {'img/s':>8s} {'time / ' + ref:>26s} "
               f"{'faulted':>8s} {'check':>12s}" if spec["steps"] else "")]
  for lab, inf in res["info"].items():
    m = inf["memory"]
    line = (f"{lab:14s} {inf['lower_s']:8.2f} {inf['compile_s']:9.2f} "
            f"{m['peak'] / mib:9.0f} {m['temp'] / mib:9.0f}")
    c = res.get("summary", {}).get(lab)
    if c:
      med = c["median_s"] or float("nan")
      ratio = ("-" if c["time_ratio"] is None else
               f"{c['time_ratio']:.3f} [{c['time_ratio_min']:.2f}-"
               f"{c['time_ratio_max']:.2f}]")
      line += (f" {1e3 * med:9.1f} {spec['batch'] / med:8.2f} {ratio:>26s} "
               f"{c['faulted']:>4d}/{c['steps']:<3d} {inf['check']:12.6g}")
    lines.append(line)
  if spec["steps"]:
    lines.append("time / ref: the median over rotations of a config's step "
                 "time over the reference's (below 1: faster)")
  return "\n".join(lines)


def same_graph(spec, cs, common):
  """Each config lowered in a child of its own (bench/worker.py's
  ``inprocess``, nothing compiled): the hashes of their StableHLO."""
  got = {c.label: harness.call("inprocess", dict(
      spec, lower_only=True, src=c.options.get("src"),
      configs=[inprocess_config(c, common, True)]), env=c.env)["info"][
          c.label]["hash"] for c in cs}
  same = len(set(got.values())) == 1
  return got, "\n".join([f"{spec['mode']} step, lowered StableHLO:"] + [
      f"  {k:14s} {h}" for k, h in got.items()] + [
          "same program" if same else "DIFFERENT programs"])


def main(argv=None):
  console.lean_start_up()
  console.quiet_native_logs()
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="vit_b_16")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--config", action="append", required=True)
  p.add_argument("--processes", type=int, default=1, metavar="N",
                 help="run each config in N child processes")
  p.add_argument("--in-process", action="store_true",
                 help="every config in one child, stepped in rotation")
  p.add_argument("--steps", type=int, default=30,
                 help="--in-process: timed steps of each config (0: compile "
                      "only)")
  p.add_argument("--same-graph", action="store_true",
                 help="compare the configs' lowered programs, nothing run")
  bench_lib.add_run_args(p, rounds=6, round_s=3.0, retries=1)
  args = p.parse_args(argv)
  isa_line = machine.set_isa(args.isa)
  base = [parse_config(c) for c in args.config]
  common = bench_lib.parse_overrides(args.jax_opt)
  w = harness.Workload(name=args.model, mode=args.mode, dtype=args.dtype,
                       batch=args.batch, image_size=args.image_size,
                       warmup=args.warmup,
                       layers=int(common.get("num_layers", 0)))
  if args.same_graph:
    res, table = same_graph(dict(w.spec(), steps=0), base, common)
  elif args.in_process:
    spec = dict(w.spec(), steps=args.steps,
                configs=[inprocess_config(c, common) for c in base])
    harness.log(f"[ab] compiling {len(base)} configurations in one child")
    res = harness.call("inprocess", spec)
    if args.steps:
      res["summary"] = summarize(res["times"], res["faults"], base[0].label)
    table = format_inprocess(res, spec)
  else:
    for c in base:
      c.options["model_overrides"] = dict(common,
                                          **c.options["model_overrides"])
      if "input" in c.options:
        raise ValueError(f"--config {c.label!r}: input= runs --in-process")
    cs = replicate(base, args.processes)
    res = harness.run(w, cs, args, reference=cs[0].label)
    res["gemms"] = gemms = machine.gemms_for(
        args, [(args.model, w.batch, w.image_size)], dtypes=(w.dtype,))
    gflop = machine.step_flops(w.variant(), w.image_size, w.mode) / 1e9
    table = "\n".join([
        f"{w.name} {w.mode} {w.dtype} batch {w.batch} {w.image_size}px, "
        f"{args.rounds} alternating rounds, load avg "
        f"{res['load_avg_1m']:.1f}"] + bench_lib.rows(res, gflop, gemms) + (
            ["", format_processes(res, [c.label for c in base],
                                  args.processes)]
            if args.processes > 1 else []))
  harness.emit(machine.describe() + "\n" + isa_line + "\n" + table,
               {k: v for k, v in res.items() if k != "times"}, args.json)
  return res


if __name__ == "__main__":
  main()
