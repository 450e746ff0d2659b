"""Caps XLA's YNNPACK GEMM kernels at AVX2 + FMA, for ``--isa avx2``.

XLA:CPU sends most float32 dots to YNNPACK, which picks its kernels from
CPUID and ignores ``--xla_cpu_max_isa``: on an AVX-512 CPU an "AVX2" run of
JAX would still multiply with AVX-512 kernels while torch's MKL runs AVX2,
and the emulated table would favour JAX. YNNPACK has no environment variable
or flag for this; it reads the CPU's features once, into the static
``flags`` of ``ynn::get_supported_arch_flags()``. This module finds that
function and its static in jaxlib's symbol table, calls the function (so the
static is initialised) and clears every bit above FMA3 in it, before the
first program is compiled.

Benchmarks only (``bench/machine.py`` sets ``VIT_JAX_BENCH_YNNPACK_ISA`` for
every child of an ``--isa avx2`` run); the library never touches it.
Measured on an AMD EPYC Zen 5 (2 vCPUs), (3152, 768) x (768, 3072) float32:
XLA native 363 GFLOP/s, with ``--xla_cpu_max_isa=AVX2`` alone 353, capped
here 204; MKL capped at AVX2 190
(bench/results/zen5_2026-11-25_ynnpack_cap_gemm.txt).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import struct
from typing import Dict, Iterable, Optional

ENV = "VIT_JAX_BENCH_YNNPACK_ISA"
# YNNPACK's x86 arch flags (ynnpack/base/arch.h): bit 0 sse2 ... bit 6 fma3;
# bit 7 onwards avx512f, avx512bw, ..., amx.
AVX2_FMA3_BITS = 0x7F
AVX512F_BIT = 1 << 7

_FUNC = "_ZN3ynn24get_supported_arch_flagsEv"
_FLAGS = "_ZZN3ynn24get_supported_arch_flagsEvE5flags"
_INT = {1: ctypes.c_uint8, 2: ctypes.c_uint16, 4: ctypes.c_uint32,
        8: ctypes.c_uint64}


def elf_symbols(path: str, names: Iterable[str],
                section: str = ".symtab") -> Dict[str, tuple]:
  """``{name: (value, size, shndx)}`` of the wanted symbols in a 64-bit
  little-endian ELF file's ``section`` (``.symtab`` or ``.dynsym``)."""
  want = set(names)
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0,
                                        access=mmap.ACCESS_READ) as data:
    return _symbols(data, path, want, section)


def _cstr(data, off: int) -> str:
  return data[off:data.find(b"\0", off)].decode("ascii", "replace")


def elf_sections(data, path: str) -> list:
  """``[(name, type, offset, size, link, entsize)]`` of a 64-bit
  little-endian ELF file's sections (``data``: its bytes)."""
  if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
    raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
  shoff, = struct.unpack_from("<Q", data, 0x28)
  shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
  raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
         for i in range(shnum)]
  shstr_off = raw[shstrndx][4]
  return [(_cstr(data, shstr_off + name), typ, off, size, link, entsize)
          for (name, typ, _, _, off, size, link, _, _, entsize) in raw]


def _symbols(data, path, want, section):
  sections = elf_sections(data, path)
  out = {}
  for name, _, off, size, link, entsize in sections:
    if name != section or not entsize:
      continue
    strtab = sections[link][2]
    for j in range(size // entsize):
      st_name, _, _, shndx, value, sym_size = struct.unpack_from(
          "<IBBHQQ", data, off + j * entsize)
      if st_name and shndx:
        sym = _cstr(data, strtab + st_name)
        if sym in want:
          out[sym] = (value, sym_size, shndx)
  return out


def _library() -> str:
  import jaxlib  # pylint: disable=import-outside-toplevel
  path = os.path.join(os.path.dirname(jaxlib.__file__), "libjax_common.so")
  if not os.path.exists(path):
    raise RuntimeError(f"{path}: not found (jaxlib's layout changed); "
                       "cannot cap YNNPACK's kernels")
  return path


def _load_base(path: str) -> int:
  """Where ``path`` is mapped in this process (its file-offset-0 mapping in
  /proc/self/maps; jaxlib's first PT_LOAD segment starts at address 0)."""
  real = os.path.realpath(path)
  with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
    for line in f:
      fields = line.split()
      if (len(fields) >= 6 and fields[5] == real and int(fields[2], 16) == 0):
        return int(fields[0].split("-")[0], 16)
  raise RuntimeError(f"{path}: not mapped in this process")


def cap(bits: int = AVX2_FMA3_BITS) -> tuple:
  """Clears every YNNPACK arch flag outside ``bits``; returns the flags
  ``(before, after)``. Call after ``import jax`` and before compiling."""
  import jax  # pylint: disable=import-outside-toplevel,unused-import
  path = _library()
  syms = elf_symbols(path, (_FUNC, _FLAGS))
  missing = [s for s in (_FUNC, _FLAGS) if s not in syms]
  if missing:
    raise RuntimeError(f"{path}: symbol(s) {missing} not found (YNNPACK "
                       "changed); cannot cap its kernels at AVX2")
  ctypes.CDLL(path)  # already loaded by jax; makes sure it is mapped
  base = _load_base(path)
  func = ctypes.CFUNCTYPE(ctypes.c_uint64)(base + syms[_FUNC][0])
  func()  # initialises the static
  ctype = _INT.get(syms[_FLAGS][1])
  if ctype is None:
    raise RuntimeError(f"{_FLAGS}: unexpected size {syms[_FLAGS][1]}")
  flags = ctype.from_address(base + syms[_FLAGS][0])
  before = int(flags.value)
  flags.value = before & bits
  return before, int(flags.value)


def apply_from_environment() -> Optional[tuple]:
  """Applies ``$VIT_JAX_BENCH_YNNPACK_ISA`` (``avx2`` or unset); returns
  ``cap()``'s ``(before, after)`` or None when unset."""
  value = os.environ.get(ENV, "")
  if not value:
    return None
  if value.lower() != "avx2":
    raise ValueError(f"${ENV}={value!r}: expected 'avx2' or unset")
  return cap()
