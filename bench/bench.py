"""Throughput of our JAX ViT against its peers, side by side in one run.

    python bench/bench.py --model vit_b_16 --mode infer --batch 8
    python bench/bench.py --model vit_ti_16 --mode train --batch 16 --dtype bfloat16 --json
    python bench/bench.py --model vit_small_patch16_dinov3 eva02_tiny_patch14_224
    python bench/bench.py --model vit_b_16 --batch 1 8 --peer stablehlo \\
        --peer savedmodel --peer onnxruntime --peer torch
    python bench/bench.py --model vit_b_16 --batch 4 --image-size 224 384 512

``--model``: our variant (the peer: torchvision's model) or a timm name
(timm's model; ours loads its weights with ``formats.from_timm``); the
peers (``--peer``) in bench/README.md. Every side gets the same weights and
inputs. train: forward + cross-entropy + backward + AdamW, one jitted step
(state donated) vs torch eager; bfloat16: JAX in bf16 with float32
parameters, torch under ``torch.autocast``. Several values of ``--model``,
``--batch`` or ``--image-size`` make a sweep, then one table of them all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):  # `python bench/bench.py`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness, machine  # noqa: E402
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
  p.add_argument("--rounds", type=int, default=rounds)
  p.add_argument("--round-seconds", type=float, default=round_s,
                 help="about the time of one side's turn in a round")
  p.add_argument("--quiet-load", type=float, default=0.3,
                 help="repeat a turn while others used more cores than this")
  p.add_argument("--max-retries", type=int, default=retries)
  p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                 help="first wait up to this long for --quiet-load")
  p.add_argument("--warmup", type=int, default=2,
                 help="untimed steps after the first (compiling) one")
  p.add_argument("--jax-opt", action="append", metavar="FIELD=VALUE",
                 help="model override of the JAX side (repeatable)")
  machine.add_args(p)
  p.add_argument("--json", action="store_true",
                 help="print JSON (the table goes to stderr)")


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
  if set(peers) & set(RUNTIMES) and (args.mode, args.dtype) != ("infer",
                                                                "float32"):
    raise SystemExit(f"--peer {'/'.join(RUNTIMES)}: exported models are "
                     "timed in inference, float32")
  out = [harness.Contestant("jax", "jax", options={
      "model_overrides": parse_overrides(args.jax_opt)})]
  for p in peers:
    if p in ("torch", "torch.compile"):
      out.append(harness.Contestant(
          p if p != "torch" else "timm" if timm else "torch", "torch",
          options={"torch_compile": p != "torch"}))
    elif p != "none":
      out.append(harness.Contestant(p, p, env={"TF_CPP_MIN_LOG_LEVEL": "2"}))
  return out


def _fmt(v, spec: str) -> str:
  return "-" if v is None else spec.format(v)


def rows(res, gflop=None, gemms=None) -> list:
  """The lines of a run's table (bench.py, ab.py): one per contestant, what
  the columns mean, and the GEMM rates (the roofline of ``% GEMM``)."""
  ref, (batch, dtype) = res["reference"], (res["workload"]["batch"],
                                           res["workload"]["dtype"])
  best = machine.roofline(gemms, dtype)
  out = [f"{'':15s} {'img/s':>8s} {'min-max':>15s} {'ms/step':>8s} "
         f"{'GFLOP/s':>8s} {'% GEMM':>6s} {'vs ' + ref:>20s} "
         f"{'cpu ratio':>9s} {'compile':>7s} {'cpu use':>7s} {'others':>6s} "
         f"{'max|diff|':>9s}"]
  for lab, c in res["contestants"].items():
    ips, r = c["img_per_sec"], c["ratio_vs_reference"]
    rate = gflop * ips["median"] if gflop else None
    out.append(
        f"{lab:15s} {ips['median']:8.2f} {ips['min']:7.2f}-{ips['max']:<7.2f} "
        f"{1000 * batch / ips['median']:8.1f} {_fmt(rate, '{:.1f}'):>8s} "
        f"{machine.percent_of(rate, best) if rate else '-':>6s} "
        f"{r['median']:8.3f}x [{r['min']:.2f}-{r['max']:.2f}] "
        f"{c['cpu_ratio_vs_reference']['median']:8.3f}x "
        f"{_fmt(c.get('compile_s'), '{:.1f}s'):>7s} "
        f"{c['cpu_use']['median']:7.2f} {c['other_load']['median']:6.2f} "
        f"{_fmt(c.get('check_max_abs_diff'), '{:.1e}'):>9s}")
  return out + [
      f"vs {ref}: median of per-round paired img/s ratios; cpu ratio: "
      f"{ref}'s CPU-seconds per image over this one's (a load-robust "
      f"cross-check); cpu use in cores (well under "
      f"{res['cpu_count']}: starved); others: cores other processes used"
  ] + (["", machine.format_gemms(gemms, dtype)] if gemms else [])


def summarise(res, w: harness.Workload, gemms=None) -> dict:
  """The flat JSON record of one point (``ratio``: JAX / the first peer)."""
  c = res["contestants"]
  rec = {"model": w.name, "mode": w.mode, "dtype": w.dtype, "batch": w.batch,
         "image_size": w.image_size}
  fb = None if w.timm else machine.vit_forward_flops(
      image_size=w.image_size, **vars(w.variant()))
  rec.update(gflop_per_image=fb and fb.total * (3 if w.mode == "train" else 1)
             / 1e9, tokens=fb and fb.tokens,
             attention_fraction=fb and fb.attention_fraction)
  best = machine.roofline(gemms, w.dtype)
  rec["gemm_peak_gflops"] = best["gflops"] if best else None
  for i, (lab, cont) in enumerate(c.items()):
    key = lab.replace(".", "_")
    ips = rec[f"{key}_img_per_sec"] = cont["img_per_sec"]["median"]
    if best and fb:
      rec[f"{key}_pct_of_gemm_peak"] = (100.0 * rec["gflop_per_image"] * ips /
                                        best["gflops"])
    if lab != "jax":
      ratio = harness.summary([r["jax"]["img_per_sec"] / r[lab]["img_per_sec"]
                               for r in res["rounds"]])
      rec[f"ratio_vs_{key}"] = ratio["median"]
    if i == 1:  # the first peer: the headline
      rec.update(ratio=ratio["median"], ratio_min=ratio["min"],
                 ratio_max=ratio["max"], peer=lab,
                 check_max_abs_diff=cont.get("check_max_abs_diff"),
                 cpu_time_ratio=1 / cont["cpu_ratio_vs_reference"]["median"])
  rec.update(jax_compile_s=c["jax"]["compile_s"], rounds=len(res["rounds"]),
             cpu_count=res["cpu_count"], load_avg_1m=res["load_avg_1m"],
             machine=res["machine"], gemms=gemms, details=res)
  return rec


def format_table(rec: dict) -> str:
  res, gflop, w = rec["details"], rec["gflop_per_image"], rec
  isa = rec["machine"].get("isa", {})
  lines = [machine.describe(rec["machine"]), rec.get("isa_line", "")]
  if w["dtype"] == "bfloat16" and not isa.get("AVX512-BF16"):
    lines.append("bfloat16 on a CPU without bf16 arithmetic: vit_jax runs "
                 "the dense layers' GEMMs in float32 (kernels.choose_dense).")
  elif w["dtype"] == "bfloat16" and rec.get("isa") == "avx2":
    lines.append("bfloat16, AVX2 emulated: vit_jax picks its bf16 GEMMs from "
                 "this CPU's real AVX512-BF16: not an AVX2 CPU's numbers.")
  lines += [f"{w['model']}  {w['mode']}  {w['dtype']}  batch {w['batch']}  "
            f"{w['image_size']}x{w['image_size']}  |  {rec['rounds']} "
            f"alternating rounds, load avg {res['load_avg_1m']:.1f}" + (
                f"  |  {gflop:.2f} GFLOP/image (analytic"
                f"{', train = 3x forward' if w['mode'] == 'train' else ''})"
                if gflop else "")]
  if "ratio" in rec:
    lines.append(f"ratio jax/{rec['peer']} = {rec['ratio']:.2f}x [min "
                 f"{rec['ratio_min']:.2f}x, max {rec['ratio_max']:.2f}x]; "
                 f"CPU-time ratio {rec['cpu_time_ratio']:.2f}x")
  lines += [""] + rows(res, gflop, rec.get("gemms"))
  for lab, c in res["contestants"].items():
    lines.append(f"{lab}: " + ", ".join(f"{k} {c['info'][k]}" for k in (
        "jax", "xla_flags", "torch", "threads", "tensorflow", "onnxruntime",
        "intra_op_threads", "export_s") if c["info"].get(k)))
  return "\n".join(lines)


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
    pct = None if pred is None else 100 * r["attention_fraction"]
    lines.append(
        f"{r['model']:24s} {r['batch']:5d} {r['image_size']:4d} "
        f"{r['tokens'] or '-':>6} {_fmt(r['gflop_per_image'], '{:.1f}'):>9s} "
        f"{_fmt(pct, '{:.1f}%'):>6s} {r['jax_img_per_sec']:10.2f} "
        f"{1000.0 / r['jax_img_per_sec']:8.1f} {_fmt(pred, '{:.1f}'):>8s}  " +
        ", ".join(f"{k} {c['img_per_sec']['median']:.2f} "
                  f"({r['ratio_vs_' + k.replace('.', '_')]:.2f}x)"
                  for k, c in r["details"]["contestants"].items()
                  if k != "jax"))
  return "\n".join(lines)


def main(argv=None):
  console.lean_start_up()
  console.quiet_native_logs()
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
  add_run_args(p)
  args = p.parse_args(argv)
  isa_line = machine.set_isa(args.isa)
  points = [(m, s, b) for m in args.model for s in args.image_size
            for b in args.batch]
  gemms = machine.gemms_for(args, [(m, b, s) for m, s, b in points
                                   if not is_timm(m)], dtypes=(args.dtype,))
  recs, info = [], machine.cpu_info()
  for m, s, b in points:
    w = harness.Workload(name=m, mode=args.mode, dtype=args.dtype, batch=b,
                         image_size=s, warmup=args.warmup, timm=is_timm(m),
                         layers=args.layers)
    harness.log(f"== {m} batch {b} {s}px")
    res = harness.run(w, contestants(args, w.timm), args, reference="jax")
    res["machine"] = info
    rec = dict(summarise(res, w, gemms), isa=args.isa, isa_line=isa_line)
    recs.append(rec)
    harness.emit(format_table(rec), rec, args.json)
  if len(recs) > 1:
    print("\n" + format_sweep(recs), file=sys.stderr if args.json else
          sys.stdout)
  return recs[0] if len(recs) == 1 else recs


if __name__ == "__main__":
  main()
