"""A/B of XLA compile options and model options inside ONE process.

``ab.py`` runs each configuration in a process of its own, and on a small
VM two processes of the same configuration have differed by 10 % and more
(their heaps grow at different times; bench/README.md). Here one child
process compiles every configuration's step, then runs them in rotating
order, one step at a time (A B C, B C A, C A B, ...), so the machine's slow
spells and the shared heap hit them alike; each step's page faults are
counted, and the medians leave out steps that faulted (>= 1000 pages). The
ratio of a configuration is the median of its per-step time over the
reference's in the same rotation.

Configurations are ``ab.py``'s ``LABEL:KEY=VALUE;...`` with the keys that can
differ inside one process: ``flags=--xla_option=value ...`` (each becomes
a ``jax.jit`` compile option of that configuration's step), ``opt.FIELD=V``
(a model override) and ``donate=false``. Not ``src=`` or ``env.``: those
need a process of their own (use ``ab.py``).

    .venv/bin/python bench/inprocess.py --model vit_ti_16 --mode train \\
        --batch 16 --isa avx2 --config "default:" \\
        --config "memopt:flags=--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import ab, harness, machine  # noqa: E402

FAULTED = 1000  # page faults that make a step "faulted" (fresh memory)


def compile_options(flags: str) -> Dict[str, Any]:
  """``--xla_a=true --xla_b=3 --xla_c=NAME`` -> ``{"xla_a": True,
  "xla_b": 3, "xla_c": "NAME"}``: XLA_FLAGS syntax as ``jax.jit``'s
  ``compiler_options``."""
  out: Dict[str, Any] = {}
  for item in flags.split():
    if not item.startswith("--") or "=" not in item:
      raise ValueError(f"flag {item!r}: expected --xla_name=value")
    k, v = item[2:].split("=", 1)
    low = v.lower()
    if low in ("true", "false"):
      out[k] = low == "true"
    else:
      try:
        out[k] = int(v)
      except ValueError:
        out[k] = v
  return out


def parse_config(text: str) -> Dict[str, Any]:
  """One configuration (``ab.py``'s syntax, in-process keys only)."""
  c = ab.parse_config(text)
  if c.env or "src" in c.options:
    raise ValueError(f"--config {text!r}: src= and env. need a process of "
                     f"their own; compare them with bench/ab.py")
  return {"label": c.label, "compiler_options": compile_options(c.xla_flags),
          "model_overrides": c.options.get("model_overrides", {}),
          "donate": c.options.get("donate", True)}


def summarize(times: Dict[str, List[float]], faults: Dict[str, List[int]],
              reference: str) -> Dict[str, Dict[str, Any]]:
  """Per configuration: median step time over its clean steps, the steps
  that faulted, and the paired ratio (its time / the reference's in the
  same rotation, both clean) with its range."""
  out = {}
  for k in times:
    clean = [t for t, f in zip(times[k], faults[k]) if f < FAULTED]
    pairs = [t / r for t, r, f, g in zip(times[k], times[reference],
                                         faults[k], faults[reference])
             if f < FAULTED and g < FAULTED]
    out[k] = {"median_s": statistics.median(clean) if clean else None,
              "min_s": min(clean) if clean else None,
              "steps": len(times[k]), "faulted": len(times[k]) - len(clean),
              "time_ratio": (statistics.median(pairs) if pairs else None),
              "time_ratio_min": min(pairs) if pairs else None,
              "time_ratio_max": max(pairs) if pairs else None}
  return out


def child(spec: Dict[str, Any]) -> Dict[str, Any]:
  """Compiles every configuration's step in this process and steps them in
  rotation; returns the per-step times and faults."""
  from bench import ynnpack_isa  # pylint: disable=import-outside-toplevel
  ynnpack_isa.apply_from_environment()  # --isa avx2
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from bench import steps, worker  # pylint: disable=import-outside-toplevel
  from vit_jax import models  # pylint: disable=import-outside-toplevel

  images, labels = worker._inputs(spec)  # pylint: disable=protected-access
  x, y = jnp.asarray(images), jnp.asarray(labels.astype(np.int32))
  s = spec["image_size"]
  runs, info = {}, {}
  for cfg in spec["configs"]:
    overrides = dict(cfg["model_overrides"])
    if spec["dtype"] == "bfloat16":
      overrides.setdefault("dtype", "bfloat16")
    for k in ("dtype", "param_dtype"):
      if isinstance(overrides.get(k), str):
        overrides[k] = jnp.dtype(overrides[k])
    model = models.get_model(spec["name"], num_classes=spec["num_classes"],
                             **overrides)
    variables = models.init_params(model, s, spec["seed"])
    opts = cfg["compiler_options"] or None
    if spec["mode"] == "infer":
      fn = steps.make_infer_step(model, compiler_options=opts)
      compiled = fn.lower(variables, x).compile()
      run = (lambda c=compiled, v=variables: c(v, x).block_until_ready())
      first = lambda r: float(jnp.asarray(r, jnp.float32).sum())
    else:
      tx = steps.adamw(spec["lr"], spec["weight_decay"])
      state = [variables["params"], tx.init(variables["params"])]
      fn = steps.make_train_step(model, tx, donate=cfg["donate"],
                                 compiler_options=opts)
      compiled = fn.lower(*state, x, y).compile()

      def run(c=compiled, st=state):
        st[0], st[1], loss = c(st[0], st[1], x, y)
        jax.block_until_ready(st)
        return loss.block_until_ready()

      first = float
    release = worker.ReleaseWait(steps.peak_bytes(compiled)["temp"])
    runs[cfg["label"]] = (run, release)
    info[cfg["label"]] = {"check": first(run()),
                          "memory": steps.peak_bytes(compiled)}
  for run, release in runs.values():  # warm-up
    for _ in range(spec["warmup"]):
      run()
    release.settle()
  labels = list(runs)
  times = {k: [] for k in labels}
  faults = {k: [] for k in labels}
  for i in range(spec["steps"]):
    for k in labels[i % len(labels):] + labels[:i % len(labels)]:
      run, release = runs[k]
      f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      t0 = time.perf_counter()
      run()
      release()
      times[k].append(time.perf_counter() - t0)
      faults[k].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
  return {"times": times, "faults": faults, "info": info}


def format_table(res: Dict[str, Any], spec: Dict[str, Any],
                 isa_line: str) -> str:
  ref = spec["configs"][0]["label"]
  summ = res["summary"]
  lines = [machine.describe(res["machine"]), isa_line,
           f"{spec['name']} {spec['mode']} {spec['dtype']} batch "
           f"{spec['batch']} {spec['image_size']}px, one process, "
           f"{spec['steps']} steps each in rotation; medians over steps "
           f"that faulted < {FAULTED} pages",
           f"{'config':14s} {'ms/step':>9s} {'min':>8s} {'img/s':>8s} "
           f"{'time / ' + ref:>26s} {'faulted':>8s} {'temp MiB':>9s} "
           f"{'check':>12s}"]
  for lab, c in summ.items():
    med = c["median_s"]
    ratio = ("-" if c["time_ratio"] is None else
             f"{c['time_ratio']:.3f} [{c['time_ratio_min']:.2f}-"
             f"{c['time_ratio_max']:.2f}]")
    inf = res["info"][lab]
    lines.append(
        f"{lab:14s} {1e3 * med if med else float('nan'):9.1f} "
        f"{1e3 * c['min_s'] if c['min_s'] else float('nan'):8.1f} "
        f"{spec['batch'] / med if med else float('nan'):8.2f} "
        f"{ratio:>26s} {c['faulted']:>4d}/{c['steps']:<3d} "
        f"{inf['memory']['temp'] / 2 ** 20:9.0f} {inf['check']:12.6g}")
  lines.append("time / ref: the median over rotations of a config's step "
               "time over the reference's (below 1: faster)")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="vit_ti_16")
  p.add_argument("--mode", choices=("infer", "train"), default="train")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--steps", type=int, default=30,
                 help="timed steps of each configuration")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--config", action="append", default=[],
                 help="LABEL:KEY=VALUE;... (the first is the reference)")
  p.add_argument("--child", help=argparse.SUPPRESS)
  machine.add_isa_arg(p)
  p.add_argument("--json", action="store_true")
  args = p.parse_args(argv)
  if args.child:
    # The result on stdout; framework logs and warnings to stderr.
    from vit_jax.data import console  # pylint: disable=import-outside-toplevel
    console.quiet_native_logs()
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    res = child(json.loads(args.child))
    real_stdout.write(json.dumps(res) + "\n")
    real_stdout.flush()
    return None
  if not args.config:
    p.error("give at least one --config (the first is the reference)")
  isa_line = machine.set_isa(args.isa)
  w = harness.Workload(name=args.model, mode=args.mode, dtype=args.dtype,
                       batch=args.batch, image_size=args.image_size)
  spec = dict(w.spec(), steps=args.steps, warmup=args.warmup,
              configs=[parse_config(c) for c in args.config])
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  # What train.py runs with (vit_jax/train/host_memory.py).
  from vit_jax.train import host_memory  # pylint: disable=import-outside-toplevel
  if host_memory.wanted(env):
    env.update(host_memory.MALLOC_ENV)
  env["PYTHONPATH"] = os.pathsep.join(
      q for q in (harness.REPO, env.get("PYTHONPATH", "")) if q)
  harness.log(f"[inprocess] compiling {len(spec['configs'])} configurations "
              f"in one child, then {args.steps} steps each ...")
  out = subprocess.run(
      [sys.executable, "-m", "bench.inprocess", "--child", json.dumps(spec)],
      stdout=subprocess.PIPE, text=True, env=env, cwd=harness.REPO,
      check=True).stdout
  res = json.loads(out)
  res["summary"] = summarize(res["times"], res["faults"],
                             spec["configs"][0]["label"])
  res["machine"], res["isa"], res["isa_line"] = (machine.cpu_info(), args.isa,
                                                 isa_line)
  print(format_table(res, spec, isa_line))
  if args.json:
    print(json.dumps({k: v for k, v in res.items() if k != "times"}))
  return res


if __name__ == "__main__":
  main()
