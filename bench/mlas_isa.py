"""Caps onnxruntime's MLAS kernels at AVX2 + FMA, for ``--isa avx2``.

onnxruntime's CPU provider multiplies with MLAS, which reads CPUID once,
when the library loads, and fills its table of kernels (``MLAS_PLATFORM``)
with the AVX-512 ones where the CPU and the OS have AVX-512F. It has no
environment variable or option for a smaller ISA, and the Python wheel is
stripped of MLAS's symbols, so the table cannot be reached the way
``bench/ynnpack_isa.py`` reaches YNNPACK's flags. This module makes a copy
of the installed ``onnxruntime`` package (every file a link to the
original, except the extension module) in which two checks are changed:

- MLAS's gate to its AVX-512 kernels, ``(Cpuid7.EBX & 0x10000) != 0 &&
  (XCR0 & 0xE0) == 0xE0``: the ``test reg, 0x10000`` before the XCR0 test
  becomes ``test reg, 0``, so the gate is never passed and MLAS keeps the
  AVX2 + FMA3 kernels it had chosen before it (as on a Zen 3);
- onnxruntime's ``CPUIDInfo`` (what its other kernels ask): the comparisons
  ``(XCR0 & 0xE6) == 0xE6`` become ``== 0xE7``, never true, so it reports
  no AVX-512F, AVX-512 (Skylake) or AVX-512 BF16.

The copy is made once per build of the extension (keyed by its hash) under
``$XDG_CACHE_HOME/vit_jax_bench/mlas_avx2`` and put first on ``sys.path``
of the onnxruntime child before it imports onnxruntime. A build whose code
does not match (another compiler, another MLAS) is refused with an error;
nothing is patched by guess. The installed package is never modified.

Benchmarks only (``bench/machine.py`` sets ``VIT_JAX_BENCH_MLAS_ISA`` for
every child of an ``--isa avx2`` run); the library never touches it.
``python bench/mlas_isa.py`` prints what it changes and times onnxruntime's
float32 MatMul (constant right operand, as a model's weights) native and
capped, each in a child process of its own. Measured on an AMD EPYC Zen 5
(2 vCPUs), onnxruntime 1.32.0: 2048^3 468-471 GFLOP/s native, 256-258
capped, as XLA's and MKL's capped GEMMs
(bench/results/zen5_2026-11-26_mlas_cap.txt).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import List, Optional, Tuple

ENV = "VIT_JAX_BENCH_MLAS_ISA"

# MLAS_PLATFORM's constructor (mlas/lib/platform.cpp), x86-64 as GCC emits
# it: `test r32, 0x10000` (CPUID leaf 7 EBX, AVX512F), `je` over the
# AVX-512 block, then, within a few instructions, `test al, 0xE0` on ~XCR0.
_MLAS_GATE = re.compile(
    rb"(\x41?\xf7[\xc0-\xc7])(\x00\x00\x01\x00)\x74.(?:.{0,16}?)\xa8\xe0",
    re.S)
# CPUIDInfo::X86Init: `and r32, 0xE6` on XCR0, then, within a few hundred
# bytes, `cmp r32, 0xE6` on the same register twice (once for AVX-512F and
# Skylake, once for AVX-512 BF16).
_CPUID_AND = re.compile(rb"(\x41?)\x81([\xe0-\xe7])\xe6\x00\x00\x00")
_CPUID_SPAN = 256
_CPUID_CMPS = 2


def _text_range(data) -> Tuple[int, int]:
  """File offset and size of the ELF ``.text`` section."""
  from bench import ynnpack_isa  # pylint: disable=import-outside-toplevel
  for name, _, off, size, _, _ in ynnpack_isa.elf_sections(data, "<data>"):
    if name == ".text":
      return off, size
  raise ValueError("no .text section")


def patch(data: bytearray) -> List[str]:
  """Switches MLAS's and CPUIDInfo's AVX-512 checks off in ``data`` (the
  bytes of onnxruntime's extension module), in place; returns what was
  changed. Raises ValueError, changing nothing, where the code is not the
  one this module knows."""
  start, size = _text_range(data)
  text = bytes(data[start:start + size])
  gates = list(_MLAS_GATE.finditer(text))
  if len(gates) != 1:
    raise ValueError(
        f"MLAS's AVX-512F gate (test reg, 0x10000; je; test al, 0xE0) found "
        f"{len(gates)} times in .text, expected once: this onnxruntime build "
        "is not one bench/mlas_isa.py knows; its kernels cannot be capped")
  g = gates[0]
  edits = [(start + g.start(2), b"\x00\x00\x00\x00",
            f"MLAS AVX-512F gate at {start + g.start():#x}: "
            "test reg, 0x10000 -> test reg, 0")]
  groups = []  # per `and reg, 0xE6`: the offsets of its `cmp reg, 0xE6`
  for a in _CPUID_AND.finditer(text):
    rex, modrm = a.group(1), a.group(2)[0]
    cmp = rex + bytes([0x81, 0xf8 + (modrm - 0xe0)]) + b"\xe6\x00\x00\x00"
    window = text[a.end():a.end() + _CPUID_SPAN]
    found, pos = [], window.find(cmp)
    while pos >= 0:
      at = start + a.end() + pos  # the instruction; its immediate follows
      found.append((at + len(rex) + 2, at))
      pos = window.find(cmp, pos + 1)
    if found:
      groups.append(found)
  if len(groups) != 1 or len(groups[0]) != _CPUID_CMPS:
    raise ValueError(
        "onnxruntime's CPUIDInfo checks of XCR0 (and reg, 0xE6; then "
        f"{_CPUID_CMPS} x cmp reg, 0xE6) found as "
        f"{[[hex(at) for _, at in g] for g in groups]} in .text, "
        "expected one such group: this onnxruntime build is not one "
        "bench/mlas_isa.py knows; its kernels cannot be capped")
  for imm, at in groups[0]:
    edits.append((imm, b"\xe7", f"CPUIDInfo XCR0 check at {at:#x}: "
                  "cmp reg, 0xE6 -> 0xE7"))
  for at, new, _ in edits:
    data[at:at + len(new)] = new
  return [e[2] for e in edits]


def _extension(package: str) -> str:
  found = glob.glob(os.path.join(package, "capi",
                                 "onnxruntime_pybind11_state*.so"))
  if len(found) != 1:
    raise RuntimeError(f"{package}/capi: expected one "
                       f"onnxruntime_pybind11_state*.so, found {found}")
  return found[0]


def _installed_package() -> str:
  """The onnxruntime package directory, found without importing it."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.find_spec("onnxruntime")
  if spec is None or not spec.submodule_search_locations:
    raise RuntimeError("onnxruntime is not installed")
  return list(spec.submodule_search_locations)[0]


def capped_package(cache: Optional[str] = None) -> str:
  """A directory whose ``onnxruntime`` is the installed one with MLAS's
  AVX-512 kernels switched off (made once, then reused)."""
  src = _installed_package()
  ext = _extension(src)
  with open(ext, "rb") as f:
    data = bytearray(f.read())
  # Keyed by the build and by where it is installed: the copy's other files
  # are links into that installation.
  key = hashlib.sha256(data + os.path.realpath(src).encode()).hexdigest()[:16]
  cache = cache or os.path.join(
      os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
      "vit_jax_bench", "mlas_avx2")
  root = os.path.join(cache, key)
  if os.path.isfile(os.path.join(root, "onnxruntime", "__init__.py")):
    return root
  os.makedirs(cache, exist_ok=True)
  changes = patch(data)
  partial = tempfile.mkdtemp(prefix=f"{key}.", dir=cache)
  try:
    dst = os.path.join(partial, "onnxruntime")
    shutil.copytree(src, dst, symlinks=True, copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__"))
    target = os.path.join(dst, os.path.relpath(ext, src))
    os.unlink(target)
    with open(target, "wb") as f:
      f.write(data)
    os.chmod(target, 0o755)
    with open(os.path.join(partial, "PATCHED.txt"), "w",
              encoding="utf-8") as f:
      f.write(f"{ext}\n" + "\n".join(changes) + "\n")
    try:
      os.rename(partial, root)  # whole, or not at all
    except OSError:  # another child made it first
      if not os.path.isdir(os.path.join(root, "onnxruntime")):
        raise
  finally:
    shutil.rmtree(partial, ignore_errors=True)
  return root


def apply_from_environment() -> Optional[str]:
  """Applies ``$VIT_JAX_BENCH_MLAS_ISA`` (``avx2`` or unset) before
  onnxruntime is imported: puts the capped copy first on ``sys.path``;
  returns its directory, or None when unset."""
  value = os.environ.get(ENV, "")
  if not value:
    return None
  if value.lower() != "avx2":
    raise ValueError(f"${ENV}={value!r}: expected 'avx2' or unset")
  if "onnxruntime" in sys.modules:
    raise RuntimeError("onnxruntime is already imported; its kernels can "
                       "only be capped before the first import")
  root = capped_package()
  sys.path.insert(0, root)
  return root


_GEMM_CHILD = """
import sys, time, numpy as np
sys.path.insert(0, sys.argv[1])
from bench import mlas_isa
mlas_isa.apply_from_environment()
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
m, k, n = (int(v) for v in sys.argv[2:5])
rs = np.random.RandomState(0)
a = rs.standard_normal((m, k)).astype(np.float32)
b = rs.standard_normal((k, n)).astype(np.float32)
g = helper.make_graph(
    [helper.make_node("MatMul", ["a", "b"], ["c"])], "g",
    [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
    [helper.make_tensor_value_info("c", TensorProto.FLOAT, [m, n])],
    initializer=[numpy_helper.from_array(b, "b")])
model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 8
s = ort.InferenceSession(model.SerializeToString(),
                         providers=["CPUExecutionProvider"])
for _ in range(3):
  s.run(None, {"a": a})
t, calls = time.perf_counter(), 0
while time.perf_counter() - t < float(sys.argv[5]):
  s.run(None, {"a": a})
  calls += 1
print(2 * m * k * n * calls / (time.perf_counter() - t) / 1e9)
"""


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description="onnxruntime's MatMul GFLOP/s, "
                              "native and with MLAS capped at AVX2")
  p.add_argument("--shapes", default="2048x2048x2048,1576x768x3072",
                 help="comma-separated MxKxN")
  p.add_argument("--seconds", type=float, default=3.0)
  p.add_argument("--rounds", type=int, default=2)
  args = p.parse_args(argv)
  from bench import machine  # pylint: disable=import-outside-toplevel
  print(machine.describe())
  ext = _extension(_installed_package())
  with open(ext, "rb") as f:
    changes = patch(bytearray(f.read()))
  print(f"{ext}:\n  " + "\n  ".join(changes))
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  capped_package()  # made once, before the timed children
  for shape in args.shapes.split(","):
    m, k, n = shape.split("x")
    got = {"native": [], "avx2": []}
    for _ in range(args.rounds):
      for isa in got:
        env = {key: v for key, v in os.environ.items() if key != ENV}
        if isa == "avx2":
          env[ENV] = "avx2"
        out = subprocess.run(
            [sys.executable, "-c", _GEMM_CHILD, repo, m, k, n,
             str(args.seconds)], env=env, cwd=tempfile.gettempdir(),
            capture_output=True, text=True, check=True)
        got[isa].append(float(out.stdout.split()[-1]))
    print(f"{shape:>16s}  onnxruntime MatMul GFLOP/s: native " +
          " ".join(f"{v:.0f}" for v in got["native"]) + ", MLAS capped at "
          "AVX2 " + " ".join(f"{v:.0f}" for v in got["avx2"]))
  return 0


if __name__ == "__main__":
  if __package__ in (None, ""):  # `python bench/mlas_isa.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
  sys.exit(main())
