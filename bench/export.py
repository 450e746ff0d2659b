"""Benchmark: deployment runtimes against jitted JAX and torchvision eager.

    python bench/export.py --model vit_b_16 --batches 1,8 --rounds 5
    python bench/export.py --model vit_ti_16 --json > ti16.json
    python bench/export.py --model vit_b_16 --batches 1,8 --isa avx2

Contestants, each in its own child process (:mod:`bench.harness`), all on
the same weights (torchvision's init, converted) and inputs, float32:

  jax.jit        ``jit(model.apply)`` (bench.worker, as in bench.py)
  stablehlo      the ``jax.export`` artifact of ``python -m vit_jax.export``,
                 deserialized and called (same XLA as jax.jit)
  savedmodel     the SavedModel, ``serving_default`` run by TensorFlow
  onnxruntime    the ONNX file, run by onnxruntime's CPU provider
  torch eager    torchvision's model under ``torch.inference_mode``

Every artifact has a dynamic batch dimension (the default export). For each
batch size, rounds alternate between the contestants (A B C, C B A, ...);
the table gives the latency of one call at batch 1 and the throughput at
the larger batch, each with the median of the per-round paired ratios
against jax.jit, and the largest logits difference from jax.jit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Optional

if __package__ in (None, ""):  # `python bench/export.py`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import flops as flops_lib  # noqa: E402
from bench import harness  # noqa: E402
from bench import machine  # noqa: E402

REFERENCE = "jax.jit"
RUNTIMES = {"stablehlo": "stablehlo (jax.export)",
            "savedmodel": "savedmodel (TF)",
            "onnxruntime": "onnxruntime"}
# Not in the default set: the ONNX graph made by jax2onnx instead of
# torch.onnx.export (needs jax2onnx importable; see bench/README.md).
EXTRA_RUNTIMES = {"onnxruntime-jax2onnx": "onnxruntime (jax2onnx)"}


def contestants(runtimes, torch: bool = True,
                artifact_dir: Optional[str] = None):
  """``artifact_dir``: where the runtimes keep their exported artifacts
  between batch sizes (each artifact has a dynamic batch dimension, so a
  second batch size loads the first one's instead of exporting again)."""
  env = {"JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"}
  out = [harness.Contestant(REFERENCE, "jax")]
  shared = {"artifact_dir": artifact_dir} if artifact_dir else {}
  for r in runtimes:
    if r in EXTRA_RUNTIMES:
      out.append(harness.Contestant(EXTRA_RUNTIMES[r], "onnxruntime", env=env,
                                    options=dict(shared,
                                                 onnx_route="jax2onnx")))
    else:
      out.append(harness.Contestant(RUNTIMES[r], r, env=env,
                                    options=dict(shared)))
  if torch:
    out.append(harness.Contestant("torch eager", "torch"))
  return out


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="vit_b_16")
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--batches", default="1,8",
                 help="comma-separated batch sizes; the first is reported as "
                      "latency, the others as throughput")
  p.add_argument("--runtimes", default=",".join(RUNTIMES),
                 help=f"subset of {','.join(RUNTIMES)}, or "
                      f"{','.join(EXTRA_RUNTIMES)}")
  p.add_argument("--no-torch", action="store_true")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--round-seconds", type=float, default=4.0)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--quiet-load", type=float, default=0.3)
  p.add_argument("--max-retries", type=int, default=2)
  p.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS")
  machine.add_gemm_args(p)
  machine.add_isa_arg(p)
  p.add_argument("--json", action="store_true",
                 help="print one JSON object (the table goes to stderr)")
  return p


def run(args) -> dict:
  runtimes = [r for r in args.runtimes.split(",") if r]
  unknown = sorted(set(runtimes) - set(RUNTIMES) - set(EXTRA_RUNTIMES))
  if unknown:
    raise SystemExit(f"unknown runtimes {unknown}; known: "
                     f"{list(RUNTIMES) + list(EXTRA_RUNTIMES)}")
  isa_line = machine.set_isa(args.isa)
  results = {}
  artifacts = tempfile.mkdtemp(prefix="vit_bench_artifacts_")
  try:
    for batch in (int(b) for b in args.batches.split(",")):
      workload = harness.Workload(name=args.model, mode="infer",
                                  dtype="float32", batch=batch,
                                  image_size=args.image_size,
                                  warmup=args.warmup)
      harness.log(f"== batch {batch}")
      results[batch] = harness.run(
          workload, contestants(runtimes, not args.no_torch, artifacts),
          rounds=args.rounds, round_s=args.round_seconds,
          quiet_load=args.quiet_load, max_retries=args.max_retries,
          wait_quiet_s=args.wait_quiet, reference=REFERENCE)
  finally:
    shutil.rmtree(artifacts, ignore_errors=True)
  batches = sorted(results)
  gemms = machine.gemms_for(args, args.model, batches[-1], args.image_size,
                            dtypes=("float32",))
  info = machine.cpu_info()
  return {"model": args.model, "image_size": args.image_size,
          "cpu": info["model_name"], "machine": info,
          "cpu_count": os.cpu_count(),
          "isa": args.isa, "isa_line": isa_line,
          "gemms": gemms,
          "results": {str(b): r for b, r in results.items()}}


def _call_ms(res, label) -> float:
  """Milliseconds per call: batch / median throughput."""
  c = res["contestants"][label]
  return 1000 * res["workload"]["batch"] / c["img_per_sec"]["median"]


def format_table(rec: dict) -> str:
  batches = sorted(int(b) for b in rec["results"])
  first = rec["results"][str(batches[0])]
  labels = list(first["contestants"])
  head = [f"{'runtime':24s}"]
  for i, b in enumerate(batches):
    head.append(f"{f'batch {b}: ms':>14s} {'vs jax.jit':>17s}" if i == 0 else
                f"{f'batch {b}: img/s':>16s} {'vs jax.jit':>17s}")
  best = machine.roofline(rec.get("gemms"), "float32")
  last = rec["results"][str(batches[-1])]
  gflop = flops_lib.step_flops(
      machine.variant(rec["model"]), rec["image_size"], "infer") / 1e9
  head.append(f"{f'% GEMM (b{batches[-1]})':>13s}")
  head.append(f"{'max |logits - jax.jit|':>24s}")
  lines = [
      machine.describe(rec.get("machine")) if rec.get("machine") else
      f"CPU: {rec.get('cpu')}",
      *([rec["isa_line"]] if rec.get("isa_line") else []),
      f"{rec['model']}  float32  {rec['image_size']}x{rec['image_size']}  |  "
      f"{first['workload']['warmup']} warm-up steps, "
      f"{len(first['rounds'])} alternating rounds per batch size",
      "", " ".join(head)]
  for lab in labels:
    row = [f"{lab:24s}"]
    diff = 0.0
    for i, b in enumerate(batches):
      res = rec["results"][str(b)]
      c = res["contestants"][lab]
      r = c["ratio_vs_reference"]
      ratio = ("1.00x" if lab == REFERENCE else
               f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]")
      value = (f"{_call_ms(res, lab):14.1f}" if i == 0 else
               f"{c['img_per_sec']['median']:16.2f}")
      row.append(f"{value} {ratio:>17s}")
      diff = max(diff, c.get("check_max_abs_diff") or 0.0)
    rate = gflop * last["contestants"][lab]["img_per_sec"]["median"]
    row.append(f"{machine.percent_of(rate, best):>13s}")
    row.append(f"{diff:24.1e}" if lab != REFERENCE else f"{'-':>24s}")
    lines.append(" ".join(row))
  if rec.get("gemms"):
    lines += ["", machine.format_gemms(rec["gemms"], "float32")]
  lines.append("")
  lines.append("vs jax.jit: median of per-round paired throughput ratios "
               "(> 1 is faster), [min-max]; ms = time of one call (batch / "
               "median throughput).")
  for lab, c in first["contestants"].items():
    info = {k: v for k, v in c["info"].items() if k in (
        "jax", "torch", "tensorflow", "onnxruntime", "intra_op_threads",
        "threads", "export_s")}
    if info:
      lines.append(f"{lab}: " + ", ".join(
          f"{k} {v:.1f}s" if k == "export_s" else f"{k} {v}"
          for k, v in info.items()))
  return "\n".join(lines)


def main(argv=None):
  args = build_parser().parse_args(argv)
  rec = run(args)
  return harness.emit(format_table(rec), rec, args.json)


if __name__ == "__main__":
  main()
