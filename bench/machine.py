"""The machine a benchmark runs on, and the fastest GEMM it does.

Every table in bench/ starts with :func:`describe` (CPU model, family and
model numbers, the ISA extensions that decide the speed of a ViT on CPU:
AVX-512, AVX512-BF16, AVX512-VNNI, AMX) and the throughput tables measure,
in the same run, the GEMM rate of each framework and dtype
(:func:`measure_gemms`): a large square GEMM and the model's own GEMM
shapes, in XLA float32, XLA bf16 x bf16 -> float32 (the product our
bfloat16 path uses), torch float32 (MKL) and torch bfloat16 (oneDNN).
The best of those rates for a dtype is the roofline: "our model runs at
N % of the best GEMM this machine does" (:func:`roofline`).

    python bench/machine.py                        # this machine, 2048^3
    python bench/machine.py --model vit_ti_16 --batch 16 --json

Each framework times its GEMMs in its own child process (as the benchmark
contestants do: two thread pools in one process slow each other down), one
after the other, each shape for about ``seconds``; the rate kept is the best
of several timed repetitions, since a roofline is what the machine can do.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # `python bench/machine.py`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import mlas_isa  # pylint: disable=wrong-import-position
from bench import ynnpack_isa  # pylint: disable=wrong-import-position

# /proc/cpuinfo flag -> the name printed in tables.
ISA_FLAGS = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX512-BF16",
    "avx512_vnni": "AVX512-VNNI",
    "amx_bf16": "AMX-BF16",
    "amx_tile": "AMX-TILE",
}

# (framework, dtype) -> how the tables name it.
GEMM_KINDS = {
    ("jax", "float32"): "XLA float32",
    ("jax", "bfloat16"): "XLA bf16 x bf16 -> f32",
    ("torch", "float32"): "torch float32 (MKL)",
    ("torch", "bfloat16"): "torch bfloat16 (oneDNN)",
}
SQUARE = (2048, 2048, 2048)


# --------------------------------------------------------------------------- #
# The CPU.
# --------------------------------------------------------------------------- #


def _uarch(vendor: str, family: Optional[int], model: Optional[int]):
  """A microarchitecture name for the CPUs this project meets (None when
  the numbers are not in this short list)."""
  if family is None or model is None:
    return None
  if vendor == "AuthenticAMD":
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
  """This machine: :func:`parse_cpuinfo` of /proc/cpuinfo, plus the CPUs
  this process may run on."""
  try:
    with open("/proc/cpuinfo") as f:
      info = parse_cpuinfo(f.read())
  except OSError:
    info = parse_cpuinfo("")
  try:
    info["cpus"] = len(os.sched_getaffinity(0))
  except AttributeError:
    info["cpus"] = os.cpu_count()
  return info


# --isa avx2: what caps each framework at AVX2 (and FMA) on a CPU that has
# more, so one machine measures what an AVX2-only CPU (Zen 3, Haswell..)
# would run. Children of the run inherit it (contestants, GEMM probes).
ISAS = ("native", "avx2")
EMULATE_AVX2 = {
    "XLA_FLAGS": "--xla_cpu_max_isa=AVX2",  # JAX's generated code
    ynnpack_isa.ENV: "avx2",  # JAX's YNNPACK GEMMs (bench/ynnpack_isa.py)
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own kernels
    # torch's oneDNN (bf16, conv) and the oneDNN sgemm under XLA's Eigen
    # dots (e.g. a transposed operand, contracting dimension 0)
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # torch's float32 GEMMs
    mlas_isa.ENV: "avx2",  # onnxruntime's MLAS kernels (bench/mlas_isa.py)
}


def set_isa(isa: str, info: Optional[Dict[str, Any]] = None) -> str:
  """Caps this run's child processes at ``isa`` ('native' leaves them
  alone) and returns the line a table prints: which ISA was real and which
  emulated."""
  if isa not in ISAS:
    raise ValueError(f"--isa {isa!r}: expected one of {ISAS}")
  info = info or cpu_info()
  has512 = bool(info.get("isa", {}).get("AVX-512"))
  if isa == "native":
    return (f"ISA: native ({'AVX-512' if has512 else 'AVX2'}, real)")
  for key, value in EMULATE_AVX2.items():
    if key == "XLA_FLAGS":
      value = " ".join(v for v in (os.environ.get(key, ""), value) if v)
    os.environ[key] = value
  if not has512:
    return "ISA: AVX2 (real: this CPU has no AVX-512)"
  return ("ISA: AVX2, emulated on this AVX-512 CPU (JAX: XLA_FLAGS="
          "--xla_cpu_max_isa=AVX2, ONEDNN_MAX_CPU_ISA=AVX2, YNNPACK's "
          "kernels capped at AVX2+FMA3; torch: ATEN_CPU_CAPABILITY=avx2 "
          "ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2; onnxruntime: "
          "MLAS's AVX-512 kernels switched off in a patched copy). " +
          EMULATION_CAVEAT)


# The cores stay AVX-512 ones (cache, memory, clocks, how fast each AVX2
# instruction retires). Measured 2026-11-25 on an AMD EPYC Zen 5: capped
# XLA 207-255 GFLOP/s on ViT-Ti/16's shapes against capped MKL 215-222
# (bench/results/zen5_2026-11-25_avx2capped_ti16_train_b16.txt); on a real
# Zen 3 the two ran at the same 182-187.
EMULATION_CAVEAT = (
    "The cores are still this CPU's: compare the XLA and MKL rows of the "
    "GEMM table; a real AVX2 CPU is the reference.")


def add_isa_arg(p: argparse.ArgumentParser):
  p.add_argument("--isa", choices=ISAS, default="native",
                 help="avx2: cap both frameworks at AVX2 + FMA (emulate an "
                      "AVX2-only CPU on an AVX-512 one); every table says "
                      "which ISA was real and which emulated")


def describe(info: Optional[Dict[str, Any]] = None) -> str:
  """One line naming the CPU, e.g. ``CPU: AMD EPYC (family 26, model 2:
  Zen 5), 2 CPUs | AVX-512 yes, AVX512-BF16 yes, AVX512-VNNI yes, AMX no``."""
  info = info or cpu_info()
  nums = [f"family {info['family']}" if info.get("family") is not None
          else None,
          f"model {info['model']}" if info.get("model") is not None else None]
  nums = ", ".join(n for n in nums if n)
  if info.get("uarch"):
    nums = f"{nums}: {info['uarch']}" if nums else info["uarch"]
  isa = info.get("isa", {})
  yes = lambda k: "yes" if isa.get(k) else "no"
  amx = "yes" if isa.get("AMX-BF16") or isa.get("AMX-TILE") else "no"
  cpus = f", {info['cpus']} CPUs" if info.get("cpus") else ""
  return (f"CPU: {info['model_name']}{f' ({nums})' if nums else ''}{cpus} | "
          f"AVX-512 {yes('AVX-512')}, AVX512-BF16 {yes('AVX512-BF16')}, "
          f"AVX512-VNNI {yes('AVX512-VNNI')}, AMX {amx}")


# --------------------------------------------------------------------------- #
# GEMM rates.
# --------------------------------------------------------------------------- #


def variant(name: str):
  """The architecture of a variant name (``vit_b_16`` ...)."""
  from vit_jax import models  # pylint: disable=import-outside-toplevel
  return models.decode_variant(name)


def model_gemm_shapes(name: str, batch: int, image_size: int = 224
                      ) -> List[Tuple[int, int, int]]:
  """The (M, K, N) of the model's token-wise GEMMs at this batch: q/k/v/out
  projections (M, D, D) and the MLP's (M, D, mlp) and (M, mlp, D), with
  M = batch * tokens. (The attention products are many small batched GEMMs
  and are left out.)"""
  v = variant(name)
  tokens = (image_size // v.patch_size) ** 2 + 1
  m, d, h = batch * tokens, v.hidden_size, v.mlp_dim
  return [(m, d, d), (m, d, h), (m, h, d)]


def _time_gemm(run, flop: float, seconds: float, repeats: int = 5) -> float:
  """Best GFLOP/s of ``repeats`` timed stretches of about
  ``seconds / repeats`` each (after one warm-up call). A GEMM whose one
  call already takes that long (torch's bf16 on a CPU without bf16
  arithmetic: 0.3 GFLOP/s, 58 s for one 2048^3 call on Zen 3) is timed by
  that one call: six calls took six minutes."""
  run()
  t0 = time.perf_counter()
  run()
  best = time.perf_counter() - t0
  if best >= seconds / repeats:
    return flop / best / 1e9
  for _ in range(repeats):
    t0, n = time.perf_counter(), 0
    while True:
      run()
      n += 1
      if time.perf_counter() - t0 >= seconds / repeats:
        break
    best = min(best, (time.perf_counter() - t0) / n)
  return flop / best / 1e9


def _child_jax(shapes, dtypes, seconds):
  import jax  # pylint: disable=import-outside-toplevel
  ynnpack_isa.apply_from_environment()
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  out = []
  rs = np.random.RandomState(0)
  f = jax.jit(lambda a, b: jnp.matmul(a, b,
                                      preferred_element_type=jnp.float32))
  for dt in dtypes:
    for m, k, n in shapes:
      a = jnp.asarray(rs.standard_normal((m, k)), jnp.dtype(dt))
      b = jnp.asarray(rs.standard_normal((k, n)), jnp.dtype(dt))
      rate = _time_gemm(lambda: f(a, b).block_until_ready(), 2.0 * m * k * n,
                        seconds)
      out.append({"framework": "jax", "dtype": dt, "shape": [m, k, n],
                  "gflops": rate})
  return {"framework": "jax", "version": jax.__version__, "rates": out}


def _child_torch(shapes, dtypes, seconds):
  import torch  # pylint: disable=import-outside-toplevel
  out = []
  g = torch.Generator().manual_seed(0)
  for dt in dtypes:
    for m, k, n in shapes:
      a = torch.randn(m, k, generator=g).to(getattr(torch, dt))
      b = torch.randn(k, n, generator=g).to(getattr(torch, dt))
      with torch.inference_mode():
        rate = _time_gemm(lambda: a @ b, 2.0 * m * k * n, seconds)
      out.append({"framework": "torch", "dtype": dt, "shape": [m, k, n],
                  "gflops": rate})
  return {"framework": "torch", "version": torch.__version__,
          "threads": torch.get_num_threads(), "rates": out}


def measure_gemms(shapes: Sequence[Tuple[int, int, int]] = (SQUARE,),
                  frameworks: Sequence[str] = ("jax", "torch"),
                  dtypes: Sequence[str] = ("float32", "bfloat16"),
                  seconds: float = 0.6,
                  cpus: Optional[List[int]] = None,
                  wait_quiet_s: float = 0.0,
                  quiet_load: float = 0.3) -> Dict[str, Any]:
  """GEMM rates (GFLOP/s) of each framework and dtype on ``shapes``
  (M, K, N), each framework in its own child process (first waiting up to
  ``wait_quiet_s`` for other processes to use at most ``quiet_load``
  cores). Returns ``{"rates": [{framework, dtype, shape, gflops}, ...],
  "versions": ..., "other_load": {framework: cores other processes used
  meanwhile}}``."""
  from bench import harness  # pylint: disable=import-outside-toplevel
  shapes = [tuple(int(x) for x in s) for s in dict.fromkeys(
      tuple(s) for s in shapes)]
  env = dict(os.environ)
  env.setdefault("JAX_PLATFORMS", "cpu")
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (REPO, env.get("PYTHONPATH", "")) if p)
  rates, versions, other = [], {}, {}
  for fw in frameworks:
    spec = {"framework": fw, "shapes": shapes, "dtypes": list(dtypes),
            "seconds": seconds}
    if wait_quiet_s > 0:
      harness.wait_for_quiet(wait_quiet_s, quiet_load)
    busy0, t0 = harness.busy_cpu_seconds(), time.perf_counter()
    child0 = _children_cpu_seconds()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.machine", "--child", json.dumps(spec)],
        cwd=REPO, env=env, capture_output=True, text=True, check=False,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    wall = time.perf_counter() - t0
    other[fw] = max(0.0, (harness.busy_cpu_seconds() - busy0 -
                          (_children_cpu_seconds() - child0)) / wall)
    if proc.returncode:
      raise RuntimeError(f"GEMM timing in {fw} failed:\n{proc.stderr[-2000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    rates += res["rates"]
    versions[fw] = res["version"]
  return {"rates": rates, "versions": versions, "seconds": seconds,
          "other_load": other}


def _children_cpu_seconds() -> float:
  r = resource.getrusage(resource.RUSAGE_CHILDREN)
  return r.ru_utime + r.ru_stime


def roofline(gemms: Optional[Dict[str, Any]], dtype: str
             ) -> Optional[Dict[str, Any]]:
  """The best GEMM of ``dtype`` in a :func:`measure_gemms` result:
  ``{"gflops", "kind", "shape"}`` (None without measurements)."""
  if not gemms:
    return None
  cands = [r for r in gemms["rates"] if r["dtype"] == dtype]
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
  """A contestant's GFLOP/s as a share of the roofline, e.g. ``' 41%'``."""
  if not best or not best.get("gflops"):
    return "-"
  return f"{100.0 * gflops / best['gflops']:.0f}%"


def add_gemm_args(p: argparse.ArgumentParser):
  """The roofline options of every throughput table (bench.py, ab.py,
  scaling.py, export.py)."""
  p.add_argument("--gemm-seconds", type=float, default=0.6,
                 help="time per GEMM (framework, dtype, shape) for the "
                      "roofline measured in the same run")
  p.add_argument("--gemm-square", type=int, default=SQUARE[0],
                 help="side of the square GEMM timed beside the model's own "
                      "GEMM shapes")
  p.add_argument("--no-gemm", action="store_true",
                 help="skip the GEMM rates (no roofline column)")


def gemms_for(args, name: Optional[str] = None, batch: int = 8,
              image_size: int = 224, dtypes=("float32", "bfloat16")):
  """:func:`measure_gemms` for a table made with :func:`add_gemm_args`'s
  options: the square GEMM and (with ``name``) the model's own shapes, in
  JAX and (when installed) torch. None with ``--no-gemm``."""
  if args.no_gemm:
    return None
  frameworks = ["jax"]
  if importlib.util.find_spec("torch") is not None:
    frameworks.append("torch")
  shapes = [(args.gemm_square,) * 3]
  if name:
    shapes += model_gemm_shapes(name, batch, image_size)
  print(f"[gemm] timing {len(shapes)} shapes x {frameworks} x "
        f"{'/'.join(dtypes)} ...", file=sys.stderr, flush=True)
  return measure_gemms(shapes, frameworks, dtypes,
                       seconds=args.gemm_seconds,
                       cpus=getattr(args, "cpus", None),
                       wait_quiet_s=getattr(args, "wait_quiet", 0.0),
                       quiet_load=getattr(args, "quiet_load", 0.3))


def _child_main(spec_json: str):
  spec = json.loads(spec_json)
  real_stdout, sys.stdout = sys.stdout, sys.stderr  # framework logs aside
  fn = {"jax": _child_jax, "torch": _child_torch}[spec["framework"]]
  res = fn([tuple(s) for s in spec["shapes"]], spec["dtypes"],
           spec["seconds"])
  real_stdout.write(json.dumps(res) + "\n")
  real_stdout.flush()


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=None,
                 help="also time this variant's GEMM shapes (e.g. vit_b_16)")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--image-size", type=int, default=224)
  add_gemm_args(p)
  add_isa_arg(p)
  p.add_argument("--json", action="store_true")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    return _child_main(args.child)
  info = cpu_info()
  isa_line = set_isa(args.isa, info)
  gemms = gemms_for(args, args.model, args.batch, args.image_size)
  print(describe(info))
  print(isa_line)
  if gemms:
    print(format_gemms(gemms))
  if args.json:
    print(json.dumps({"machine": info, "gemms": gemms}))
  return {"machine": info, "gemms": gemms}


if __name__ == "__main__":
  main()
