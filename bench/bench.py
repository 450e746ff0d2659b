"""Benchmark: our JAX ViT against torchvision's, side by side in one run.

    .venv/bin/python bench/bench.py --model vit_b_16 --mode infer --batch 8
    .venv/bin/python bench/bench.py --model vit_ti_16 --mode train --batch 16
    .venv/bin/python bench/bench.py --model vit_b_16 --dtype bfloat16 --json

Both models get the same weights (torchvision's init, converted with
``vit_jax.convert.from_torchvision``) and the same inputs; the table's
``check`` line is the largest logits (or first-step loss) difference.

Each framework runs in its own long-lived child process (torch's OpenMP pool
and XLA's threads slow each other down badly when they share one); rounds
alternate between them (A B, B A, ...), and the headline ratio is the median
of the per-round paired ratios jax/torch, with their min-max as the spread.

What is timed:
  infer  ``jit(model.apply)`` vs ``model.eval()`` under ``torch.inference_mode``.
  train  forward + softmax cross-entropy + backward + AdamW update: one
         ``jax.jit`` step (state donated) vs torch eager
         (``zero_grad / loss.backward() / opt.step()``, default AdamW).
  bfloat16: JAX computes in bf16 with float32 parameters
         (``dtype=bfloat16``); torch runs under ``torch.autocast('cpu',
         dtype=torch.bfloat16)``.
Both use every core by default (torch: ``torch.get_num_threads()``; XLA: its
own pool, one thread per core).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

if __package__ in (None, ""):  # `python bench/bench.py`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import flops as flops_lib  # noqa: E402
from bench import harness  # noqa: E402
from bench import machine  # noqa: E402
from vit_jax.data import console  # noqa: E402


def _parse_overrides(items):
  out = {}
  for item in items or ():
    k, _, v = item.partition("=")
    try:
      out[k] = json.loads(v)
    except json.JSONDecodeError:
      out[k] = v
  return out


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="vit_b_16",
                 help="variant, e.g. vit_ti_16, vit_s_16, vit_b_16, vit_l_16")
  p.add_argument("--mode", choices=("infer", "train"), default="infer")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--rounds", type=int, default=5,
                 help="alternating rounds (each framework once per round)")
  p.add_argument("--round-seconds", type=float, default=4.0,
                 help="approximate time of one framework's turn in a round")
  p.add_argument("--quiet-load", type=float, default=0.3,
                 help="repeat a turn (up to --max-retries) if other processes "
                      "used more than this many cores meanwhile")
  p.add_argument("--max-retries", type=int, default=2)
  p.add_argument("--cpus", type=lambda v: [int(c) for c in v.split(",")],
                 default=None, metavar="0,1",
                 help="pin both frameworks to these CPUs (default: all)")
  p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                 help="on a shared machine: before each turn, wait up to this "
                      "long for other processes to use < --quiet-load cores")
  p.add_argument("--warmup", type=int, default=2,
                 help="untimed steps after the first (compiling) one")
  p.add_argument("--jax-opt", action="append", metavar="FIELD=VALUE",
                 help="model override for the JAX side, e.g. "
                      "scan_layers=true, remat_policy=dots (repeatable)")
  p.add_argument("--xla-flags", default="",
                 help="extra XLA_FLAGS for the JAX side (none is needed: "
                      "see bench/README.md for the flags measured)")
  p.add_argument("--no-donate", action="store_true",
                 help="train: don't donate the train state to the step")
  p.add_argument("--torch-threads", type=int, default=0,
                 help="torch.set_num_threads (default: torch's own choice)")
  p.add_argument("--torch-compile", action="store_true",
                 help="add a torch.compile contestant (extra column)")
  p.add_argument("--no-torch", action="store_true",
                 help="time the JAX side only")
  machine.add_gemm_args(p)
  machine.add_isa_arg(p)
  p.add_argument("--json", action="store_true",
                 help="print one JSON object (the table goes to stderr)")
  return p


def contestants_from_args(args) -> list:
  jax_opts = _parse_overrides(args.jax_opt)
  flags = args.xla_flags
  out = [harness.Contestant(
      "jax", "jax",
      options={"model_overrides": jax_opts, "donate": not args.no_donate},
      xla_flags=flags)]
  if not args.no_torch:
    out.append(harness.Contestant(
        "torch", "torch", options={"threads": args.torch_threads}))
    if args.torch_compile:
      out.append(harness.Contestant(
          "torch.compile", "torch",
          options={"threads": args.torch_threads, "torch_compile": True}))
  return out


def summarise(res, workload: harness.Workload, gemms=None) -> dict:
  """The flat JSON record (headline numbers first); ``gemms``: the
  machine's GEMM rates from the same run (:mod:`bench.machine`)."""
  from vit_jax import models  # pylint: disable=import-outside-toplevel
  variant = models.decode_variant(workload.name)
  gflop = flops_lib.step_flops(variant, workload.image_size, workload.mode,
                               workload.num_classes) / 1e9
  c = res["contestants"]
  jx = c["jax"]
  rec = {"model": workload.name, "mode": workload.mode,
         "dtype": workload.dtype, "batch": workload.batch,
         "image_size": workload.image_size,
         "jax_img_per_sec": jx["img_per_sec"]["median"]}
  if "torch" in c:
    rec["torch_img_per_sec"] = c["torch"]["img_per_sec"]["median"]
    rec["ratio"] = jx["ratio_vs_reference"]["median"]
    rec["ratio_min"] = jx["ratio_vs_reference"]["min"]
    rec["ratio_max"] = jx["ratio_vs_reference"]["max"]
    rec["check_max_abs_diff"] = jx.get("check_max_abs_diff")
    rec["cpu_time_ratio"] = jx["cpu_ratio_vs_reference"]["median"]
  if "torch.compile" in c:
    rec["torch_compile_img_per_sec"] = c["torch.compile"]["img_per_sec"][
        "median"]
    rec["ratio_vs_torch_compile"] = statistics.median(
        row["jax"]["img_per_sec"] / row["torch.compile"]["img_per_sec"]
        for row in res["rounds"])
  rec["gflop_per_image"] = gflop
  best = machine.roofline(gemms, workload.dtype)
  rec["gemm_peak_gflops"] = best["gflops"] if best else None
  for lab, cont in c.items():
    if best:
      rec[f"{lab.replace('.', '_')}_pct_of_gemm_peak"] = (
          100.0 * gflop * cont["img_per_sec"]["median"] / best["gflops"])
  rec["jax_compile_s"] = jx["compile_s"]
  rec["rounds"] = len(res["rounds"])
  rec["cpu_count"] = res["cpu_count"]
  rec["load_avg_1m"] = res["load_avg_1m"]
  rec["machine"] = res["machine"]
  rec["gemms"] = gemms
  rec["details"] = res
  return rec


def format_table(rec: dict) -> str:
  res = rec["details"]
  gflop = rec["gflop_per_image"]
  w = res["workload"]
  best = machine.roofline(rec.get("gemms"), w["dtype"])
  isa = (rec.get("machine") or {}).get("isa", {})
  no_bf16 = w["dtype"] == "bfloat16" and not (
      isa.get("AVX512-BF16") or isa.get("AMX-BF16"))
  lines = [
      machine.describe(rec["machine"]),
      rec.get("isa_line", ""),
      ("bfloat16 on a CPU without bf16 arithmetic: vit_jax runs the dense "
       "layers' GEMMs in float32 here (kernels.choose_dense: 'f32_cpu'); "
       "float32 is the faster choice on this CPU." if no_bf16 else
       "bfloat16 emulated AVX2: vit_jax picks its bf16 GEMMs from this "
       "CPU's real AVX512-BF16 (kernels.choose_dense), which the capped "
       "GEMM libraries then run without, so bf16 numbers here are not an "
       "AVX2 CPU's." if w["dtype"] == "bfloat16" and
       rec.get("isa") == "avx2" and isa.get("AVX512-BF16") else ""),
      f"{w['name']}  {w['mode']}  {w['dtype']}  batch {w['batch']}  "
      f"{w['image_size']}x{w['image_size']}  |  {rec['rounds']} alternating "
      f"rounds, {res['cpu_count']} CPUs, load avg {res['load_avg_1m']:.1f}  "
      f"|  {gflop:.1f} GFLOP/image (analytic"
      f"{', train = 3x forward' if w['mode'] == 'train' else ''})",
      "",
      f"{'':15s} {'img/s':>8s} {'min-max':>15s} {'ms/step':>9s} "
      f"{'GFLOP/s':>8s} {'% GEMM':>7s} {'vs torch':>18s} {'compile':>8s} "
      f"{'cpu use':>8s} {'others':>7s} {'cpu ms/img':>10s}",
  ]
  for lab, c in res["contestants"].items():
    ips = c["img_per_sec"]
    r = c["ratio_vs_reference"]
    ratio = ("1.00x" if lab == res["reference"] else
             f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]")
    comp = f"{c['compile_s']:.1f}s" if c.get("compile_s") is not None else "-"
    label = "torch (eager)" if lab == "torch" else lab
    lines.append(
        f"{label:15s} {ips['median']:8.2f} "
        f"{ips['min']:7.2f}-{ips['max']:<7.2f} "
        f"{1000 * w['batch'] / ips['median']:9.1f} "
        f"{gflop * ips['median']:8.1f} "
        f"{machine.percent_of(gflop * ips['median'], best):>7s} "
        f"{ratio:>18s} {comp:>8s} "
        f"{c['cpu_use']['median']:8.2f} {c['other_load']['median']:7.2f} "
        f"{c['cpu_ms_per_img']['median']:10.1f}")
  lines.append("")
  if "ratio" in rec:
    lines.append(
        f"ratio jax/torch = {rec['ratio']:.2f}x (median of per-round paired "
        f"ratios; min {rec['ratio_min']:.2f}x, max {rec['ratio_max']:.2f}x)")
    if "ratio_vs_torch_compile" in rec:
      lines.append(f"ratio jax/torch.compile = "
                   f"{rec['ratio_vs_torch_compile']:.2f}x (median of per-round "
                   f"paired ratios)")
    jx = res["contestants"]["jax"]
    cr = jx["cpu_ratio_vs_reference"]
    lines.append(
        f"CPU-time ratio torch/jax = {cr['median']:.2f}x [{cr['min']:.2f}-"
        f"{cr['max']:.2f}] (CPU-seconds per image; a load-robust cross-check, "
        f"inflated by spin-waiting thread pools)")
    if jx.get("check_max_abs_diff") is not None:
      what = "logits" if w["mode"] == "infer" else "first-step loss"
      lines.append(f"check: max |{what} jax - torch| = "
                   f"{jx['check_max_abs_diff']:.2e} (max |value| "
                   f"{jx['check_max_abs_ref']:.2f})")
  if rec.get("gemms"):
    lines += ["", machine.format_gemms(rec["gemms"], w["dtype"])]
  info = res["contestants"]["jax"]["info"]
  if info.get("xla_flags"):
    lines.append(f"XLA_FLAGS: {info['xla_flags']}")
  if "torch" in res["contestants"]:
    ti = res["contestants"]["torch"]["info"]
    lines.append(f"torch {ti.get('torch')} threads {ti.get('threads')}; "
                 f"jax {info.get('jax')}; cpu use = CPU-seconds per second "
                 f"(well under {res['cpu_count']} = starved); others = cores "
                 f"used by other processes meanwhile (median; noise)")
  return "\n".join(lines)


def main(argv=None):
  console.quiet_native_logs()
  args = build_parser().parse_args(argv)
  isa_line = machine.set_isa(args.isa)
  workload = harness.Workload(
      name=args.model, mode=args.mode, dtype=args.dtype, batch=args.batch,
      image_size=args.image_size, warmup=args.warmup)
  res = harness.run(workload, contestants_from_args(args), rounds=args.rounds,
                    round_s=args.round_seconds, quiet_load=args.quiet_load,
                    max_retries=args.max_retries,
                    wait_quiet_s=args.wait_quiet, cpus=args.cpus,
                    reference=None if args.no_torch else "torch")
  rec = summarise(res, workload, machine.gemms_for(
      args, workload.name, workload.batch, workload.image_size,
      dtypes=(workload.dtype,)))
  rec["isa"], rec["isa_line"] = args.isa, isa_line
  return harness.emit(format_table(rec), rec, args.json)


if __name__ == "__main__":
  main()
