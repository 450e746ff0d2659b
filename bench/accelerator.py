r"""One command that measures an accelerator for training ViTs.

    .venv/bin/python bench/accelerator.py                    # the full run
    .venv/bin/python bench/accelerator.py --batch 256 --attention cudnn xla \
        --scan on off --json bench/results/accelerator_h100.json

On the default backend (a CPU: tiny sizes, and it says so; see
docs/accelerators.md): 1. ``train.py``'s jitted train step (uint8 batch
normalised on the device) per ``--batch`` (per device) x ``--attention`` x
``--scan``: img/s per device and MFU (analytic FLOPs, ``machine.py``, over
:data:`PEAK_BF16`); 2. the input pipeline alone (``input_pipeline.py``;
where TensorFlow is); 3. ``train.py`` end to end against the step alone
(``--e2e-data``); 4. float32 logits against the host CPU's at the highest
matmul precision; 5. ours and timm's against timm's in float64 (random,
perturbed weights); 6. timm's train step in torch (where it has CUDA),
eager and ``--torch-compile``. Every number names the device and the host
CPU; a part not run says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vit_jax.data import console  # noqa: E402
from vit_jax.train import xla_flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Peak dense bfloat16 FLOP/s per device (no sparsity), from the vendors' data
# sheets. Matched against ``device.device_kind`` in order (first hit wins).
PEAK_BF16 = (("H200", 989e12), ("H100 PCIe", 756e12),  # H200 SXM
             ("H100", 989e12), ("A100", 312e12),  # H100 SXM5 (HBM3)
             ("TPU v4", 275e12), ("TPU v5 lite", 197e12),  # v5e
             ("TPU v5e", 197e12), ("TPU v5p", 459e12), ("TPU v5", 459e12),
             ("TPU v6", 918e12))  # v6e (Trillium)
# Targets of issue 13 on one H100/H200.
TARGET_IMG_S = 2900.0
TARGET_LOGITS_REL = 1e-4
TARGET_E2E_RATIO = 0.9
# The defaults on an accelerator, and on a CPU (seconds, not hours).
DEFAULTS = dict(model=("vit_b_16", "vit_ti_16"), image_size=(224, 32),
                batch=([256, 512], [4, 8]), steps=(20, 3), e2e_steps=(60, 6),
                attention=(["cudnn", "xla"], ["matmul", "xla"]),
                jpeg_size=([375, 500], [48, 64]), images=(2048, 64),
                timm_depth=(0, 2))
# timm's name of each model parts 5 and 6 compare with.
TIMM_NAMES = {"vit_ti_16": "vit_tiny_patch16_224",
              "vit_s_16": "vit_small_patch16_224",
              "vit_b_16": "vit_base_patch16_224",
              "vit_l_16": "vit_large_patch16_224"}


def peak_flops(device_kind: str):
  """The device's peak bfloat16 FLOP/s, or None (unknown, e.g. a CPU)."""
  return next((peak for key, peak in PEAK_BF16
               if key.lower() in device_kind.lower()), None)


def workload(args, attention, scan) -> dict:
  """The measured workload as overrides of the from-scratch AdamW recipe
  (configs/b16.py's; no download): part 1's config, part 3's train.py
  flags; mixup, RandAugment and drop path off."""
  return {"image_size": args.image_size, "model.dtype": args.dtype,
          "model.scan_layers": bool(scan), "model.remat_policy": args.remat,
          "model.drop_path_rate": 0.0, "pp.mixup_alpha": 0.0,
          "pp.randaugment_layers": 0, **({} if attention is None else {
              "model.attention_impl": attention})}


def time_steps(step, sync, counts) -> list:
  """Seconds of each run of ``counts[i]`` steps, each synchronised."""
  times = []
  for n in counts:
    t = time.perf_counter()
    for _ in range(n):
      step()
    sync()
    times.append(time.perf_counter() - t)
  return times


def _rate(args, batch: int, compile_s: float, wall: float, peak) -> dict:
  """img/s per device of ``args.steps`` steps of ``batch`` images in
  ``wall`` s, and the MFU of the model's analytic train FLOPs."""
  from bench import machine  # pylint: disable=import-outside-toplevel
  from vit_jax import models  # pylint: disable=import-outside-toplevel
  per_dev = args.steps * batch / wall
  f_img = machine.step_flops(models.decode_variant(args.model),
                             args.image_size, "train", 1000)
  return {"step_s": wall / args.steps, "compile_s": compile_s,
          "img_per_s": per_dev, "train_flops_per_image": f_img,
          "mfu": None if peak is None else per_dev * f_img / peak}


def step_rate(args, *, batch: int, attention: str, scan: bool,
              profile_dir: str | None = None) -> dict:
  """img/s of ``train.py``'s jitted train step, ``batch`` per device; with
  ``profile_dir``, then a ``jax.profiler`` trace of 3 more steps there."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from configs import common  # pylint: disable=import-outside-toplevel
  from vit_jax.train import (optim, sharding, init as train_init, step as train_step)
  n_dev = jax.local_device_count()
  cfg = common.vit_recipe("scratch", args.model, None)
  cfg.update_from_flattened_dict(dict(workload(args, attention, scan),
                                      batch_size=batch * n_dev))
  num_classes = 1000
  model = train_init.build_model(cfg.model_name,
                                 train_init.model_kwargs(cfg, num_classes))
  tx = optim.make_optimizer(cfg, optim.make_schedule(cfg))
  mesh = sharding.make_mesh(jax.local_devices(), 1)
  abstract = train_step.abstract_train_state(model, tx, cfg.image_size)
  shards = sharding.state_shardings(abstract, mesh)
  fns = train_step.compile_steps(model, tx, cfg, mesh, abstract, shards,
                                 num_classes, mean=(0.5,) * 3, std=(0.5,) * 3)
  state = [fns.init_from_rng(jax.random.key(0))]
  rng, g, data = np.random.RandomState(0), cfg.batch_size, (
      sharding.batch_sharding(mesh))
  batch_arr = jax.device_put({
      "image": rng.randint(0, 256, (g, cfg.image_size, cfg.image_size, 3),
                           np.uint8),
      "label": rng.randint(0, num_classes, (g,), np.int32)}, data)
  votes = jax.device_put(np.zeros((n_dev,), np.int32), data)

  def step():
    state[0] = fns.train_step(state[0], batch_arr, votes)[0]
  sync = lambda: jax.block_until_ready(state[0].step)  # noqa: E731
  compile_s, _, wall = time_steps(step, sync, (1, 2, args.steps))
  if profile_dir:  # the trace, and the HLO that names its ops
    os.makedirs(profile_dir, exist_ok=True)
    with open(os.path.join(profile_dir, "step.hlo.txt"), "w") as f:
      f.write(fns.train_step.lower(state[0], batch_arr, votes).compile()
              .as_text())
    with jax.profiler.trace(profile_dir):
      time_steps(step, sync, (3,))
  r = _rate(args, batch, compile_s, wall,
            peak_flops(jax.devices()[0].device_kind))
  r["img_per_s_per_device"] = r.pop("img_per_s")
  return dict(r, batch_per_device=batch, attention=attention, scan=scan,
              devices=n_dev)


def _logits(model, variables, x, dev, precision=None):
  """Our model's logits on ``dev`` at the matmul ``precision``."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  with jax.default_matmul_precision(precision):
    fn = jax.jit(lambda v, x: model.apply(v, x, train=False))
    return np.asarray(fn(jax.device_put(variables, dev),
                         jax.device_put(x, dev)), np.float64)


def logits_vs_cpu(args) -> dict:
  """Relative max difference of float32 logits, accelerator vs host CPU, at
  the highest matmul precision, on a randomly initialised model."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from bench import steps  # pylint: disable=import-outside-toplevel
  from vit_jax import models  # pylint: disable=import-outside-toplevel
  model = models.get_model(args.model, num_classes=1000)
  x = np.random.RandomState(1).normal(
      size=(4, args.image_size, args.image_size, 3)).astype(np.float32)
  cpu, accel = jax.devices("cpu")[0], jax.devices()[0]
  # Every parameter perturbed: a zero head would make the logits equal.
  with jax.default_device(cpu):
    variables = steps.perturbed(models.init_params(model, args.image_size), 2)
  a, c = (_logits(model, variables, x, d, "highest") for d in (accel, cpu))
  rel = float(np.max(np.abs(a - c)) / np.max(np.abs(c)))
  return {"rel_max_diff": rel, "same_device": accel.platform == "cpu",
          "accelerator": accel.device_kind, "cpu": cpu.device_kind}


def _timm_model(args, num_classes=1000):
  """timm's ``args.model`` (``args.timm_depth`` blocks, 0: all), random
  weights with noise added to every one (zero head, unit LayerNorms)."""
  import timm  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  kw = {"depth": args.timm_depth} if args.timm_depth else {}
  m = timm.create_model(TIMM_NAMES[args.model], pretrained=False,
                        num_classes=num_classes, img_size=args.image_size,
                        drop_path_rate=0.0, **kw)
  g = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for t in m.state_dict(keep_vars=True).values():
      if t.is_floating_point():
        t.add_(0.02 * torch.randn(t.shape, generator=g))
  return m.eval()


def timm_parity(args) -> dict:
  """Ours and timm's float32 logits against timm's in float64 on the CPU."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  from vit_jax.weights import build  # pylint: disable=import-outside-toplevel
  m = _timm_model(args)
  sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
  name = None if args.timm_depth else TIMM_NAMES[args.model]
  with warnings.catch_warnings():  # depth-2 stand-ins: timm's GELU guessed
    warnings.simplefilter("ignore")
    model, variables = build.from_state_dict(sd, name)
  x = np.random.RandomState(3).uniform(
      -2, 2, (8, args.image_size, args.image_size, 3)).astype(np.float32)
  x_t = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
  with torch.no_grad():
    ref = m.double()(x_t.double()).numpy()
    m.float()
    out = {"timm float32, CPU": m(x_t).numpy()}
    if torch.cuda.is_available():
      out[f"timm float32, {torch.cuda.get_device_name()} (torch defaults)"] = (
          m.to("cuda")(x_t.to("cuda")).cpu().numpy())
  cpu, accel = jax.devices("cpu")[0], jax.devices()[0]
  out[f"ours float32, {cpu.device_kind} (CPU)"] = _logits(model, variables, x,
                                                          cpu)
  for p in ((None, "highest") if accel.platform != "cpu" else ()):
    out[f"ours float32, {accel.device_kind}, {p or 'default'} precision"] = (
        _logits(model, variables, x, accel, p))
  scale = np.max(np.abs(ref))
  return {"timm": TIMM_NAMES[args.model], "depth": args.timm_depth or "all",
          "rel_max_diff": {k: float(np.max(np.abs(v - ref)) / scale)
                           for k, v in out.items()}}


def torch_step_rate(args, batch: int, compile_mode: str = "eager",
                    profile_dir: str | None = None) -> dict:
  """img/s of timm's train step on torch's CUDA device (else the CPU):
  bfloat16 autocast, fused AdamW, a float batch already on the device;
  ``compile_mode`` "eager" or a ``torch.compile`` mode of the model
  ("default", "max-autotune", ...). With ``profile_dir``, then a
  ``torch.profiler`` trace of 3 more steps there (Chrome trace JSON)."""
  import torch  # pylint: disable=import-outside-toplevel
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
  name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
  m = _timm_model(args).train().to(dev)
  opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.05,
                          fused=True)
  fwd = m if compile_mode == "eager" else torch.compile(m, mode=compile_mode)
  x = torch.randn(batch, 3, args.image_size, args.image_size, device=dev)
  y = torch.randint(0, 1000, (batch,), device=dev)

  def step():
    with torch.autocast(dev, dtype=torch.bfloat16):
      loss = torch.nn.functional.cross_entropy(fwd(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
  compile_s, _, wall = time_steps(step, sync, (1, 2, args.steps))
  if profile_dir:
    os.makedirs(profile_dir, exist_ok=True)
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
      time_steps(step, sync, (3,))
    prof.export_chrome_trace(os.path.join(
        profile_dir, f"torch_{compile_mode}.trace.json"))
  return dict(_rate(args, batch, compile_s, wall,
                    peak_flops(name) if dev == "cuda" else None),
              batch=batch, compile_mode=compile_mode, device=name,
              torch=torch.__version__)


def has(*modules) -> bool:
  import importlib.util  # pylint: disable=import-outside-toplevel
  return all(importlib.util.find_spec(m) is not None for m in modules)


def has_tensorflow() -> bool:
  return has("tensorflow")


def end_to_end(args, folder: str, first: dict) -> dict:
  """train.py on ``--e2e-data`` (synthetic batches, or the JPEG folder),
  the ``first`` setting of part 1: its last logged img/s against the step
  alone's."""
  import jax  # pylint: disable=import-outside-toplevel
  n_dev, work = jax.local_device_count(), tempfile.mkdtemp(prefix="vit_e2e_")
  steps, batch = args.e2e_steps, first["batch_per_device"] * n_dev
  data = "synthetic" if args.e2e_data == "synthetic" else f"folder:{folder}"
  cmd = [sys.executable, os.path.join(REPO, "train.py"),
         f"--config={REPO}/configs/b16.py:scratch", f"--workdir={work}"] + [
             f"--config.{k}={v}" for k, v in dict(
                 workload(args, first["attention"], first["scan"]),
                 dataset=data, model_name=args.model, batch_size=batch,
                 eval_batch_size=batch, total_steps=steps,
                 log_every=max(1, steps // 3), eval_every=10 * steps,
                 checkpoint_every=10 * steps, warmup_steps=1,
                 write_plots=False, tensorboard=False,
                 async_checkpointing=False).items()]
  try:
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                       check=False)
    wall = time.perf_counter() - t
    if p.returncode:
      return {"error": (p.stderr or p.stdout)[-2000:], "command": cmd}
    rows = [json.loads(line) for line in
            open(os.path.join(work, "metrics.jsonl"))]
    rates = [r["img_per_sec"] for r in rows if "img_per_sec" in r]
  finally:
    shutil.rmtree(work, ignore_errors=True)
  e2e, step_img_s = rates[-1] / n_dev, first["img_per_s_per_device"]
  return {"img_per_s_per_device": e2e, "step_img_per_s_per_device": step_img_s,
          "ratio": e2e / step_img_s, "wall_s": wall, "steps": steps,
          "data": args.e2e_data, "logged_rates": rates}


def _attempt(label: str, fn, **fail):
  """``fn()``, or ``fail`` with the error it raised, printed after
  ``label`` (one setting that fails does not end the run)."""
  try:
    return fn()
  except Exception as e:  # pylint: disable=broad-except
    fail["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(f"{label}  failed: {fail['error']}", flush=True)
    return fail


def _mfu(r) -> str:
  return "unknown" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"


def main(argv=None):
  console.lean_start_up()
  console.quiet_native_logs()
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", help="default vit_b_16 (vit_ti_16 on CPU)")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--remat", default="", help="the blocks' remat_policy "
                 "(full, dots, ...; default none)")
  p.add_argument("--batch", type=int, nargs="+",
                 help="per device; default 256 512 (4 8 on CPU)")
  p.add_argument("--attention", nargs="+",
                 help="attention_impl values; default cudnn xla (matmul xla "
                      "on CPU); 'auto' = the backend's choice")
  p.add_argument("--scan", nargs="+", choices=("on", "off"),
                 default=["off", "on"])
  for flag, what in (("--image-size", None), ("--images", "JPEGs generated"),
                     ("--steps", "timed steps per setting"),
                     ("--e2e-steps", "train.py's steps in part 3"),
                     ("--timm-depth", "blocks of timm's model in part 5 (0: "
                      "all; default all, 2 on CPU)")):
    p.add_argument(flag, type=int, help=what)
  p.add_argument("--e2e-data", choices=("synthetic", "folder"),
                 default="synthetic", help="part 3: batches made on the "
                 "devices, or the JPEGs through the pipeline (TensorFlow)")
  p.add_argument("--jpeg-size", type=int, nargs=2, metavar=("H", "W"))
  p.add_argument("--skip", nargs="*", default=[],
                 choices=("step", "pipeline", "e2e", "logits", "timm",
                          "torch"))
  p.add_argument("--torch-compile", nargs="+", default=["eager", "default"],
                 help="part 6: torch's step eager and/or under torch.compile "
                      "with these modes (e.g. default max-autotune)")
  p.add_argument("--profile", metavar="DIR",
                 help="also trace 3 steps of the first setting of 1. "
                      "(jax.profiler) and of each torch step of 6. "
                      "(torch.profiler) into DIR; read with bench/ops.py "
                      "--trace")
  p.add_argument("--json", help="also write the results here")
  args = p.parse_args(argv)
  skip = set(args.skip)
  if not {"timm", "torch"} <= skip:
    # torch (timm loads torchvision) before TensorFlow (part 2): the other
    # order crashes the process on this stack.
    try:
      import timm  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
      import torch  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
      pass

  # The step as train.py runs it: its XLA flags, unless XLA_FLAGS names them.
  xla_flags.apply()
  import jax  # pylint: disable=import-outside-toplevel

  from bench import input_pipeline as ip_bench, machine  # pylint: disable=import-outside-toplevel
  backend = jax.default_backend()
  for k, v in DEFAULTS.items():
    if getattr(args, k) is None:
      setattr(args, k, v[backend == "cpu"])
  dev = jax.devices()[0]
  res = {"backend": backend, "device": dev.device_kind,
         "devices": jax.local_device_count(),
         "host_cpu": machine.describe().replace("CPU: ", "", 1),
         "jax": jax.__version__, "model": args.model,
         "image_size": args.image_size, "dtype": args.dtype,
         "peak_bf16_flops": peak_flops(dev.device_kind)}
  print(f"Device: {jax.local_device_count()} x {dev.device_kind} ({backend}); "
        f"host CPU: {res['host_cpu']}; jax {jax.__version__}; "
        f"XLA_FLAGS={os.environ['XLA_FLAGS']!r}")
  res["xla_flags"] = os.environ["XLA_FLAGS"]
  if backend == "cpu":
    print("This is a CPU: the numbers below measure this CPU at tiny sizes "
          "(unless given), not an accelerator; MFU is unknown.")

  steps = res["train_step"] = []
  if "step" not in skip:
    print(f"\n1. train step ({args.model}, {args.image_size}px, {args.dtype}, "
          f"the config's AdamW; per device)")
    print(f"{'batch':>6s} {'attention':>9s} {'scan':>5s} {'img/s/dev':>10s} "
          f"{'step ms':>8s} {'MFU':>6s} {'compile s':>9s}")
    for b, a, s in ((b, None if a == "auto" else a, s == "on")
                    for b in args.batch for a in args.attention
                    for s in args.scan):
      label = f"{b:6d} {str(a):>9s} {'on' if s else 'off':>5s}"
      r = _attempt(label, lambda: step_rate(  # pylint: disable=cell-var-from-loop
          args, batch=b, attention=a, scan=s, profile_dir=os.path.join(
              args.profile, "jax") if args.profile and not steps else None),
                   batch_per_device=b, attention=a, scan=s)
      if "error" not in r:
        print(f"{label} {r['img_per_s_per_device']:10.1f} "
              f"{1e3 * r['step_s']:8.1f} {_mfu(r):>6s} {r['compile_s']:9.1f}",
              flush=True)
      steps.append(r)
  ok = [r for r in steps if "error" not in r]
  if ok:
    best = res["best_step"] = max(ok, key=lambda r: r["img_per_s_per_device"])
    if backend != "cpu" and (args.model, args.dtype) == ("vit_b_16",
                                                          "bfloat16"):
      met = best["img_per_s_per_device"] >= TARGET_IMG_S
      print(f"Best {best['img_per_s_per_device']:.0f} img/s per device; "
            f"target >= {TARGET_IMG_S:.0f} on one H100/H200: "
            f"{'met' if met else 'NOT met'}.")

  folder = tempfile.mkdtemp(prefix="vit_jax_accel_jpegs_")
  tf, e2e = has_tensorflow(), "e2e" not in skip
  try:
    if not tf and "pipeline" not in skip:
      print("\n2. input pipeline alone: not run (no TensorFlow here)")
    if tf and ("pipeline" not in skip or args.e2e_data == "folder"):
      ip_bench.write_jpegs(folder, args.images, *args.jpeg_size)
    if tf and "pipeline" not in skip:
      cores = len(os.sched_getaffinity(0))
      cfg = ip_bench.pipeline_config(folder, image_size=args.image_size)
      r = ip_bench.measure(cfg, cores=cores, batch=max(args.batch),
                           batches=max(2, min(20, args.images //
                                              max(args.batch))))
      res["input_pipeline"] = dict(r, cores=cores)
      print(f"\n2. input pipeline alone ({args.jpeg_size[0]}x"
            f"{args.jpeg_size[1]} JPEGs -> {args.image_size}px, Inception crop "
            f"+ flip, uint8): {r['img_per_s']:.0f} img/s on {cores} host "
            f"cores ({r['img_per_s'] / cores:.0f} img/s/core)")
    if e2e and args.e2e_data == "folder" and not tf:
      print("\n3. train.py end to end on the JPEG folder: not run (no "
            "TensorFlow here; --e2e-data synthetic needs none)")
    elif e2e and ok:
      first = ok[0]
      r = res["end_to_end"] = end_to_end(args, folder, first)
      if "error" in r:
        print(f"\n3. train.py end to end failed:\n{r['error']}")
      else:
        print(f"\n3. train.py end to end ({args.e2e_data} data, batch "
              f"{first['batch_per_device']}/device, attention "
              f"{first['attention']}, scan {first['scan']}, {r['steps']} "
              f"steps): {r['img_per_s_per_device']:.1f} img/s per device vs "
              f"the step alone {r['step_img_per_s_per_device']:.1f}: ratio "
              f"{r['ratio']:.2f} (target >= {TARGET_E2E_RATIO})")
  finally:
    shutil.rmtree(folder, ignore_errors=True)

  if "logits" not in skip:
    r = res["logits"] = logits_vs_cpu(args)
    what = ("the same CPU twice (no accelerator here: not a comparison)"
            if r["same_device"] else f"{r['accelerator']} vs {r['cpu']}")
    print(f"\n4. float32 logits at highest matmul precision, {what}: "
          f"relative max difference {r['rel_max_diff']:.2e} (target <= "
          f"{TARGET_LOGITS_REL:.0e})")
  if "timm" not in skip and not has("timm", "torch"):
    print("\n5. against timm: not run (no timm and torch here)")
  elif "timm" not in skip:
    r = res["timm_parity"] = timm_parity(args)
    print(f"\n5. {r['timm']} ({r['depth']} blocks, random perturbed "
          f"weights): float32 logits against timm's in float64 on the CPU, "
          f"relative max difference")
    for k, v in r["rel_max_diff"].items():
      print(f"   {v:9.2e}  {k}")
  if not {"torch", "step"} & skip:
    if not (has("timm", "torch") and __import__("torch").cuda.is_available()):
      print("\n6. torch's train step: not run (no torch with CUDA and timm "
            "here)")
    elif ok:
      import torch  # pylint: disable=import-outside-toplevel
      b = ok[0]["batch_per_device"]
      ours = max(x["img_per_s_per_device"] for x in ok
                 if x["batch_per_device"] == b)
      print(f"\n6. torch {torch.__version__} train step "
            f"({TIMM_NAMES[args.model]}, batch {b}, bfloat16 autocast, fused "
            f"AdamW) on {torch.cuda.get_device_name()}; ours at batch {b}: "
            f"{ours:.1f} img/s")
      print(f"{'torch':>22s} {'img/s':>8s} {'step ms':>8s} {'MFU':>6s} "
            f"{'compile s':>9s} {'ours/torch':>10s}")
      res["torch_step"] = []
      for mode in args.torch_compile:
        r = _attempt(f"{mode:>22s}", lambda: torch_step_rate(  # pylint: disable=cell-var-from-loop
            args, b, mode, profile_dir=args.profile), compile_mode=mode)
        if "error" not in r:
          print(f"{mode:>22s} {r['img_per_s']:8.1f} {1e3 * r['step_s']:8.1f}"
                f" {_mfu(r):>6s} {r['compile_s']:9.1f} "
                f"{ours / r['img_per_s']:9.2f}x", flush=True)
        res["torch_step"].append(r)
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(res, f, indent=1, default=str)
    print(f"\nwrote {args.json}")
  return res


if __name__ == "__main__":
  main()
