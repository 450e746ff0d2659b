"""Throughput of our JAX ViT against its peers, side by side in one run.

    python bench/bench.py --model vit_b_16 --mode infer --batch 8
    python bench/bench.py --model vit_ti_16 --mode train --batch 16 --dtype bfloat16 --json
    python bench/bench.py --model vit_small_patch16_dinov3 eva02_tiny_patch14_224
    python bench/bench.py --model vit_b_16 --batch 1 --peer stablehlo \\
        --peer savedmodel --peer onnxruntime --peer torch
    python bench/bench.py --model vit_b_16 --batch 1 2 4 8 16 32       # a sweep
    python bench/bench.py --model vit_b_16 --batch 4 --image-size 224 384 512

``--model`` is one of our variants (``vit_b_16``: the peer is torchvision's
model) or a timm name (``eva02_tiny_patch14_224``: timm's model; we load its
weights with ``formats.from_timm``). Peers (``--peer``, repeatable): ``torch``
(torchvision's or timm's model, eager; the default), ``torch.compile``,
``stablehlo``, ``savedmodel``, ``onnxruntime`` (our model exported by
``python -m vit_jax.export``, dynamic batch, run by jax.export, TensorFlow
or onnxruntime; inference, float32), ``none`` (JAX alone). Every side gets
the same weights (torch's init, converted) and inputs; ``max|diff|`` is the
largest logits (or first-step loss) difference from JAX's.

What is timed:
  infer  ``jit(model.apply)`` vs ``model.eval()`` under ``torch.inference_mode``.
  train  forward + softmax cross-entropy + backward + AdamW: one ``jax.jit``
         step (state donated) vs torch eager (``zero_grad / backward / step``).
  bfloat16: JAX computes in bf16 with float32 parameters; torch under
         ``torch.autocast('cpu', dtype=torch.bfloat16)``.
Each side runs in its own child process; rounds alternate (A B, B A, ...)
and a ratio is the median of the per-round paired ratios, [min-max]. Several
values of ``--model``, ``--batch`` or ``--image-size`` run one such
comparison per point and end with a table of all of them, the analytic
FLOPs (``flops.py``) beside the time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # `python bench/bench.py`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import flops as flops_lib  # noqa: E402
from bench import harness  # noqa: E402
from bench import machine  # noqa: E402
from vit_jax.data import console  # noqa: E402

RUNTIMES = ("stablehlo", "savedmodel", "onnxruntime")
PEERS = ("torch", "torch.compile") + RUNTIMES + ("none",)


def parse_overrides(items):
  out = {}
  for item in items or ():
    k, _, v = item.partition("=")
    try:
      out[k] = json.loads(v)
    except json.JSONDecodeError:
      out[k] = v
  return out


def add_run_args(p: argparse.ArgumentParser, rounds=5, round_s=4.0,
                 retries=2):
  """The options of an alternating run (bench.py, ab.py)."""
  p.add_argument("--mode", choices=("infer", "train"), default="infer")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  p.add_argument("--rounds", type=int, default=rounds,
                 help="alternating rounds (each side once per round)")
  p.add_argument("--round-seconds", type=float, default=round_s,
                 help="approximate time of one side's turn in a round")
  p.add_argument("--quiet-load", type=float, default=0.3,
                 help="repeat a turn (up to --max-retries) if other processes "
                      "used more than this many cores meanwhile")
  p.add_argument("--max-retries", type=int, default=retries)
  p.add_argument("--cpus", type=lambda v: [int(c) for c in v.split(",")],
                 default=None, metavar="0,1",
                 help="pin every side to these CPUs (default: all)")
  p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                 help="before each turn, wait up to this long for other "
                      "processes to use < --quiet-load cores")
  p.add_argument("--warmup", type=int, default=2,
                 help="untimed steps after the first (compiling) one")
  p.add_argument("--jax-opt", action="append", metavar="FIELD=VALUE",
                 help="model override for the JAX side, e.g. "
                      "scan_layers=true, remat_policy=dots (repeatable)")
  machine.add_gemm_args(p)
  machine.add_isa_arg(p)
  p.add_argument("--json", action="store_true",
                 help="print JSON (the table goes to stderr)")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", nargs="+", default=["vit_b_16"],
                 help="our variants (vit_ti_16, vit_b_16, ...) or timm names")
  p.add_argument("--batch", type=int, nargs="+", default=[8])
  p.add_argument("--image-size", type=int, nargs="+", default=[224])
  p.add_argument("--layers", type=int, default=0,
                 help="blocks of every side's model (default: the model's)")
  p.add_argument("--peer", action="append", choices=PEERS,
                 help="repeatable; default torch")
  p.add_argument("--torch-compile", action="store_true",
                 help="add the peer torch.compile")
  p.add_argument("--torch-threads", type=int, default=0,
                 help="torch.set_num_threads (default: torch's own choice)")
  p.add_argument("--xla-flags", default="",
                 help="extra XLA_FLAGS for the JAX side")
  p.add_argument("--no-donate", action="store_true",
                 help="train: don't donate the train state to the step")
  add_run_args(p)
  return p


def is_timm(name: str) -> bool:
  from vit_jax import models  # pylint: disable=import-outside-toplevel
  try:
    models.decode_variant(name)
    return False
  except ValueError:
    return True


def contestants(args, timm: bool) -> list:
  peers = list(dict.fromkeys((args.peer or ["torch"]) + (
      ["torch.compile"] if args.torch_compile else [])))
  if args.mode == "train" or args.dtype != "float32":
    if set(peers) & set(RUNTIMES):
      raise SystemExit(f"--peer {'/'.join(RUNTIMES)}: exported models are "
                       "timed in inference, float32")
  out = [harness.Contestant(
      "jax", "jax", xla_flags=args.xla_flags,
      options={"model_overrides": parse_overrides(args.jax_opt),
               "donate": not args.no_donate})]
  threads = {"threads": args.torch_threads}
  for p in peers:
    if p == "torch":
      out.append(harness.Contestant("timm" if timm else "torch", "torch",
                                    options=threads))
    elif p == "torch.compile":
      out.append(harness.Contestant(p, "torch", options=dict(
          threads, torch_compile=True)))
    elif p != "none":
      out.append(harness.Contestant(p, p, env={"TF_CPP_MIN_LOG_LEVEL": "2"}))
  return out


def key(label: str) -> str:
  return label.replace(".", "_")


def summarise(res, w: harness.Workload, gemms=None) -> dict:
  """The flat JSON record of one point (headline numbers first)."""
  c = res["contestants"]
  peers = [lab for lab in c if lab != "jax"]
  rec = {"model": w.name, "mode": w.mode, "dtype": w.dtype, "batch": w.batch,
         "image_size": w.image_size,
         "jax_img_per_sec": c["jax"]["img_per_sec"]["median"]}
  for i, lab in enumerate(peers):
    rows = res["rounds"]
    ratio = harness.summary([r["jax"]["img_per_sec"] / r[lab]["img_per_sec"]
                             for r in rows])
    rec[f"{key(lab)}_img_per_sec"] = c[lab]["img_per_sec"]["median"]
    c[lab]["jax_over"] = ratio
    if i == 0:
      rec.update(ratio=ratio["median"], ratio_min=ratio["min"],
                 ratio_max=ratio["max"],
                 check_max_abs_diff=c[lab].get("check_max_abs_diff"),
                 cpu_time_ratio=harness.summary(
                     [r[lab]["cpu_ms_per_img"] / r["jax"]["cpu_ms_per_img"]
                      for r in rows])["median"])
    else:
      rec[f"ratio_vs_{key(lab)}"] = ratio["median"]
  rec["gflop_per_image"] = rec["tokens"] = rec["attention_fraction"] = None
  if not w.timm:
    v = w.variant()
    fb = flops_lib.vit_forward_flops(image_size=w.image_size,
                                     **vars(v))
    rec["gflop_per_image"] = flops_lib.step_flops(
        v, w.image_size, w.mode, w.num_classes) / 1e9
    rec["tokens"], rec["attention_fraction"] = (fb.tokens,
                                                fb.attention_fraction)
  best = machine.roofline(gemms, w.dtype)
  rec["gemm_peak_gflops"] = best["gflops"] if best else None
  for lab, cont in c.items():
    if best and rec["gflop_per_image"]:
      rec[f"{key(lab)}_pct_of_gemm_peak"] = (
          100.0 * rec["gflop_per_image"] * cont["img_per_sec"]["median"] /
          best["gflops"])
  rec.update(jax_compile_s=c["jax"]["compile_s"], rounds=len(res["rounds"]),
             cpu_count=res["cpu_count"], load_avg_1m=res["load_avg_1m"],
             machine=res["machine"], gemms=gemms, details=res)
  return rec


def _fmt(v, spec: str) -> str:
  return "-" if v is None else spec.format(v)


def format_table(rec: dict) -> str:
  res, gflop = rec["details"], rec["gflop_per_image"]
  w = res["workload"]
  best = machine.roofline(rec.get("gemms"), w["dtype"])
  isa = (rec.get("machine") or {}).get("isa", {})
  note = None
  if w["dtype"] == "bfloat16" and not (isa.get("AVX512-BF16") or
                                       isa.get("AMX-BF16")):
    note = ("bfloat16 on a CPU without bf16 arithmetic: vit_jax runs the "
            "dense layers' GEMMs in float32 here (kernels.choose_dense).")
  elif w["dtype"] == "bfloat16" and rec.get("isa") == "avx2":
    note = ("bfloat16, AVX2 emulated: vit_jax picks its bf16 GEMMs from this "
            "CPU's real AVX512-BF16: not an AVX2 CPU's numbers.")
  lines = [machine.describe(rec["machine"]), rec.get("isa_line", ""), note,
           f"{w['name']}  {w['mode']}  {w['dtype']}  batch {w['batch']}  "
           f"{w['image_size']}x{w['image_size']}  |  {rec['rounds']} "
           f"alternating rounds, {res['cpu_count']} CPUs, load avg "
           f"{res['load_avg_1m']:.1f}" + (
               f"  |  {gflop:.2f} GFLOP/image (analytic"
               f"{', train = 3x forward' if w['mode'] == 'train' else ''})"
               if gflop else ""), "",
           f"{'':15s} {'img/s':>8s} {'min-max':>15s} {'ms/step':>9s} "
           f"{'GFLOP/s':>8s} {'% GEMM':>7s} {'jax / this':>18s} "
           f"{'compile':>8s} {'cpu use':>8s} {'others':>7s} "
           f"{'cpu ms/img':>10s} {'max|diff|':>9s}"]
  for lab, c in res["contestants"].items():
    ips, r = c["img_per_sec"], c.get("jax_over")
    rate = gflop * ips["median"] if gflop else None
    cells = [_fmt(rate, "{:.1f}"), machine.percent_of(rate, best) if rate
             else "-", "-" if r is None else
             f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]",
             _fmt(c.get("compile_s"), "{:.1f}s")]
    lines.append(
        f"{'torch (eager)' if lab == 'torch' else lab:15s} "
        f"{ips['median']:8.2f} {ips['min']:7.2f}-{ips['max']:<7.2f} "
        f"{1000 * w['batch'] / ips['median']:9.1f} {cells[0]:>8s} "
        f"{cells[1]:>7s} {cells[2]:>18s} {cells[3]:>8s} "
        f"{c['cpu_use']['median']:8.2f} {c['other_load']['median']:7.2f} "
        f"{c['cpu_ms_per_img']['median']:10.1f} "
        f"{_fmt(c.get('check_max_abs_diff'), '{:.1e}'):>9s}")
  lines.append("")
  if "ratio" in rec:
    what = "logits" if w["mode"] == "infer" else "first-step loss"
    lines += [f"CPU-time ratio (the first peer's CPU-seconds per image / "
              f"JAX's) = {rec['cpu_time_ratio']:.2f}x: a load-robust "
              f"cross-check, inflated by spin-waiting thread pools",
              f"max|diff|: largest |{what} - JAX's|; jax / this: median of "
              f"per-round paired img/s ratios [min-max]"]
  if rec.get("gemms"):
    lines += ["", machine.format_gemms(rec["gemms"], w["dtype"])]
  info = res["contestants"]["jax"]["info"]
  if info.get("xla_flags"):
    lines.append(f"XLA_FLAGS: {info['xla_flags']}")
  for lab, c in res["contestants"].items():
    v = {k: c["info"][k] for k in ("jax", "torch", "threads", "tensorflow",
                                   "onnxruntime", "intra_op_threads",
                                   "export_s") if k in c["info"]}
    lines.append(f"{lab}: " + ", ".join(f"{k} {x}" for k, x in v.items()))
  lines.append(f"cpu use = CPU-seconds per second (well under "
               f"{res['cpu_count']} = starved); others = cores used by "
               "other processes meanwhile (median; noise)")
  return "\n".join(line for line in lines if line is not None)


def format_sweep(recs) -> str:
  """All points in one table; ``~FLOPs``: the ms per image the first point
  of the same model predicts if time followed the analytic FLOPs."""
  lines = [f"{'model':24s} {'batch':>5s} {'px':>4s} {'tokens':>6s} "
           f"{'GFLOP/img':>9s} {'attn%':>6s} {'jax img/s':>10s} "
           f"{'ms/img':>8s} {'~FLOPs':>8s}  each peer: img/s (jax / peer)"]
  first = {}
  for r in recs:
    b = first.setdefault(r["model"], r)
    pred = (1000.0 / b["jax_img_per_sec"] * r["gflop_per_image"] /
            b["gflop_per_image"] if r["gflop_per_image"] else None)
    pct = (None if pred is None else 100 * r["attention_fraction"])
    peers = {k: v for k, v in r["details"]["contestants"].items()
             if k != "jax"}
    lines.append(
        f"{r['model']:24s} {r['batch']:5d} {r['image_size']:4d} "
        f"{r['tokens'] or '-':>6} {_fmt(r['gflop_per_image'], '{:.1f}'):>9s} "
        f"{_fmt(pct, '{:.1f}%'):>6s} {r['jax_img_per_sec']:10.2f} "
        f"{1000.0 / r['jax_img_per_sec']:8.1f} {_fmt(pred, '{:.1f}'):>8s}  " +
        ", ".join(f"{k} {c['img_per_sec']['median']:.2f} "
                  f"({c['jax_over']['median']:.2f}x)" for k, c in peers.items()))
  return "\n".join(lines)


def main(argv=None):
  console.quiet_native_logs()
  args = build_parser().parse_args(argv)
  isa_line = machine.set_isa(args.isa)
  points = [(m, s, b) for m in args.model for s in args.image_size
            for b in args.batch]
  gemms = machine.gemms_for(args, [(m, b, s) for m, s, b in points
                                   if not is_timm(m)], dtypes=(args.dtype,))
  recs, info = [], machine.cpu_info()
  for m, s, b in points:
    timm = is_timm(m)
    w = harness.Workload(name=m, mode=args.mode, dtype=args.dtype, batch=b,
                         image_size=s, warmup=args.warmup, timm=timm,
                         layers=args.layers)
    harness.log(f"== {m} batch {b} {s}px")
    res = harness.run(w, contestants(args, timm), rounds=args.rounds,
                      round_s=args.round_seconds, quiet_load=args.quiet_load,
                      max_retries=args.max_retries, reference="jax",
                      wait_quiet_s=args.wait_quiet, cpus=args.cpus)
    res["machine"] = info
    rec = summarise(res, w, gemms)
    rec["isa"], rec["isa_line"] = args.isa, isa_line
    recs.append(rec)
    harness.emit(format_table(rec), rec, args.json)
  if len(recs) > 1:
    print("\n" + format_sweep(recs), file=sys.stderr if args.json else
          sys.stdout)
  return recs[0] if len(recs) == 1 else recs


if __name__ == "__main__":
  main()
