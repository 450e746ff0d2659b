"""Where a step spends its time, op by op, JAX against torch on the same
model and batch; with ``--ablate``, what each group of ops costs it.

    python bench/ops.py --model vit_ti_16 --batch 16 [--ablate] [--isa avx2]
    python bench/ops.py --trace DIR/jax DIR/torch_default.trace.json --steps 3

Each framework in its own child (``worker.ops_main``). JAX: the thunks of a
``jax.profiler`` trace of the step, grouped by what their HLO computes;
torch: ``torch.profiler``'s aten ops, grouped alike. XLA:CPU runs
independent ops at once, an op's time including its wait for a thread:
this shows where ops are, not what they cost. ``--ablate`` measures that:
the step with a group replaced by a near-free stand-in in both frameworks
(:data:`ABLATIONS`; "all": the three at once), the variants timed in
rotation over ``--rounds``; a group's cost is the full step minus the step
without it, paired within a round. ``--trace``: the traces
``accelerator.py --profile DIR`` saved (a GPU's ops), read back.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import math
import os
import re
import statistics
import sys

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness, machine  # noqa: E402  pylint: disable=wrong-import-position

GROUPS = ("dense GEMMs", "attention matmuls", "softmax", "LayerNorm", "GELU",
          "patch embedding", "optimizer", "layout copies", "loss + other")
# The groups a stand-in replaces in both frameworks, and the stand-in.
ABLATIONS = {
    "attention": "v + (q + k) * 1e-30 (projections and head layout kept)",
    "LayerNorm": "x * scale + bias",
    "GELU": "identity",
}
_TINY = 1e-30


# JAX: HLO instructions -> groups.
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ([^=]+?) (\w[\w\-]*)\(")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_META = re.compile(r'op_name="([^"]*)"')
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")
_LHS_C = re.compile(r'lhs_contracting_dim(?:s=\{|ensions":\[)([\d",]*)')


def _dot_flops(shape: str, args: str, line: str, shapes: dict) -> int:
  """2 x output elements x contracted size of a dot / cuBLAS GEMM line
  (``args``: its text after the opcode's parenthesis); the left operand's
  shape inline or from its definition (``shapes``)."""
  lhs = _SHAPE.match(args.strip()) or _SHAPE.match(
      shapes.get(args.split(",")[0].strip(" %)"), ""))
  out, contract = _SHAPE.search(shape), _LHS_C.search(line)
  if not (out and lhs and contract):
    return 0
  lhs, out, contract = ([int(d) for d in m.group(1).replace('"', "").split(",")
                        if d] for m in (lhs, out, contract))
  return 2 * math.prod(out) * math.prod(lhs[c] for c in contract)


def parse_hlo(text: str):
  """{instruction: (opcode, [called computations], [op_name], FLOPs)} and
  {computation: [instruction names]} of an HLO module's text; a cuBLAS
  GEMM counts as a dot, cuDNN's fused attention as "fmha"."""
  instrs, comps, current, shapes, dots = {}, {}, None, {}, []
  for line in text.split("\n"):
    s = line.strip()
    if s.endswith("{") and ("(" in s) and "=" not in s.split("(")[0]:
      current = s.split()[0].lstrip("%") if not s.startswith("ENTRY") else (
          s.split()[1].lstrip("%"))
      comps[current] = []
      continue
    m = _INSTR.match(line)
    if m and current is not None:
      name, opcode = m.group(1), m.group(3)
      shapes[name] = m.group(2).strip().lstrip("(")
      if opcode == "custom-call" and "$fmha" in line:
        opcode = "fmha"
      elif opcode == "custom-call" and "__cublas" in line:
        opcode = "dot"
      if opcode == "dot":
        dots.append((name, m.group(2), line[m.end():], line))
        if re.search(r'lhs_batch_dim(s=\{\d|ensions":\["?\d)', line):
          opcode = "batched-dot"  # attention's (B*H, N, .) products
      instrs[name] = (opcode, _CALLS.findall(line), _META.findall(line), 0)
      comps[current].append(name)
  for name, shape, args, line in dots:
    instrs[name] = instrs[name][:3] + (_dot_flops(shape, args, line, shapes),)
  return instrs, comps


def _inner(name, instrs, comps, seen=None):
  """Opcodes, op_names and FLOPs of an instruction and of everything in
  the computations it calls."""
  seen = seen if seen is not None else set()
  opcode, calls, meta, flops = instrs.get(name, ("?", [], [], 0))
  ops, metas = {opcode}, list(meta)
  for c in set(calls) - seen:
    seen.add(c)
    for i in comps.get(c, ()):
      o, m, f = _inner(i, instrs, comps, seen)
      ops |= o
      metas += m
      flops += f
  return ops, metas, flops


def group_of(ops, metas) -> str:
  """An XLA instruction's group from its ops and the op_names JAX wrote
  (``jit(train_step)/jvp(VisionTransformer)/.../query/dot_general``); ops
  outside the model and its gradient are the optimizer's update."""
  text = " ".join(metas).lower()
  in_model = any(k in text for k in ("visiontransformer", "jvp(",
                                     "transpose(", "softmax_cross_entropy"))
  if metas and not in_model:
    return "optimizer"
  if ops & {"batched-dot", "fmha"}:  # (B*H, N, .) x (B*H, ., .), fused
    return "attention matmuls"
  if ops & {"dot", "convolution"}:  # 2-D (tokens, width) GEMMs
    if "convolution" in ops or "embedding" in text:
      return "patch embedding"
    return "dense GEMMs"
  if "softmax_cross_entropy" in text or "log_softmax" in text:
    return "loss + other"
  if "layernorm" in text or "encoder_norm" in text:
    return "LayerNorm"
  if "attention" in text and "exponential" in ops:
    return "softmax"  # scale, max, exp, sum, divide of the scores
  if "mlpblock" in text or "erf" in ops:
    return "GELU"  # with the bias adds fused into it
  if ops <= {"copy", "transpose", "bitcast", "reshape", "broadcast",
             "parameter", "tuple", "get-tuple-element", "slice",
             "concatenate", "dynamic-update-slice", "pad", "fusion"}:
    return "layout copies"
  return "loss + other"


def op_times(trace_dir: str, counts=None):
  """({HLO instruction: total ns}, busy ns, span ns) of the newest
  ``jax.profiler`` trace under ``trace_dir``: the ops of the first device
  plane that has them (GPU, TPU), else the host's XLA thunks (CPU). Busy:
  the union of the ops' intervals; span: first start to last end.
  ``counts`` (a Counter), if given, gets each op's number of runs: XLA's
  GPU kernels of identical fusions run under the first one's name, as a
  scanned layer's ops run once per layer."""
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                           recursive=True))
  if not files:
    raise RuntimeError(f"no *.xplane.pb under {trace_dir}")
  planes = list(ProfileData.from_file(files[-1]).planes)
  devices = [p for p in planes if p.name.startswith("/device:")
             and any(True for ln in p.lines for _ in ln.events)]
  # A device's "XLA Ops" line where the profiler writes one; else its
  # streams' kernels (jax 0.11 on a GPU, the step one CUDA graph: each
  # kernel named by its fusion, or by cuBLAS's / cuDNN's kernel name).
  dev = devices and ([ln for ln in devices[0].lines if ln.name == "XLA Ops"]
                     or list(devices[0].lines))
  lines = dev or [ln for p in planes if p.name == "/host:CPU"
                  for ln in p.lines if ln.name.startswith("tf_XLA")]
  out, spans = collections.Counter(), []
  for ln in lines:
    for e in ln.events:
      if not e.name.startswith(("end: ", "Thread", "ThunkExecutor")):
        out[e.name] += e.duration_ns
        spans.append((e.start_ns, e.end_ns))
        if counts is not None:
          counts[e.name] += 1
  return (out,) + _busy_span(spans)


def _busy_span(spans):
  """The union of the (start, end) intervals' lengths, and first start to
  last end."""
  busy, end = 0.0, float("-inf")
  for a, b in sorted(spans):
    busy, end = busy + max(0.0, b - max(a, end)), max(end, b)
  return busy, end - min(spans)[0] if spans else 0.0


def _tally(items, per: float):
  """{group: total / per} and {"group: name": total / per} of (group,
  name, time) items."""
  groups, detail = collections.Counter(), collections.Counter()
  for g, name, t in items:
    groups[g] += t / per
    detail[f"{g}: {name}"] += t / per
  return groups, detail


def jax_groups(times, hlo: str, steps: int, counts=None):
  """:func:`_tally` of :func:`op_times`' ops (ms per step), each grouped by
  what its instruction in ``hlo`` computes; and each one's FLOPs in all
  its ``counts`` runs (default one per step)."""
  instrs, comps = parse_hlo(hlo)
  inner = {n: _inner(n, instrs, comps) for n in
           (_hlo_name(t, instrs) for t in times) if n in instrs}
  group = {n: group_of(*inner[_hlo_name(n, instrs)][:2])
           if _hlo_name(n, instrs) in inner else kernel_group(n)
           for n in times}
  inner = {n: inner[_hlo_name(n, instrs)] for n in times
           if _hlo_name(n, instrs) in inner}
  runs = lambda n: counts[n] / steps if counts else 1  # noqa: E731
  flops = {f"{group[n]}: {n}": inner[n][2] * runs(n) if n in inner else 0
           for n in times}
  return _tally(((group[n], n, ns / 1e6) for n, ns in times.items()),
                steps) + (flops,)


def _hlo_name(name: str, instrs) -> str:
  """A trace's op name as the HLO's instruction: a GPU kernel of a fusion
  is named ``loop_add_fusion_11`` for ``loop_add_fusion.11``."""
  if name in instrs:
    return name
  dotted = re.sub(r"_(\d+)$", r".\1", name)
  return dotted if dotted in instrs else name


def kernel_group(name: str) -> str:
  """A CUDA kernel's group by its name: JAX's cuBLAS and cuDNN kernels,
  which the HLO does not name (see :func:`torch_kernel_group`); anything
  else is a fusion the HLO names."""
  n = name.lower()
  if any(k in n for k in ("sdpa", "fmha", "flash", "dot_do_o",
                          "convert_dq")):
    return "attention matmuls"
  if any(k in n for k in ("nvjet", "gemm", "cutlass", "xmma", "splitk",
                          "cublas")):
    return "dense GEMMs"
  if n.startswith(("memset", "memcpy")):
    return "layout copies"
  return "loss + other"


def hlo_dot_flops(hlo: str) -> int:
  """FLOPs of every GEMM in an HLO module's text (dots, cuBLAS calls,
  batched ones such as XLA's merged kernel gradients, the dots inside GEMM
  fusions), each counted once: one step's where no loop repeats them
  (``scan_layers`` off)."""
  instrs, _ = parse_hlo(hlo)
  return sum(f for op, _, metas, f in instrs.values()
             if op in ("dot", "batched-dot"))


# Each ablation variant: the groups its stand-ins replace.
VARIANTS = {"": [], **{g: [g] for g in ABLATIONS}, "all": list(ABLATIONS)}


def _sdpa(q, k, v, *args, **kwargs):  # torch's q, k, v: (B, H, N, hd)
  del args, kwargs
  return v + ((q.sum(-2, keepdim=True) if q.shape != k.shape else q) + k) * _TINY


def _attention(qh, kh, vh, scale, bias=None):  # kernels.attention
  del scale, bias
  return vh + ((qh.sum(axis=2, keepdims=True) if qh.shape != kh.shape
                else qh) + kh) * _TINY


# The stand-ins, by group: the functions they replace, in
# vit_jax.models.kernels (looked up when JAX traces the model) and in
# torch.nn.functional (called by torchvision's ViT at every step).
JAX_STAND_INS = {
    "attention": {"attention": _attention},
    "LayerNorm": {"layer_norm": lambda x, scale, bias, eps, out_dtype: (
        (x if scale is None else x * scale) + (0 if bias is None else bias)
    ).astype(out_dtype)},
    "GELU": {"bias_gelu": lambda y, bias: y + bias}}
TORCH_STAND_INS = {
    "attention": {"scaled_dot_product_attention": _sdpa},
    "LayerNorm": {"layer_norm": lambda x, shape, weight=None, bias=None,
                  eps=1e-5: (x if weight is None else x * weight) + (
                      0 if bias is None else bias)},
    "GELU": {"gelu": lambda x, approximate="none": x}}


@contextlib.contextmanager
def stand_ins(module, table, variant):
  """The stand-ins of ``variant``'s groups in place in ``module``."""
  new = {k: f for g in VARIANTS[variant] for k, f in table[g].items()}
  saved = {k: getattr(module, k) for k in new}
  try:
    for k, f in new.items():
      setattr(module, k, f)
    yield
  finally:
    for k, f in saved.items():
      setattr(module, k, f)


def standing_in(module, table, variant, step):
  """``step`` run with ``variant``'s stand-ins in place in ``module``."""
  def run():
    with stand_ins(module, table, variant):
      return step()
  return run


_TORCH_LAYOUT = {"aten::copy_", "aten::clone", "aten::contiguous",
                 "aten::transpose", "aten::permute", "aten::_to_copy",
                 "aten::cat", "aten::view", "aten::reshape", "aten::t",
                 "aten::expand", "aten::_unsafe_view", "aten::as_strided",
                 "aten::flatten", "aten::select", "aten::slice",
                 "aten::unflatten", "aten::squeeze", "aten::unsqueeze"}


def torch_group(name: str, in_optimizer: bool = False) -> str:
  n = name.lower()
  if in_optimizer or "optimizer.step" in n:
    return "optimizer"
  if ("scaled_dot_product" in n or "flash_attention" in n or
      n in ("aten::bmm", "aten::baddbmm")):
    return "attention matmuls"
  if "convolution" in n or "conv2d" in n:
    return "patch embedding"
  if n in ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul") or (
      "mkldnn_matmul" in n):
    return "dense GEMMs"
  if "log_softmax" in n or "nll_loss" in n or "cross_entropy" in n:
    return "loss + other"
  if "softmax" in n:
    return "softmax"
  if "layer_norm" in n:
    return "LayerNorm"
  if "gelu" in n:
    return "GELU"
  if n in _TORCH_LAYOUT or n.endswith(("viewbackward0", "transposebackward0",
                                       "permutebackward0",
                                       "reshapealiasbackward0")):
    return "layout copies"
  return "loss + other"


def _under_optimizer(ev) -> bool:
  p = ev.cpu_parent
  while p is not None and not p.name.startswith("Optimizer.step"):
    p = p.cpu_parent
  return p is not None


def torch_op_groups(events, steps: int):
  """:func:`_tally` of ``torch.profiler``'s events (self CPU ms per step)."""
  return _tally(((torch_group(ev.name, _under_optimizer(ev)), ev.name,
                  ev.self_cpu_time_total / 1e3) for ev in events
                 if ev.self_cpu_time_total > 0), steps)


# Reading traces saved elsewhere (bench/accelerator.py --profile DIR).
def read_jax_trace(trace_dir: str, steps: int):
  """The groups (ms per step), the idle time and the largest ops of a
  saved ``jax.profiler`` trace, named by ``step.hlo.txt`` beside it; a
  GEMM's or attention op's achieved TFLOP/s beside its time."""
  counts = collections.Counter()
  times, busy, span = op_times(trace_dir, counts)
  with open(os.path.join(trace_dir, "step.hlo.txt")) as f:
    hlo = f.read()
  groups, detail, flops = jax_groups(times, hlo, steps, counts)
  groups["idle (no op running)"] = (span - busy) / 1e6 / steps
  top = [(k, ms, flops[k] / ms / 1e9 if flops[k] else None)
         for k, ms in detail.most_common(20)]
  gemm_ms = groups.get("dense GEMMs", 0.0) + groups.get("patch embedding",
                                                        0.0)
  instrs, _ = parse_hlo(hlo)
  named_by_kernel = any(_hlo_name(n, instrs) not in instrs and
                        kernel_group(n) == "dense GEMMs" for n in times)
  total = hlo_dot_flops(hlo)
  # A GPU's cuBLAS kernels carry no HLO name, so each GEMM's rate is
  # unknown; all of them together (every dot, batched ones included, runs
  # as such a kernel there):
  if named_by_kernel and gemm_ms and total:
    top.append(("all GEMMs (the HLO's dot FLOPs over the GEMM groups' "
                "time)", gemm_ms, total / gemm_ms / 1e9))
  return groups, top


def torch_kernel_group(name: str) -> str:
  """A CUDA kernel's group by its name (eager ATen kernels, cuBLAS /
  CUTLASS GEMMs, torch.compile's Triton kernels named by what they fuse)."""
  n = name.lower()
  for g, keys in (("attention matmuls", ("flash", "fmha", "attention",
                                         "sdpa", "dot_do_o", "convert_dq")),
                  ("dense GEMMs", ("gemm", "cutlass", "nvjet", "xmma",
                                   "_mm_", "triton_tem_fused")),
                  ("optimizer", ("adam", "foreach", "multi_tensor")),
                  ("patch embedding", ("conv", "implicit")),
                  ("loss + other", ("nll", "cross_entropy", "log_softmax")),
                  ("softmax", ("softmax",)), ("LayerNorm", ("layer_norm",)),
                  ("GELU", ("gelu",)),
                  ("layout copies", ("copy", "transpose", "permute", "cat"))):
    if any(k in n for k in keys):
      return g
  return "loss + other"


def read_torch_trace(path: str, steps: int):
  """The same for a ``torch.profiler`` Chrome trace with CUDA kernels."""
  with open(path) as f:
    events = [e for e in json.load(f)["traceEvents"]
              if e.get("cat") == "kernel" and e.get("ph") == "X"]
  if not events:
    raise SystemExit(f"{path}: no CUDA kernels in this trace (a CPU run's "
                     "torch ops are in `bench/ops.py` without --trace)")
  groups, detail = _tally(((torch_kernel_group(e["name"]), e["name"][:90],
                            e["dur"] / 1e3) for e in events), steps)
  busy, span = _busy_span([(e["ts"], e["ts"] + e["dur"]) for e in events])
  groups["idle (no op running)"] = (span - busy) / 1e3 / steps
  return groups, [(k, ms, None) for k, ms in detail.most_common(20)]


def trace_label(path: str, paths) -> str:
  """A trace's column name: its file or folder name, with the folder above
  it where two would read the same (DIR1/jax, DIR2/jax)."""
  name = lambda p: os.path.basename(p.rstrip("/"))  # noqa: E731
  if sum(name(p) == name(path) for p in paths) > 1:
    return "/".join(os.path.normpath(path).split(os.sep)[-2:])
  return name(path)


def format_traces(tables: dict) -> str:
  """Side-by-side groups (ms per step, share of the step) of traces."""
  names = list(tables)
  lines = [f"{'group':22}" + "".join(f" {n[:24]:>24}" for n in names)]
  for g in GROUPS + ("idle (no op running)", "step"):
    row = f"{g:22}"
    for n in names:
      groups = tables[n][0]
      total = sum(groups.values())
      ms = total if g == "step" else groups.get(g, 0.0)
      row += f" {ms:10.2f} ms {100 * ms / total:6.1f} %  "
    lines.append(row)
  for n in names:
    lines += ["", f"largest ops of {n} (ms/step, achieved TFLOP/s):"]
    lines += [f"  {ms:8.3f}  {'' if tf is None else f'{tf:7.2f} TF/s'} "
              f"{name}" for name, ms, tf in tables[n][1]]
  return "\n".join(lines)


# the parent.
def ablation_costs(walls: dict) -> dict:
  """{fw: {group: (median, min, max)}}: a group's cost is the full step
  minus the step without it, paired within each round; 'the rest' is the
  step with every stand-in, 'step' the full step."""
  out = {}
  for fw, w in walls.items():
    costs = {g: [a - b for a, b in zip(w[""], w[g])] for g in ABLATIONS}
    costs["the rest"], costs["step"] = w["all"], w[""]
    out[fw] = {g: (statistics.median(c), min(c), max(c))
               for g, c in costs.items()}
  return out


def format_ablation(res: dict) -> str:
  c = res["costs"]
  lines = [
      f"{res['model']} {res['mode']} float32 batch {res['batch']} "
      f"{res['image_size']}px: what each group costs the step in wall ms "
      f"(the step minus the step with the group replaced by a stand-in in "
      f"both frameworks; median of {res['rounds']} rounds (min..max), "
      f"{res['steps']} steps per variant and round, the variants of a "
      f"framework in one process)", "",
      f"{'group':10} {'stand-in':54} {'JAX ms':>22} {'torch ms':>22} "
      f"{'JAX - torch':>11}"]
  rows = list(ABLATIONS.items()) + [
      ("the rest", "all three: GEMMs, embedding, loss, optimizer, copies"),
      ("step", "nothing replaced")]
  cell = lambda m: f"{m[0]:.1f} ({m[1]:.1f}..{m[2]:.1f})"  # noqa: E731
  for g, what in rows:
    j, t = c["jax"][g], c["torch"][g]
    lines.append(f"{g:10} {what:54} {cell(j):>22} {cell(t):>22} "
                 f"{j[0] - t[0]:+11.1f}")
  return "\n".join(lines)


def format_table(res: dict) -> str:
  j, t = res["jax"], res["torch"]
  lines = [
      f"{res['model']} {res['mode']} float32 batch {res['batch']} "
      f"{res['image_size']}px; step wall ms: JAX {j['wall_ms']:.1f}, torch "
      f"{t['wall_ms']:.1f} (torch / JAX {t['wall_ms'] / j['wall_ms']:.2f}x)",
      "", f"{'group':20} {'JAX ms':>8} {'torch ms':>9} {'JAX - torch':>12}"]
  for g in GROUPS + ("sum of ops",):
    a, b = (sum(x["groups"].values()) if g == "sum of ops" else
            x["groups"].get(g, 0.0) for x in (j, t))
    lines.append(f"{g:20} {a:8.2f} {b:9.2f} {a - b:+12.2f}")
  if a > 1.2 * j["wall_ms"]:
    lines.append(
        f"JAX's ops overlap: their times add up to {a / j['wall_ms']:.1f}x "
        "the step (XLA runs independent ops at once; an op's time includes "
        "waiting for a thread). --ablate measures what each group costs.")
  for fw in ("jax", "torch"):
    lines += ["", f"largest {fw} ops (ms/step):"]
    lines += [f"  {ms:8.2f}  {name}" for name, ms in res[fw]["top"]]
  return "\n".join(lines)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  for flag, v in (("--model", "vit_ti_16"), ("--batch", 16),
                  ("--image-size", 224), ("--layers", 0), ("--steps", 5),
                  ("--warmup", 3), ("--top", 12), ("--rounds", 3)):
    p.add_argument(flag, type=type(v), default=v)
  p.add_argument("--mode", choices=("train", "infer"), default="train")
  p.add_argument("--ablate", action="store_true",
                 help="what each group costs the step in wall time")
  p.add_argument("--json", action="store_true")
  p.add_argument("--trace", nargs="+", metavar="PATH",
                 help="read saved traces instead (bench/accelerator.py "
                      "--profile DIR: DIR/jax, DIR/torch_*.trace.json), "
                      "--steps traced steps each")
  machine.add_args(p, gemm=False)
  args = p.parse_args(argv)
  if args.trace:
    tables = {trace_label(t, args.trace): (
        read_jax_trace(t, args.steps) if os.path.isdir(t) else
        read_torch_trace(t, args.steps)) for t in args.trace}
    print(format_traces(tables))
    return tables
  isa_line = machine.set_isa(args.isa)
  spec = dict(harness.Workload(
      name=args.model, mode=args.mode, batch=args.batch, warmup=args.warmup,
      image_size=args.image_size, layers=args.layers).spec(), **{
          k: v for k, v in vars(args).items() if k not in ("isa", "json")})
  res = dict(spec, machine=machine.cpu_info(), isa=args.isa,
             isa_line=isa_line, load_before=os.getloadavg()[0])
  got = {fw: harness.call("ops", dict(spec, framework=fw), fw,
                          env={"TF_CPP_MIN_LOG_LEVEL": "3"})
         for fw in ("jax", "torch")}
  res["load_after"] = os.getloadavg()[0]
  if args.ablate:
    res["walls"] = {fw: g["walls"] for fw, g in got.items()}
    res["first"] = {fw: g["first"] for fw, g in got.items()}
    res["costs"] = ablation_costs(res["walls"])
  else:
    res.update(got)
  harness.emit(f"{machine.describe(res['machine'])}\n{isa_line}\n"
               f"{(format_ablation if args.ablate else format_table)(res)}\n"
               f"load average {res['load_before']:.2f} before, "
               f"{res['load_after']:.2f} after", res, args.json)
  return res


if __name__ == "__main__":
  main()
