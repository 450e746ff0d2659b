"""Runs benchmark contestants side by side, alternating round by round.

Each contestant (JAX with some options, torch, an exported artifact in its
runtime) lives in its own child process (:mod:`bench.worker`): torch's and
XLA's thread pools in one process slow each other down. Every round runs
each for about ``--round-seconds``, the order reversed every round (A B,
B A, ...); a ratio is the median of per-round *paired* ratios. Also: the
machine's load (``/proc/stat``) and :func:`call` (a one-shot child).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from vit_jax.train import host_memory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Contestants that run JAX (and so run as train.py does).
JAX_RUNTIMES = ("jax", "stablehlo")


@dataclasses.dataclass
class Contestant:
  """One side of the comparison: a framework plus its options."""
  label: str
  framework: str                      # 'jax', 'torch' or an export runtime
  options: Dict[str, Any] = dataclasses.field(default_factory=dict)
  xla_flags: str = ""                 # JAX only: appended to XLA_FLAGS
  env: Dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Workload:
  name: str = "vit_b_16"
  mode: str = "infer"                 # 'infer' or 'train'
  dtype: str = "float32"              # 'float32' or 'bfloat16'
  batch: int = 8
  image_size: int = 224
  num_classes: int = 1000
  seed: int = 0
  lr: float = 1e-3
  weight_decay: float = 0.05
  warmup: int = 2                     # untimed steps after the first one
  # ``name`` is a timm model name (DINOv3, EVA-02, ...): torch runs timm's
  # model, JAX loads its weights with formats.from_timm.
  timm: bool = False
  layers: int = 0                     # blocks; 0: the model's own

  def variant(self):
    from vit_jax import models  # pylint: disable=import-outside-toplevel
    v = models.decode_variant(self.name)
    return dataclasses.replace(v, num_layers=self.layers or v.num_layers)

  def spec(self) -> Dict[str, Any]:
    d = dataclasses.asdict(self)
    if not self.timm:
      d["variant"] = dataclasses.asdict(self.variant())
    return d


def log(msg: str):
  print(msg, file=sys.stderr, flush=True)


def emit(text: str, record, as_json: bool):
  """A tool's table, and with ``as_json`` its JSON ``record`` on stdout
  (the table then on stderr)."""
  print(text, file=sys.stderr if as_json else sys.stdout)
  if as_json:
    print(json.dumps(record))


# The machine's load.
def busy_cpu_seconds(steal: bool = False) -> float:
  """CPU-seconds the whole machine spent busy so far (/proc/stat), or
  (``steal``) that the hypervisor gave to other guests; nan without it."""
  try:
    with open("/proc/stat") as f:
      v = [int(x) / os.sysconf("SC_CLK_TCK") for x in f.readline().split()[1:]]
  except OSError:
    return float("nan")
  return (v[7] if len(v) > 7 else 0.0) if steal else sum(v[:8]) - v[3] - v[4]


def wait_for_quiet(max_wait_s: float, quiet_load: float,
                   window_s: float = 0.5) -> float:
  """Waits (at most ``max_wait_s``) until other processes use at most
  ``quiet_load`` cores over a ``window_s`` window; returns the load seen."""
  deadline = time.monotonic() + max_wait_s
  while True:
    b0 = busy_cpu_seconds()
    time.sleep(window_s)
    load = (busy_cpu_seconds() - b0) / window_s
    if load <= quiet_load or time.monotonic() >= deadline:
      return load


# Child processes.
def child_env(framework: str, env: Optional[Dict[str, str]] = None,
              xla_flags: str = "") -> Dict[str, str]:
  """A child's environment, each side as its users run it: JAX with
  train.py's malloc settings (vit_jax/train/host_memory.py), every other
  runtime with glibc's defaults (torch under the JAX settings ran its
  ViT-Ti/16 bfloat16 train step at 0.66x its own speed, Zen 5)."""
  out = dict(os.environ, **(env or {}))
  if framework in JAX_RUNTIMES:
    if host_memory.wanted(out):
      out.update(host_memory.MALLOC_ENV)
    flags = " ".join(f for f in (out.get("XLA_FLAGS", ""), xla_flags) if f)
    if flags:
      out["XLA_FLAGS"] = flags
    out.setdefault("JAX_PLATFORMS", "cpu")
  out["PYTHONPATH"] = os.pathsep.join(
      p for p in (REPO, out.get("PYTHONPATH", "")) if p)
  return out


def call(kind: str, spec: Dict[str, Any], framework: str = "jax",
         env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
  """``bench.worker``'s one-shot ``kind`` on ``spec`` in a child (its
  stderr passes through): its JSON result."""
  w = Worker(Contestant(kind, framework, env=env or {}), spec, kind)
  try:
    return w.recv()
  finally:
    w.proc.stdin.close()
    w.proc.wait()


class Worker:
  """A child running :mod:`bench.worker` for one contestant (``kind``:
  its framework) or a one-shot ``kind``."""

  def __init__(self, contestant: Contestant, spec: Dict[str, Any],
               kind: Optional[str] = None):
    self.c = contestant
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "bench.worker", kind or contestant.framework,
         json.dumps(dict(spec, **contestant.options))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
        env=child_env(contestant.framework, contestant.env,
                      contestant.xla_flags))
    self.ready: Optional[Dict[str, Any]] = None

  def recv(self) -> Dict[str, Any]:
    line = "-"
    while line and not line.startswith("{"):  # the child's JSON lines only
      line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"bench.worker {self.c.label} ({self.c.framework}) "
                         f"exited with code {self.proc.wait()} (its stderr "
                         "is above)")
    return json.loads(line)

  def send(self, **msg):
    self.proc.stdin.write(json.dumps(msg) + "\n")
    self.proc.stdin.flush()

  def run(self, iters: int) -> Dict[str, Any]:
    self.send(cmd="run", iters=iters)
    return self.recv()

  def close(self):
    if self.proc.poll() is None:
      try:
        self.send(cmd="quit")
        self.proc.wait(timeout=30)
      except (BrokenPipeError, subprocess.TimeoutExpired):
        self.proc.kill()


def _timed_turn(w: Worker, iters: int) -> Dict[str, Any]:
  """One turn, with the cores other processes and the hypervisor's steal
  took meanwhile."""
  b0, s0 = busy_cpu_seconds(), busy_cpu_seconds(steal=True)
  t0 = time.perf_counter()
  res = w.run(iters)
  wall = time.perf_counter() - t0
  steal = busy_cpu_seconds(steal=True) - s0
  res["other_load"] = max(
      0.0, (busy_cpu_seconds() - b0 - steal - res["cpu_s"]) / wall)
  res["steal"] = steal / wall
  return res


def summary(xs: List[float]) -> Dict[str, float]:
  xs = sorted(xs)
  med = statistics.median(xs)
  return {"median": med, "min": xs[0], "max": xs[-1],
          "spread_pct": 100.0 * (xs[-1] - xs[0]) / med if med else 0.0}


def _round_row(res: Dict[str, Any], batch: int, tries: int) -> Dict[str, Any]:
  n = len(res["step_s"])
  return {
      "img_per_sec": batch * n / res["wall_s"],
      "step_s_median": statistics.median(res["step_s"]),
      "cpu_use": res["cpu_s"] / res["wall_s"],
      "cpu_ms_per_img": 1000 * res["cpu_s"] / (batch * n),
      "other_load": res["other_load"], "tries": tries, "iters": n,
      # Why a turn was slow, when it was: the hypervisor's steal (cores),
      # page faults per step (a trimmed heap touched again, or temporaries
      # placed in new memory), involuntary context switches per second.
      "steal": res.get("steal", 0.0),
      "faults_per_step": res.get("minflt", 0) / n,
      "nivcsw_per_s": res.get("nivcsw", 0) / res["wall_s"],
      "trimmed_before": res.get("trimmed_before", False),
      # JAX: waiting for XLA to free a step's temporaries (worker.ReleaseWait)
      "release_wait_ms": 1000 * res.get("release_wait_s", 0.0) / n,
      "release_timeouts": res.get("release_timeouts", 0)}


def _round_log(label: str, v: Dict[str, Any]) -> str:
  return (f"{label} {v['img_per_sec']:.2f} img/s (cpu {v['cpu_use']:.2f}, "
          f"others {v['other_load']:.2f}, steal {v['steal']:.2f}, "
          f"faults/step {v['faults_per_step']:.0f}, "
          f"preempt/s {v['nivcsw_per_s']:.0f}"
          + (f", release wait {v['release_wait_ms']:.1f} ms/step"
             if v["release_wait_ms"] else "")
          + (f", {v['release_timeouts']} release waits timed out"
             if v["release_timeouts"] else "")
          + (", after a heap trim" if v["trimmed_before"] else "") + ")")


def run(workload: Workload, contestants: List[Contestant], args,
        reference: Optional[str] = None, pause_s: float = 0.3
        ) -> Dict[str, Any]:
  """Sets up every contestant (one at a time), then runs ``args.rounds``
  alternating rounds of about ``args.round_seconds`` per turn (bench.py's
  ``add_run_args``); ``reference`` (default: the last) is the ratios'
  denominator and the logits' reference. A turn during which other
  processes used more than ``--quiet-load`` cores is repeated (at most
  ``--max-retries`` times; the quietest kept), after waiting up to
  ``--wait-quiet`` seconds for quiet."""
  rounds, quiet_load = args.rounds, args.quiet_load
  reference = reference or contestants[-1].label
  spec = workload.spec()
  tmp = tempfile.mkdtemp(prefix="vit_bench_")
  spec["weights_in"] = weights = os.path.join(tmp, "weights.npz")
  workers: List[Worker] = []
  try:
    # torch makes the weights (torchvision's or timm's init); JAX converts.
    order = sorted(contestants, key=lambda c: c.framework != "torch")
    if order[0].framework != "torch" and workload.timm:  # a torch child
      call("weights", dict(spec, weights_out=weights), "torch")
    elif order[0].framework != "torch":
      _make_weights_without_torch(workload, weights)
    for c in order:
      w = Worker(c, dict(spec, weights_out=weights) if c is order[0] and
                 c.framework == "torch" else spec)
      r = w.ready = w.recv()
      log(f"[setup] {c.label}: ready (setup {r['setup_s']:.1f}s" + (
          f", compile {r['compile_s']:.1f}s)" if r.get("compile_s") is not
          None else ")"))
      workers.append(w)
    workers.sort(key=lambda w: contestants.index(w.c))
    # One step of each gives its steps per round.
    iters = {w.c.label: max(1, round(args.round_seconds / max(
        w.run(1)["wall_s"], 1e-6))) for w in workers}
    log("[calibrate] steps per round: " +
        ", ".join(f"{k} {v}" for k, v in iters.items()))
    per_round: List[Dict[str, Any]] = []
    for r in range(rounds):
      row = {}
      for w in (workers if r % 2 == 0 else workers[::-1]):
        tries = []
        for _ in range(1 + args.max_retries):
          time.sleep(pause_s)  # let the other pool's spinning threads park
          if args.wait_quiet > 0:
            wait_for_quiet(args.wait_quiet, quiet_load)
          tries.append(_timed_turn(w, iters[w.c.label]))
          if tries[-1]["other_load"] + tries[-1]["steal"] <= quiet_load:
            break
        res = min(tries, key=lambda t: t["other_load"] + t["steal"])
        row[w.c.label] = _round_row(res, workload.batch, len(tries))
      per_round.append(row)
      log(f"[round {r + 1}/{rounds}] " + "  ".join(
          _round_log(k, v) for k, v in row.items()))
  finally:
    for w in workers:
      w.close()
    shutil.rmtree(tmp, ignore_errors=True)  # the weights (350 MB for B/16)

  out: Dict[str, Any] = {
      "workload": dataclasses.asdict(workload), "rounds": per_round,
      "reference": reference, "cpu_count": os.cpu_count(),
      "load_avg_1m": os.getloadavg()[0], "contestants": {}}
  ref_check = next(w.ready["check"] for w in workers
                   if w.c.label == reference)
  for w in workers:
    lab = w.c.label
    col = lambda f, lab=lab: summary([f(row[lab], row[reference])
                                      for row in per_round])
    entry = {"framework": w.c.framework, "options": w.c.options,
             "xla_flags": w.c.xla_flags,
             **{k: col(lambda a, r, k=k: a[k]) for k in (
                 "img_per_sec", "cpu_use", "other_load", "cpu_ms_per_img")},
             **{k: w.ready.get(k) for k in ("compile_s", "setup_s", "info")},
             "ratio_vs_reference": col(
                 lambda a, r: a["img_per_sec"] / r["img_per_sec"]),
             # CPU time per image, reference / this: a load-robust view of
             # the same ratio (starved rounds stretch wall time, not CPU
             # time; spin-waiting pools add CPU time: only a cross-check).
             "cpu_ratio_vs_reference": col(
                 lambda a, r: r["cpu_ms_per_img"] / a["cpu_ms_per_img"])}
    if lab != reference:
      a = w.ready["check"]
      entry["check_max_abs_diff"] = max(
          (abs(x - y) for x, y in zip(a, ref_check)), default=None)
      entry["check_max_abs_ref"] = max((abs(y) for y in ref_check),
                                       default=None)
    out["contestants"][lab] = entry
  return out


def _make_weights_without_torch(workload: Workload, path: str):
  """Without a torch contestant: random, perturbed weights in torchvision's
  layout."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from bench import steps  # pylint: disable=import-outside-toplevel
  from vit_jax import convert, models  # pylint: disable=import-outside-toplevel
  model = models.get_model(workload.name, num_classes=workload.num_classes,
                           num_layers=workload.variant().num_layers)
  np.savez(path, **convert.params_to_torchvision(steps.perturbed(
      models.init_params(model, workload.image_size, workload.seed),
      workload.seed)))
