"""The machine a benchmark runs on, its fastest GEMM, and a ViT's FLOPs.

    python bench/machine.py                        # this machine, 2048^3
    python bench/machine.py --model vit_ti_16 --batch 16 --json

Every table starts with :func:`describe` (the CPU, and the ISA extensions
that decide a ViT's speed on it); the throughput tables time each
framework's GEMMs in the same run (:func:`gemms_for`), the best rate for
the workload's dtype their roofline (:func:`roofline`) for the model's
analytic FLOPs (:func:`vit_forward_flops`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import platform
import resource
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

if __package__ in (None, ""):  # `python bench/machine.py`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # pylint: disable=wrong-import-position

# /proc/cpuinfo flag -> the name printed in tables.
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX512-BF16",
             "avx512_vnni": "AVX512-VNNI", "amx_bf16": "AMX-BF16",
             "amx_tile": "AMX-TILE"}

# (framework, dtype) -> how the tables name it.
GEMM_KINDS = {
    ("jax", "float32"): "XLA float32",
    ("jax", "bfloat16"): "XLA bf16 x bf16 -> f32",
    ("torch", "float32"): "torch float32 (MKL)",
    ("torch", "bfloat16"): "torch bfloat16 (oneDNN)",
}


# The CPU.
def _uarch(vendor: str, family: Optional[int], model: Optional[int]):
  """A microarchitecture name for the CPUs this project meets, or None."""
  if vendor == "AuthenticAMD" and model is not None:
    if family == 26:
      return "Zen 5"
    if family == 25:  # Zen 3 and Zen 4 share family 19h
      if model in range(0x10, 0x20) or model in range(0x60, 0x80) or (
          model in range(0xA0, 0xB0)):
        return "Zen 4"
      return "Zen 3"
    if family == 23:
      return "Zen 2" if model >= 0x30 else "Zen / Zen+"
  if vendor == "GenuineIntel" and family == 6:
    return {85: "Skylake-SP / Cascade Lake", 106: "Ice Lake-SP",
            108: "Ice Lake-SP", 143: "Sapphire Rapids",
            207: "Emerald Rapids", 173: "Granite Rapids",
            174: "Granite Rapids"}.get(model)
  return None


def parse_cpuinfo(text: str) -> Dict[str, Any]:
  """The first processor's facts from /proc/cpuinfo text."""
  fields: Dict[str, str] = {}
  for line in text.splitlines():
    if not line.strip():
      if fields:
        break  # the first processor is enough
      continue
    key, _, value = line.partition(":")
    fields.setdefault(key.strip(), value.strip())
  num = lambda k: int(fields[k]) if fields.get(k, "").isdigit() else None
  flags = set(fields.get("flags", "").split())
  vendor = fields.get("vendor_id", "")
  family, model = num("cpu family"), num("model")
  return {
      "model_name": fields.get("model name") or platform.processor() or
                    platform.machine(),
      "vendor": vendor, "family": family, "model": model,
      "uarch": _uarch(vendor, family, model),
      "isa": {name: flag in flags for flag, name in ISA_FLAGS.items()},
  }


def cpu_info() -> Dict[str, Any]:
  """This machine's /proc/cpuinfo, and the CPUs this process may use."""
  try:
    with open("/proc/cpuinfo") as f:
      info = parse_cpuinfo(f.read())
  except OSError:
    info = parse_cpuinfo("")
  info["cpus"] = len(os.sched_getaffinity(0))
  return info


# --isa avx2: an AVX2-only CPU (Zen 3, Haswell, ...) approximated on one
# with more, by the switches the packages document, nothing else; children
# of the run inherit them (contestants, GEMM probes).
ISAS = ("native", "avx2")
EMULATE_AVX2 = {
    "XLA_FLAGS": "--xla_cpu_max_isa=AVX2",  # XLA's generated code
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own kernels
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN: torch's bf16, XLA's Eigen dots
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # torch's float32 GEMMs
}
# What no documented switch reaches: both read CPUID themselves.
NOT_CAPPED = ("not capped (no switch): XLA's YNNPACK GEMMs and onnxruntime's "
              "MLAS kernels, which run this CPU's AVX-512")
EMULATION_CAVEAT = ("The cores are still this CPU's (caches, clocks): a real "
                    "AVX2 CPU is the reference.")


def set_isa(isa: str, info: Optional[Dict[str, Any]] = None) -> str:
  """Sets this run's children to ``isa`` ('native' leaves them alone) and
  returns the line a table prints: which ISA was real, which emulated."""
  if isa not in ISAS:
    raise ValueError(f"--isa {isa!r}: expected one of {ISAS}")
  info = info or cpu_info()
  has512 = bool(info.get("isa", {}).get("AVX-512"))
  if isa == "native":
    return f"ISA: native ({'AVX-512' if has512 else 'AVX2'}, real)"
  for key, value in EMULATE_AVX2.items():
    if key == "XLA_FLAGS":
      value = " ".join(v for v in (os.environ.get(key, ""), value) if v)
    os.environ[key] = value
  if not has512:
    return "ISA: AVX2 (real: this CPU has no AVX-512)"
  return ("ISA: AVX2 emulated on this AVX-512 CPU by the packages' documented "
          "switches only (" + " ".join(f"{k}={v}" for k, v in
                                       EMULATE_AVX2.items()) +
          f"); {NOT_CAPPED}. {EMULATION_CAVEAT}")


def describe(info: Optional[Dict[str, Any]] = None) -> str:
  """One line naming the CPU, e.g. ``CPU: AMD EPYC (family 26, model 2:
  Zen 5), 2 CPUs | AVX-512 yes, AVX512-BF16 yes, AVX512-VNNI yes, AMX no``."""
  info = info or cpu_info()
  nums = ", ".join(f"{k} {info[k]}" for k in (
      "family", "model") if info.get(k) is not None)
  if info.get("uarch"):
    nums = f"{nums}: {info['uarch']}" if nums else info["uarch"]
  isa = info.get("isa", {})
  yes = lambda k: "yes" if isa.get(k) else "no"
  amx = "yes" if isa.get("AMX-BF16") or isa.get("AMX-TILE") else "no"
  cpus = f", {info['cpus']} CPUs" if info.get("cpus") else ""
  return (f"CPU: {info['model_name']}{f' ({nums})' if nums else ''}{cpus} | "
          f"AVX-512 {yes('AVX-512')}, AVX512-BF16 {yes('AVX512-BF16')}, "
          f"AVX512-VNNI {yes('AVX512-VNNI')}, AMX {amx}")


# GEMM rates.
def model_gemm_shapes(name: str, batch: int, image_size: int = 224
                      ) -> List[Tuple[int, int, int]]:
  """(M, K, N) of the model's token-wise GEMMs, M = batch * tokens: q/k/v/out
  (M, D, D), the MLP's (M, D, mlp) and (M, mlp, D)."""
  from vit_jax import models  # pylint: disable=import-outside-toplevel
  v = models.decode_variant(name)
  tokens = (image_size // v.patch_size) ** 2 + 1
  m, d, h = batch * tokens, v.hidden_size, v.mlp_dim
  return [(m, d, d), (m, d, h), (m, h, d)]


def _time_gemm(run, flop: float, seconds: float, repeats: int = 5) -> float:
  """Best GFLOP/s of ``repeats`` stretches of ``seconds / repeats`` each,
  after a warm-up call; a call that already takes that long (torch's bf16
  without bf16 arithmetic: 58 s for one 2048^3 GEMM on Zen 3) is timed
  once."""
  run()
  t0 = time.perf_counter()
  run()
  best = time.perf_counter() - t0
  if best >= seconds / repeats:
    return flop / best / 1e9
  for _ in range(repeats):
    t0, n = time.perf_counter(), 0
    while not n or time.perf_counter() - t0 < seconds / repeats:
      run()
      n += 1
    best = min(best, (time.perf_counter() - t0) / n)
  return flop / best / 1e9


def gemm_child(spec) -> Dict[str, Any]:
  """In a child (bench.worker's ``gemm``): one framework's GEMM rates."""
  fw = spec["framework"]
  if fw == "jax":
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    rs, version = np.random.RandomState(0), jax.__version__
    f = jax.jit(lambda a, b: jnp.matmul(a, b,
                                        preferred_element_type=jnp.float32))
    make = lambda m, k, dt: jnp.asarray(rs.standard_normal((m, k)),  # noqa: E731
                                        jnp.dtype(dt))
    mul = lambda a, b: f(a, b).block_until_ready()  # noqa: E731
  else:
    import torch  # pylint: disable=import-outside-toplevel
    g, version = torch.Generator().manual_seed(0), torch.__version__
    make = lambda m, k, dt: torch.randn(m, k, generator=g).to(  # noqa: E731
        getattr(torch, dt))
    mul = torch.inference_mode()(lambda a, b: a @ b)
  rates = []
  for dt in spec["dtypes"]:
    for m, k, n in spec["shapes"]:
      a, b = make(m, k, dt), make(k, n, dt)
      rates.append({"framework": fw, "dtype": dt, "shape": [m, k, n],
                    "gflops": _time_gemm(lambda: mul(a, b),  # pylint: disable=cell-var-from-loop
                                         2.0 * m * k * n, spec["seconds"])})
  return {"version": version, "rates": rates}


# Analytic FLOPs of a ViT (one multiply-add = 2 FLOPs): only matmul-like
# work (patch embedding, q/k/v/out projections, the two attention products,
# the MLP, the head); LayerNorm, softmax, GELU and adds are a few percent and
# left out, as is usual. A training step is 3x the forward pass (backward =
# 2x forward); the optimizer is ignored.
@dataclasses.dataclass(frozen=True)
class FlopBreakdown:
  """Forward FLOPs of one image, and of its attention products."""
  tokens: int       # N (patches + class token)
  total: float
  attention: float  # QK^T and AV: 2 * N^2 * D each, quadratic in N

  @property
  def attention_fraction(self) -> float:
    """Share of the quadratic (N^2) attention term in the forward FLOPs."""
    return self.attention / self.total


def vit_forward_flops(*, hidden_size: int, num_layers: int, mlp_dim: int,
                      patch_size: int, image_size: int, num_classes: int = 1000,
                      channels: int = 3, class_token: bool = True,
                      **unused) -> FlopBreakdown:
  """Forward FLOPs of one ``image_size`` x ``image_size`` image."""
  del unused
  d, m, p, layers = hidden_size, mlp_dim, patch_size, num_layers
  patches = (image_size // p) ** 2
  n = patches + (1 if class_token else 0)
  attention = layers * 2 * (2 * n * n * d)
  return FlopBreakdown(n, float(
      2 * patches * (p * p * channels) * d  # patch embedding
      + layers * 2 * n * d * (4 * d)  # q/k/v/out projections: linear in N
      + attention + layers * 2 * (2 * n * d * m)  # the MLP
      + 2 * d * (num_classes or 0)), float(attention))  # the head


def step_flops(variant, image_size: int, mode: str, num_classes: int = 1000):
  """FLOPs per image of one ``mode`` ('infer' or 'train') step."""
  fwd = vit_forward_flops(image_size=image_size, num_classes=num_classes,
                          **dataclasses.asdict(variant)).total
  return fwd * (3.0 if mode == "train" else 1.0)


def roofline(gemms: Optional[Dict[str, Any]], dtype: str
             ) -> Optional[Dict[str, Any]]:
  """The best GEMM of ``dtype`` in a :func:`gemms_for` result:
  ``{"gflops", "kind", "shape"}`` (None without measurements)."""
  cands = [r for r in (gemms or {}).get("rates", []) if r["dtype"] == dtype]
  if not cands:
    return None
  best = max(cands, key=lambda r: r["gflops"])
  return {"gflops": best["gflops"], "shape": best["shape"],
          "kind": GEMM_KINDS[(best["framework"], best["dtype"])]}


def format_gemms(gemms: Dict[str, Any], workload_dtype: Optional[str] = None
                 ) -> str:
  """The GEMM table: one row per framework and dtype, one column per
  shape; then the roofline line for ``workload_dtype``."""
  shapes = list(dict.fromkeys(tuple(r["shape"]) for r in gemms["rates"]))
  kinds = list(dict.fromkeys((r["framework"], r["dtype"])
                             for r in gemms["rates"]))
  by = {(r["framework"], r["dtype"], tuple(r["shape"])): r["gflops"]
        for r in gemms["rates"]}
  cols = ["x".join(str(v) for v in s) for s in shapes]
  width = max(14, *(len(c) for c in cols))
  lines = [f"{'GEMM GFLOP/s (same run)':26s} " +
           " ".join(f"{c:>{width}s}" for c in cols)]
  other = gemms.get("other_load", {})
  for fw, dt in kinds:
    lines.append(f"{GEMM_KINDS[(fw, dt)]:26s} " + " ".join(
        f"{by.get((fw, dt, s), float('nan')):{width}.0f}" for s in shapes) +
                 (f"   (others {other[fw]:.2f})" if fw in other else ""))
  if workload_dtype:
    best = roofline(gemms, workload_dtype)
    if best:
      lines.append(
          f"roofline ({workload_dtype}): the best GEMM here runs at "
          f"{best['gflops']:.0f} GFLOP/s ({best['kind']}, "
          f"{'x'.join(str(v) for v in best['shape'])}); '% GEMM' = a "
          f"contestant's analytic GFLOP/s / that")
  return "\n".join(lines)


def percent_of(gflops: float, best: Optional[Dict[str, Any]]) -> str:
  """A contestant's GFLOP/s as a share of the roofline, e.g. ``41%``."""
  return f"{100.0 * gflops / best['gflops']:.0f}%" if best else "-"


def add_args(p: argparse.ArgumentParser, gemm: bool = True):
  """``--isa``, and (``gemm``) the roofline options of a throughput table."""
  p.add_argument("--isa", choices=ISAS, default="native",
                 help="avx2: an AVX2-only CPU emulated by the packages' "
                      "documented switches only (the tables say so)")
  if not gemm:
    return
  p.add_argument("--gemm-seconds", type=float, default=0.6,
                 help="time per GEMM (framework, dtype, shape) timed")
  p.add_argument("--gemm-square", type=int, default=2048,
                 help="side of the square GEMM beside the model's shapes")
  p.add_argument("--no-gemm", action="store_true",
                 help="skip the GEMM rates (no roofline)")


def gemms_for(args, points=(), dtypes=("float32", "bfloat16")):
  """The rates of the square GEMM and each (variant, batch, image size)'s
  shapes (M, K, N) in JAX and torch (if installed), each framework in its
  own child after waiting up to ``--wait-quiet`` for quiet: ``{"rates":
  [{framework, dtype, shape, gflops}, ...], "versions", "other_load":
  {framework: cores others used}}``; None with ``--no-gemm``."""
  if args.no_gemm:
    return None
  frameworks = ["jax"] + (["torch"] if importlib.util.find_spec("torch")
                          else [])
  shapes = [list(s) for s in dict.fromkeys([(args.gemm_square,) * 3] + [
      s for n, b, px in points for s in model_gemm_shapes(n, b, px)])]
  harness.log(f"[gemm] timing {len(shapes)} shapes x {frameworks} x "
              f"{'/'.join(dtypes)} ...")
  children = lambda: sum(resource.getrusage(  # noqa: E731
      resource.RUSAGE_CHILDREN)[:2])  # user + system CPU seconds
  out = {"rates": [], "versions": {}, "seconds": args.gemm_seconds,
         "other_load": {}}
  for fw in frameworks:
    if getattr(args, "wait_quiet", 0.0) > 0:
      harness.wait_for_quiet(args.wait_quiet, args.quiet_load)
    busy0, cpu0, t0 = (harness.busy_cpu_seconds(), children(),
                       time.perf_counter())
    res = harness.call("gemm", {"framework": fw, "shapes": shapes,
                                "dtypes": list(dtypes),
                                "seconds": args.gemm_seconds}, fw)
    out["other_load"][fw] = max(0.0, (
        harness.busy_cpu_seconds() - busy0 - children() + cpu0) / (
            time.perf_counter() - t0))
    out["rates"] += res["rates"]
    out["versions"][fw] = res["version"]
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=None,
                 help="also time this variant's GEMM shapes (e.g. vit_b_16)")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--image-size", type=int, default=224)
  add_args(p)
  p.add_argument("--json", action="store_true")
  args = p.parse_args(argv)
  info = cpu_info()
  isa_line = set_isa(args.isa, info)
  gemms = gemms_for(args, [(args.model, args.batch, args.image_size)]
                    if args.model else [])
  res = {"machine": info, "gemms": gemms}
  harness.emit("\n".join([describe(info), isa_line] + (
      [format_gemms(gemms)] if gemms else [])), res, args.json)
  return res


if __name__ == "__main__":
  main()
