"""Runs benchmark contestants side by side, alternating round by round.

Each contestant (JAX with some options, torch eager, torch.compile...) lives
in its own long-lived child process (:mod:`bench.worker`). After setup and
warm-up, every round runs each contestant for about ``round_s`` seconds, one
after the other, the order reversed every round (A B, B A, A B ...), so slow
drifts of the machine's load hit all contestants alike. Results are per-round
throughputs, their median and spread, and per-round *paired* ratios against
the reference contestant (the ratio of two measurements taken seconds apart),
whose median is the headline ratio.

Also recorded per round: the CPU time the child used divided by wall time
(``cpu_use``, in cores). Well below the number of cores means the contestant
was starved by other processes on the machine, and that round is noisy.
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

from bench import machine
from vit_jax.train import host_memory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Contestant:
  """One side of the comparison: a framework plus its options."""

  label: str
  framework: str                      # 'jax' or 'torch'
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
  check_size: int = 4000              # logits compared between contestants
  # ``name`` is a timm model name (DINOv3, EVA-02, ...): torch runs timm's
  # model, JAX loads its weights with formats.from_timm (bench/families.py).
  timm: bool = False

  def spec(self) -> Dict[str, Any]:
    from vit_jax import models  # pylint: disable=import-outside-toplevel
    d = dataclasses.asdict(self)
    if not self.timm:
      d["variant"] = dataclasses.asdict(models.decode_variant(self.name))
    return d


def emit(table: str, rec: Dict[str, Any], as_json: bool) -> Dict[str, Any]:
  """Prints a benchmark's result: the table, or (``--json``) the record on
  stdout and the table on stderr. Returns the record."""
  if as_json:
    print(table, file=sys.stderr)
    print(json.dumps(rec))
  else:
    print(table)
  return rec


def log(msg: str):
  print(msg, file=sys.stderr, flush=True)


# Contestants that run JAX (and so run as train.py does).
JAX_RUNTIMES = ("jax", "stablehlo")


class Worker:
  """A child process running :mod:`bench.worker` for one contestant."""

  def __init__(self, contestant: Contestant, spec: Dict[str, Any],
               cpus: Optional[List[int]] = None):
    self.c = contestant
    env = dict(os.environ)
    env.update(contestant.env)
    # Each side as its users run it. JAX: what train.py runs with
    # (vit_jax/train/host_memory.py; env.VIT_JAX_KEEP_HOST_MEMORY=0 in an
    # ab.py config runs it without). Every other runtime: glibc's defaults;
    # torch under the JAX side's settings (one arena for all threads) ran a
    # ViT-Ti/16 bfloat16 train step at 0.66x its own speed (Zen 5). The
    # StableHLO contestant of export.py is JAX too (jax.export).
    if contestant.framework in JAX_RUNTIMES and host_memory.wanted(env):
      env.update(host_memory.MALLOC_ENV)
    if contestant.framework == "jax":
      flags = " ".join(f for f in (env.get("XLA_FLAGS", ""),
                                   contestant.xla_flags) if f)
      if flags:
        env["XLA_FLAGS"] = flags
      env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    full = dict(spec, **contestant.options)
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "bench.worker", contestant.framework,
         json.dumps(full)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        cwd=REPO,
        # Both frameworks size their thread pools from the affinity mask.
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    self.ready: Optional[Dict[str, Any]] = None

  def _recv(self) -> Dict[str, Any]:
    line = self.proc.stdout.readline()
    if not line:
      code = self.proc.wait()
      raise RuntimeError(f"{self.c.label}: worker exited with code {code} "
                         f"(its stderr is above)")
    return json.loads(line)

  def wait_ready(self) -> Dict[str, Any]:
    self.ready = self._recv()
    return self.ready

  def run(self, iters: int) -> Dict[str, Any]:
    self.proc.stdin.write(json.dumps({"cmd": "run", "iters": iters}) + "\n")
    self.proc.stdin.flush()
    return self._recv()

  def close(self):
    if self.proc.poll() is None:
      try:
        self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=30)
      except (BrokenPipeError, subprocess.TimeoutExpired):
        self.proc.kill()


def _proc_stat_cpu() -> List[float]:
  """The machine's CPU-seconds so far, per /proc/stat column (user nice
  system idle iowait irq softirq steal ...); [] where there is none."""
  try:
    with open("/proc/stat") as f:
      return [int(v) / os.sysconf("SC_CLK_TCK")
              for v in f.readline().split()[1:]]
  except OSError:
    return []


def busy_cpu_seconds() -> float:
  """CPU-seconds spent busy by the whole machine so far (from /proc/stat)."""
  vals = _proc_stat_cpu()
  if len(vals) < 5:
    return float("nan")
  return sum(vals[:8]) - vals[3] - vals[4]


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


def steal_seconds() -> float:
  """CPU-seconds the hypervisor gave to other guests so far (/proc/stat's
  steal column): time this machine's cores did not run at all."""
  vals = _proc_stat_cpu()
  if not vals:
    return float("nan")
  return vals[7] if len(vals) > 7 else 0.0


def _timed_turn(w: Worker, iters: int) -> Dict[str, Any]:
  """One contestant's turn, with the CPU time other processes took meanwhile
  (``other_load``, in cores: machine busy time - this child's, per second)
  and the time the hypervisor stole (``steal``, in cores)."""
  b0, s0 = busy_cpu_seconds(), steal_seconds()
  t0 = time.perf_counter()
  res = w.run(iters)
  wall = time.perf_counter() - t0
  steal = steal_seconds() - s0
  res["other_load"] = max(
      0.0, (busy_cpu_seconds() - b0 - steal - res["cpu_s"]) / wall)
  res["steal"] = steal / wall
  return res


def _summary(xs: List[float]) -> Dict[str, float]:
  xs = sorted(xs)
  med = statistics.median(xs)
  return {"median": med, "min": xs[0], "max": xs[-1],
          "spread_pct": 100.0 * (xs[-1] - xs[0]) / med if med else 0.0}


def run(workload: Workload, contestants: List[Contestant], *, rounds: int = 5,
        round_s: float = 4.0, pause_s: float = 0.3,
        reference: Optional[str] = None, quiet_load: float = 0.3,
        max_retries: int = 2, wait_quiet_s: float = 0.0,
        cpus: Optional[List[int]] = None) -> Dict[str, Any]:
  """Sets up every contestant (one at a time, so compiles don't overlap),
  then runs ``rounds`` alternating rounds. Returns a dict of results;
  ``reference`` (default: the last contestant) is the ratios' denominator.

  A turn during which other processes used more than ``quiet_load`` cores
  is repeated (at most ``max_retries`` times; the quietest try is kept), so a
  neighbour's burst does not decide a round. With ``wait_quiet_s`` > 0, each
  turn first waits up to that long for the machine to be that quiet.
  ``cpus`` pins every child to those CPUs (e.g. ``[0]`` for a one-core
  comparison; torch and XLA then size their pools to match). Every round records the other
  load it saw, and the table shows it."""
  reference = reference or contestants[-1].label
  spec = workload.spec()
  tmp = tempfile.mkdtemp(prefix="vit_bench_")
  weights = os.path.join(tmp, "weights.npz")
  spec["weights_in"] = weights
  workers: List[Worker] = []
  try:
    # torch makes the weights (torchvision's init, seed 0); JAX converts them.
    order = sorted(contestants, key=lambda c: c.framework != "torch")
    if order[0].framework == "torch":
      first_spec = dict(spec, weights_out=weights)
    else:
      first_spec = spec
      _make_weights_without_torch(workload, weights)
    for i, c in enumerate(order):
      log(f"[setup] {c.label}: building and compiling ...")
      w = Worker(c, first_spec if i == 0 else spec, cpus)
      r = w.wait_ready()
      comp = (f", compile {r['compile_s']:.1f}s"
              if r.get("compile_s") is not None else "")
      log(f"[setup] {c.label}: ready (setup {r['setup_s']:.1f}s{comp})")
      workers.append(w)
    workers.sort(key=lambda w: [c.label for c in contestants].index(w.c.label))

    # Calibrate: one step each gives the iterations per round.
    iters = {}
    for w in workers:
      t = w.run(1)["wall_s"]
      iters[w.c.label] = max(1, int(round(round_s / max(t, 1e-6))))
    log("[calibrate] steps per round: " +
        ", ".join(f"{k} {v}" for k, v in iters.items()))

    per_round: List[Dict[str, Any]] = []
    for r in range(rounds):
      seq = workers if r % 2 == 0 else workers[::-1]
      row = {}
      for w in seq:
        tries = []
        for _ in range(1 + max_retries):
          time.sleep(pause_s)  # let the other pool's spinning threads park
          if wait_quiet_s > 0:
            wait_for_quiet(wait_quiet_s, quiet_load)
          tries.append(_timed_turn(w, iters[w.c.label]))
          if tries[-1]["other_load"] + tries[-1]["steal"] <= quiet_load:
            break
        res = min(tries, key=lambda t: t["other_load"] + t["steal"])
        n = len(res["step_s"])
        row[w.c.label] = {
            "img_per_sec": workload.batch * n / res["wall_s"],
            "step_s_median": statistics.median(res["step_s"]),
            "cpu_use": res["cpu_s"] / res["wall_s"],
            "cpu_ms_per_img": 1000 * res["cpu_s"] / (workload.batch * n),
            "other_load": res["other_load"], "tries": len(tries),
            "iters": n,
            # Why a turn was slow, when it was: the hypervisor's steal (in
            # cores), page faults per step (a trimmed heap touched again, or
            # a step's temporaries placed in new memory: docs/performance.md),
            # involuntary context switches per second.
            "steal": res.get("steal", 0.0),
            "faults_per_step": res.get("minflt", 0) / n,
            "nivcsw_per_s": res.get("nivcsw", 0) / res["wall_s"],
            "trimmed_before": res.get("trimmed_before", False),
            # JAX: time spent waiting for XLA to free a step's temporaries
            # before the next step (worker.ReleaseWait), ms per step.
            "release_wait_ms": 1000 * res.get("release_wait_s", 0.0) / n,
            "release_timeouts": res.get("release_timeouts", 0)}
      per_round.append(row)
      log(f"[round {r + 1}/{rounds}] " + "  ".join(
          f"{k} {v['img_per_sec']:.2f} img/s (cpu {v['cpu_use']:.2f}, "
          f"others {v['other_load']:.2f}, steal {v['steal']:.2f}, "
          f"faults/step {v['faults_per_step']:.0f}, "
          f"preempt/s {v['nivcsw_per_s']:.0f}"
          + (f", release wait {v['release_wait_ms']:.1f} ms/step"
             if v["release_wait_ms"] else "")
          + (f", {v['release_timeouts']} release waits timed out"
             if v["release_timeouts"] else "")
          + (", after a heap trim" if v["trimmed_before"] else "") + ")"
          for k, v in row.items()))
  finally:
    for w in workers:
      w.close()
    shutil.rmtree(tmp, ignore_errors=True)  # the weights (350 MB for B/16)

  out: Dict[str, Any] = {"workload": dataclasses.asdict(workload),
                         "machine": machine.cpu_info(),
                         "rounds": per_round, "reference": reference,
                         "cpu_count": len(cpus) if cpus else os.cpu_count(),
                         "cpus": cpus,
                         "load_avg_1m": os.getloadavg()[0],
                         "contestants": {}}
  ref_check = None
  for w in workers:
    if w.c.label == reference:
      ref_check = w.ready["check"]
  for w in workers:
    lab = w.c.label
    ips = [row[lab]["img_per_sec"] for row in per_round]
    entry = {"framework": w.c.framework, "options": w.c.options,
             "xla_flags": w.c.xla_flags,
             "img_per_sec": _summary(ips),
             "cpu_use": _summary([row[lab]["cpu_use"] for row in per_round]),
             "other_load": _summary([row[lab]["other_load"]
                                     for row in per_round]),
             "cpu_ms_per_img": _summary([row[lab]["cpu_ms_per_img"]
                                         for row in per_round]),
             "compile_s": w.ready.get("compile_s"),
             "setup_s": w.ready.get("setup_s"),
             "info": w.ready.get("info", {})}
    ratios = [row[lab]["img_per_sec"] / row[reference]["img_per_sec"]
              for row in per_round]
    entry["ratio_vs_reference"] = _summary(ratios)
    # CPU time per image, reference / this: a second, load-robust view of
    # the same ratio (starved rounds stretch wall time, not CPU time; but
    # spin-waiting thread pools add CPU time, so it is only a cross-check).
    entry["cpu_ratio_vs_reference"] = _summary(
        [row[reference]["cpu_ms_per_img"] / row[lab]["cpu_ms_per_img"]
         for row in per_round])
    if ref_check is not None and lab != reference:
      a, b = w.ready["check"], ref_check
      entry["check_max_abs_diff"] = max(
          (abs(x - y) for x, y in zip(a, b)), default=None)
      entry["check_max_abs_ref"] = max((abs(y) for y in b), default=None)
    out["contestants"][lab] = entry
  return out


def _make_weights_without_torch(workload: Workload, path: str):
  """Without a torch contestant: random weights in torchvision's layout."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from vit_jax import convert, models  # pylint: disable=import-outside-toplevel
  model = models.get_model(workload.name, num_classes=workload.num_classes)
  variables = models.init_params(model, workload.image_size, workload.seed)
  leaves, treedef = jax.tree_util.tree_flatten(variables)
  rs = np.random.RandomState(workload.seed)
  leaves = [np.asarray(x) + 0.02 * rs.standard_normal(np.shape(x)).astype(
      np.float32) for x in leaves]
  sd = convert.params_to_torchvision(jax.tree_util.tree_unflatten(treedef,
                                                                  leaves))
  np.savez(path, **sd)
