"""Where a train (or inference) step spends its time, op by op, JAX against
torch, on the same model and batch: the table that says where one
framework loses to the other.

Each framework runs in its own child process (``--isa avx2`` caps both at
AVX2, as :mod:`bench.machine` says). JAX: ``jax.profiler`` traces the
compiled step (bench/steps.py: forward, cross-entropy, backward, AdamW);
every XLA thunk's time is read from the trace (``*.xplane.pb``, parsed
with TensorFlow's ``xplane_pb2``) and grouped by what its HLO computes (the
instruction's ops and the source metadata JAX writes into it). torch:
``torch.profiler`` on torchvision's ViT trained with ``torch.optim.AdamW``
(bench/worker.py's step), each aten op's self time grouped the same way.

    .venv/bin/python bench/ops.py --model vit_ti_16 --batch 16 --isa avx2

Groups: dense GEMMs (qkv / out / MLP / head, forward and backward), the
attention's own matmuls (scores and values), softmax, LayerNorm, GELU, the
patch embedding, the optimizer update, layout copies and transposes,
other. Times are milliseconds per step spent inside each group's ops, summed
over the threads that ran them. XLA:CPU runs independent ops of the step at
the same time, and an op's time in the trace then includes the time it
waited for a thread the other op held: the JAX groups add up to more than
the step (about twice on 2 cores), elementwise ops most inflated (an exact
GELU fusion measured 0.5 ms alone and 9 ms in the step's trace). The table
shows where each framework's ops are, not what each group costs.

``--ablate`` measures what each group costs, in wall time: the step of each
framework again with the group replaced by a near-free stand-in in both
(attention: ``v + (q + k) * 1e-30``, keeping the projections and the
head-major layout; LayerNorm: ``x * scale + bias``; GELU: the identity;
and all three at once: what is left is the GEMMs, patch embedding, loss,
optimizer and copies), each variant in its own child process, the
variants alternating over ``--rounds`` rounds; a group's cost is the full
step minus the step without it, paired within a round. The numbers the
stand-ins compute are wrong, of course; only the time is read.

    .venv/bin/python bench/ops.py --model vit_ti_16 --batch 16 --ablate --isa avx2
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import machine  # noqa: E402  pylint: disable=wrong-import-position
from vit_jax.train import host_memory  # noqa: E402  pylint: disable=wrong-import-position

GROUPS = ("dense GEMMs", "attention matmuls", "softmax", "LayerNorm", "GELU",
          "patch embedding", "optimizer", "layout copies", "loss + other")


# --------------------------------------------------------------------------- #
# JAX: HLO instructions -> groups
# --------------------------------------------------------------------------- #

_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ([^=]+?) (\w[\w\-]*)\(")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_META = re.compile(r'op_name="([^"]*)"')
_SRC = re.compile(r'source_file="([^"]*)"')


def parse_hlo(text: str):
  """{instruction: (opcode, [called computations], [op_name], [source])}
  and {computation: [instruction names]} of an HLO module's text."""
  instrs, comps, current = {}, {}, None
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
      if opcode == "dot" and "lhs_batch_dims=" in line:
        opcode = "batched-dot"  # attention's (B*H, N, .) products
      instrs[name] = (opcode, _CALLS.findall(line), _META.findall(line),
                      _SRC.findall(line))
      comps[current].append(name)
  return instrs, comps


def _inner(name, instrs, comps, seen=None):
  """Opcodes, op_names and sources of an instruction and of everything in
  the computations it calls."""
  seen = seen if seen is not None else set()
  opcode, calls, meta, src = instrs.get(name, ("?", [], [], []))
  ops, metas, srcs = {opcode}, list(meta), list(src)
  for c in calls:
    if c in seen:
      continue
    seen.add(c)
    for i in comps.get(c, ()):
      o, m, s = _inner(i, instrs, comps, seen)
      ops |= o
      metas += m
      srcs += s
  return ops, metas, srcs


def group_of(ops, metas, srcs) -> str:
  """The group of an XLA instruction from its ops and the op_names JAX
  wrote into it (``jit(train_step)/jvp(VisionTransformer)/.../query/
  dot_general``); ops outside the model and its gradient (no module path,
  no jvp / transpose) are the optimizer's update."""
  del srcs  # compiled HLO keeps no source files
  text = " ".join(metas).lower()
  in_model = any(k in text for k in ("visiontransformer", "jvp(",
                                     "transpose(", "softmax_cross_entropy"))
  if metas and not in_model:
    return "optimizer"
  if "batched-dot" in ops:  # (B*H, N, .) x (B*H, ., .): scores, values
    return "attention matmuls"
  if ops & {"dot", "convolution"}:  # 2-D (tokens, width) GEMMs
    if "convolution" in ops or "embedding" in text:
      return "patch embedding"
    return "dense GEMMs"
  if "softmax_cross_entropy" in text or "log_softmax" in text:
    return "loss + other"
  if "layernorm" in text or "encoder_norm" in text:
    return "LayerNorm"
  if "attention" in text:
    return "softmax"  # scale, max, exp, sum, divide of the scores
  if "mlpblock" in text or "erf" in ops:
    return "GELU"  # with the bias adds fused into it
  if ops <= {"copy", "transpose", "bitcast", "reshape", "broadcast",
             "parameter", "tuple", "get-tuple-element", "slice",
             "concatenate", "dynamic-update-slice", "pad", "fusion"}:
    return "layout copies"
  return "loss + other"


def _xplane_module():
  spec = importlib.util.find_spec("tensorflow")
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit("bench/ops.py reads JAX's trace with TensorFlow's "
                     "xplane_pb2: install tensorflow-cpu (requirements.txt)")
  path = os.path.join(spec.submodule_search_locations[0],
                      "tsl/profiler/protobuf/xplane_pb2.py")
  s = importlib.util.spec_from_file_location("xplane_pb2", path)
  mod = importlib.util.module_from_spec(s)
  s.loader.exec_module(mod)
  return mod


def thunk_times(trace_dir: str):
  """{HLO instruction name: total picoseconds} over every thunk event of
  the trace's host plane."""
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                           recursive=True))
  if not files:
    raise RuntimeError(f"no *.xplane.pb under {trace_dir}")
  xplane = _xplane_module()
  space = xplane.XSpace()
  with open(files[-1], "rb") as f:
    space.ParseFromString(f.read())
  out = collections.Counter()
  for plane in space.planes:
    if plane.name != "/host:CPU":
      continue
    for line in plane.lines:
      if not line.name.startswith("tf_XLA"):
        continue
      for e in line.events:
        name = plane.event_metadata[e.metadata_id].name
        if name.startswith(("end: ", "Thread", "ThunkExecutor")):
          continue
        out[name] += e.duration_ps
  return out


def jax_child(spec):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from bench import ynnpack_isa  # pylint: disable=import-outside-toplevel
  ynnpack_isa.apply_from_environment()  # --isa avx2

  from bench import steps  # pylint: disable=import-outside-toplevel
  from vit_jax import models  # pylint: disable=import-outside-toplevel

  _jax_stand_ins(spec.get("ablate") or ())
  model = models.get_model(spec["model"], num_classes=1000,
                           **spec.get("overrides", {}))
  variables = models.init_params(model, spec["image_size"])
  # Both frameworks zero the head at init: give it weights (as bench/worker.py
  # does), so that the logits depend on the encoder.
  head = variables["params"]["head"]
  head["kernel"] = 0.02 * jax.random.normal(jax.random.key(0),
                                            head["kernel"].shape)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(
      (spec["batch"], spec["image_size"], spec["image_size"], 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 1000, spec["batch"]), jnp.int32)
  if spec["mode"] == "train":
    tx = steps.adamw()
    state = [variables["params"], tx.init(variables["params"])]
    compiled = steps.make_train_step(model, tx).lower(*state, x, y).compile()

    def step():
      state[0], state[1], loss = compiled(state[0], state[1], x, y)
      return loss
  else:
    compiled = steps.make_infer_step(model).lower(variables, x).compile()

    def step():
      return compiled(variables, x)
  first = _fingerprint(np.asarray(jax.block_until_ready(step())))
  for _ in range(spec["warmup"]):
    jax.block_until_ready(step())
  if spec.get("ablate") is not None:
    return dict(wall_ms=_median_step_ms(lambda: jax.block_until_ready(step()),
                                        spec["steps"]), first=first)
  t0 = time.perf_counter()
  for _ in range(spec["steps"]):
    jax.block_until_ready(step())
  wall = (time.perf_counter() - t0) / spec["steps"]
  with tempfile.TemporaryDirectory(prefix="vit_jax_ops_") as d:
    jax.profiler.start_trace(d)
    for _ in range(spec["steps"]):
      jax.block_until_ready(step())
    jax.profiler.stop_trace()
    times = thunk_times(d)
  instrs, comps = parse_hlo(compiled.as_text())
  groups, ops_detail = collections.Counter(), collections.Counter()
  for name, ps in times.items():
    g = group_of(*_inner(name, instrs, comps)) if name in instrs else (
        "loss + other")
    groups[g] += ps / 1e9 / spec["steps"]  # ms per step
    ops_detail[f"{g}: {name}"] += ps / 1e9 / spec["steps"]
  return dict(wall_ms=wall * 1e3, groups=dict(groups),
              top=ops_detail.most_common(spec["top"]))


# --------------------------------------------------------------------------- #
# torch
# --------------------------------------------------------------------------- #


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
  while p is not None:
    if p.name.startswith("Optimizer.step"):
      return True
    p = p.cpu_parent
  return False


def torch_child(spec):
  import numpy as np  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import torchvision  # pylint: disable=import-outside-toplevel
  from vit_jax import models  # pylint: disable=import-outside-toplevel

  torch.manual_seed(0)
  _torch_stand_ins(spec.get("ablate") or ())
  v = dataclasses.asdict(models.decode_variant(spec["model"]))
  model = torchvision.models.VisionTransformer(
      image_size=spec["image_size"], patch_size=v["patch_size"],
      num_layers=v["num_layers"], num_heads=v["num_heads"],
      hidden_dim=v["hidden_size"], mlp_dim=v["mlp_dim"], num_classes=1000)
  with torch.no_grad():
    model.heads.head.weight.normal_(0.0, 0.02)
  rng = np.random.default_rng(0)
  x = torch.from_numpy(rng.standard_normal(
      (spec["batch"], 3, spec["image_size"], spec["image_size"])).astype(
          np.float32))
  y = torch.from_numpy(rng.integers(0, 1000, spec["batch"]))
  if spec["mode"] == "train":
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)

    def step():
      opt.zero_grad(set_to_none=True)
      loss = torch.nn.functional.cross_entropy(model(x), y)
      loss.backward()
      opt.step()
      return loss.detach()
  else:
    model.eval()

    def step():
      with torch.inference_mode():
        return model(x)
  first = _fingerprint(step().numpy())
  for _ in range(spec["warmup"]):
    step()
  if spec.get("ablate") is not None:
    return dict(wall_ms=_median_step_ms(step, spec["steps"]), first=first)
  t0 = time.perf_counter()
  for _ in range(spec["steps"]):
    step()
  wall = (time.perf_counter() - t0) / spec["steps"]
  with torch.profiler.profile(
      activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(spec["steps"]):
      step()
  groups, detail = collections.Counter(), collections.Counter()
  for ev in prof.events():
    ms = ev.self_cpu_time_total / 1e3 / spec["steps"]
    if ms <= 0:
      continue
    g = torch_group(ev.name, _under_optimizer(ev))
    groups[g] += ms
    detail[f"{g}: {ev.name}"] += ms
  return dict(wall_ms=wall * 1e3, groups=dict(groups),
              top=detail.most_common(spec["top"]), threads=torch.get_num_threads())


# --------------------------------------------------------------------------- #
# --ablate: what a group costs the step, in wall time
# --------------------------------------------------------------------------- #

# The groups a stand-in can replace in both frameworks, and the stand-in.
ABLATIONS = {
    "attention": "v + (q + k) * 1e-30 (projections and head layout kept)",
    "LayerNorm": "x * scale + bias",
    "GELU": "identity",
}
_TINY = 1e-30


def _median_step_ms(step, steps: int) -> float:
  times = []
  for _ in range(max(1, steps)):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
  times.sort()
  return times[len(times) // 2] * 1e3


def _fingerprint(out) -> list:
  """The first step's loss (or first logits): what shows that a stand-in
  replaced something (the same number with and without it would mean it
  replaced nothing)."""
  return [float(v) for v in out.ravel()[:4]]


def _jax_stand_ins(groups):
  """Replaces the kernels of ``groups`` (keys of :data:`ABLATIONS`) in
  vit_jax.models.kernels, before the model is built (float32 paths)."""
  from vit_jax.models import kernels  # pylint: disable=import-outside-toplevel
  if "attention" in groups:
    def attention(qh, kh, vh, scale, bias=None):
      del scale, bias
      q = qh.sum(axis=2, keepdims=True) if qh.shape != kh.shape else qh
      return vh + (q + kh) * _TINY
    kernels.attention = attention
  if "LayerNorm" in groups:
    def layer_norm(x, scale, bias, eps, out_dtype):
      del eps
      y = x if scale is None else x * scale
      return (y if bias is None else y + bias).astype(out_dtype)
    kernels.layer_norm = layer_norm
  if "GELU" in groups:
    kernels.bias_gelu = lambda y, bias: y + bias


def _torch_stand_ins(groups):
  """The same stand-ins in torch.nn.functional, which torchvision's ViT
  calls (nn.LayerNorm, nn.GELU, nn.MultiheadAttention's SDPA)."""
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel
  if "attention" in groups:
    def sdpa(q, k, v, *args, **kwargs):
      del args, kwargs
      q = q.sum(dim=-2, keepdim=True) if q.shape != k.shape else q
      return v + (q + k) * _TINY
    F.scaled_dot_product_attention = sdpa
  if "LayerNorm" in groups:
    def layer_norm(x, shape, weight=None, bias=None, eps=1e-5):
      del shape, eps
      y = x if weight is None else x * weight
      return y if bias is None else y + bias
    F.layer_norm = layer_norm
  if "GELU" in groups:
    F.gelu = lambda x, approximate="none": x


def ablate(spec: dict, rounds: int) -> dict:
  """Wall ms per step of each framework in full and with each group of
  :data:`ABLATIONS` (and all of them) replaced; per round, the variants of
  a framework run one after the other (the order reversed every other
  round). Returns {fw: {variant: [ms per round]}} (variant '' is the full
  step, 'all' all stand-ins at once) and {fw: {variant: the first step's
  loss or logits}}."""
  variants = [""] + list(ABLATIONS) + ["all"]
  walls = {fw: {v: [] for v in variants} for fw in ("jax", "torch")}
  firsts = {fw: {} for fw in ("jax", "torch")}
  for r in range(rounds):
    order = variants if r % 2 == 0 else variants[::-1]
    for fw in ("jax", "torch"):
      for v in order:
        groups = list(ABLATIONS) if v == "all" else [v] if v else []
        out = run_child(fw, dict(spec, ablate=groups))
        walls[fw][v].append(out["wall_ms"])
        firsts[fw][v] = out["first"]
  return walls, firsts


def _med(xs):
  xs = sorted(xs)
  n = len(xs)
  return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def ablation_costs(walls: dict) -> dict:
  """{fw: {group: (median, min, max)}}: a group's cost is the full step
  minus the step without it, paired within each round; 'the rest' is the
  step with every stand-in, 'step' the full step."""
  out = {}
  for fw, w in walls.items():
    full = w[""]
    costs = {g: [a - b for a, b in zip(full, w[g])] for g in ABLATIONS}
    costs["the rest"] = w["all"]
    costs["step"] = full
    out[fw] = {g: (_med(c), min(c), max(c)) for g, c in costs.items()}
  return out


def format_ablation(res: dict) -> str:
  c = res["costs"]
  lines = [
      machine.describe(res["machine"]), res["isa_line"],
      f"{res['model']} {res['mode']} float32 batch {res['batch']} "
      f"{res['image_size']}px: what each group costs the step in wall ms "
      f"(the step minus the step with the group replaced by a stand-in in "
      f"both frameworks; median of {res['rounds']} rounds (min..max), "
      f"{res['steps']} steps per child process)",
      "",
      f"{'group':10} {'stand-in':54} {'JAX ms':>22} {'torch ms':>22} "
      f"{'JAX - torch':>11}",
  ]
  rows = [(g, ABLATIONS[g]) for g in ABLATIONS] + [
      ("the rest", "all three: GEMMs, embedding, loss, optimizer, copies"), ("step", "nothing replaced")]
  for g, what in rows:
    j, t = c["jax"][g], c["torch"][g]
    cell = lambda m: f"{m[0]:.1f} ({m[1]:.1f}..{m[2]:.1f})"
    lines.append(f"{g:10} {what:54} {cell(j):>22} {cell(t):>22} "
                 f"{j[0] - t[0]:+11.1f}")
  lines.append(
      f"load average {res['load_before']:.2f} before, {res['load_after']:.2f}"
      " after (other processes slow every variant alike only if steady)")
  return "\n".join(lines)


# --------------------------------------------------------------------------- #
# the parent
# --------------------------------------------------------------------------- #


def run_child(framework: str, spec: dict) -> dict:
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  # as train.py and bench.py run JAX; torch with glibc's defaults
  if framework == "jax" and host_memory.wanted(env):
    env.update(host_memory.MALLOC_ENV)
  out = subprocess.run(
      [sys.executable, os.path.abspath(__file__), "--child", framework,
       json.dumps(spec)], capture_output=True, text=True, check=False,
      env=env)
  last = [l for l in out.stdout.splitlines() if l.startswith("{")]
  if out.returncode or not last:
    raise RuntimeError(f"{framework} child failed:\n{out.stderr[-3000:]}")
  return json.loads(last[-1])


def format_table(res: dict) -> str:
  j, t = res["jax"], res["torch"]
  lines = [
      machine.describe(res["machine"]), res["isa_line"],
      f"{res['model']} {res['mode']} float32 batch {res['batch']} "
      f"{res['image_size']}px; step wall ms: JAX {j['wall_ms']:.1f}, torch "
      f"{t['wall_ms']:.1f} (torch / JAX {t['wall_ms'] / j['wall_ms']:.2f}x)",
      "",
      f"{'group':20} {'JAX ms':>8} {'torch ms':>9} {'JAX - torch':>12}",
  ]
  for g in GROUPS:
    a, b = j["groups"].get(g, 0.0), t["groups"].get(g, 0.0)
    lines.append(f"{g:20} {a:8.2f} {b:9.2f} {a - b:+12.2f}")
  a, b = sum(j["groups"].values()), sum(t["groups"].values())
  lines.append(f"{'sum of ops':20} {a:8.2f} {b:9.2f} {a - b:+12.2f}")
  if a > 1.2 * j["wall_ms"]:
    lines.append(
        f"JAX's ops overlap: their times add up to {a / j['wall_ms']:.1f}x "
        "the step (XLA runs independent ops at once; an op's time includes "
        "waiting for a thread). Where each framework's ops are, not what "
        "each group costs: --ablate measures that.")
  for fw in ("jax", "torch"):
    lines += ["", f"largest {fw} ops (ms/step):"]
    lines += [f"  {ms:8.2f}  {name}" for name, ms in res[fw]["top"]]
  return "\n".join(lines)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="vit_ti_16")
  p.add_argument("--mode", choices=("train", "infer"), default="train")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--top", type=int, default=12)
  p.add_argument("--json", action="store_true")
  p.add_argument("--ablate", action="store_true",
                 help="what each group costs in wall time: the step with "
                 "the group replaced by a stand-in in both frameworks")
  p.add_argument("--rounds", type=int, default=3,
                 help="--ablate: rounds of every variant")
  machine.add_isa_arg(p)
  args = p.parse_args(argv)
  isa_line = machine.set_isa(args.isa)
  spec = dict(model=args.model, mode=args.mode, batch=args.batch,
              image_size=args.image_size, steps=args.steps,
              warmup=args.warmup, top=args.top)
  res = dict(spec, machine=machine.cpu_info(), isa=args.isa,
             isa_line=isa_line, load_before=os.getloadavg()[0])
  if args.ablate:
    res["rounds"] = args.rounds
    res["walls"], res["first"] = ablate(spec, args.rounds)
    res["costs"] = ablation_costs(res["walls"])
    res["load_after"] = os.getloadavg()[0]
    print(format_ablation(res))
    if args.json:
      print(json.dumps(res))
    return res
  res["jax"] = run_child("jax", spec)
  res["torch"] = run_child("torch", spec)
  res["load_after"] = os.getloadavg()[0]
  print(format_table(res))
  if args.json:
    print(json.dumps(res))
  return res


if __name__ == "__main__":
  if len(sys.argv) > 2 and sys.argv[1] == "--child":
    fn = {"jax": jax_child, "torch": torch_child}[sys.argv[2]]
    print(json.dumps(fn(json.loads(sys.argv[3]))))
  else:
    main()
