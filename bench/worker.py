"""The one benchmark child process: every framework's side of a benchmark.

    python -m bench.worker KIND SPEC_JSON

A contestant (``jax``, ``torch``, or an exported artifact in its runtime:
``stablehlo``, ``savedmodel``, ``onnxruntime``) talks to the parent
(:mod:`bench.harness`) over stdin/stdout, one JSON object per line: once
ready ``{"ready": true, "setup_s", "compile_s", "check", "info"}``, then
for each ``{"cmd": "run", "iters": k}`` a turn's ``{"wall_s", "cpu_s",
"step_s", ...}``, until ``{"cmd": "quit"}``. A one-shot kind (:data:`ONCE`)
prints one JSON result and exits (``harness.call``). Nothing imports the
other framework: the JAX side reads torch's weights from a ``.npz`` file.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import resource
import sys
import tempfile
import time

import numpy as np

# The environment a table reports (machine.EMULATE_AVX2 sets them).
ISA_ENV = ("XLA_FLAGS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
           "MKL_ENABLE_INSTRUCTIONS")
# (height, width) aspect ratios of a NaFlex batch's images (cycled).
RATIOS = ((1, 1), (4, 3), (3, 4), (16, 9), (9, 16), (2, 1), (1, 2), (1, 3))


def _counters() -> dict:  # CPU time, page faults, context switches
  r = resource.getrusage(resource.RUSAGE_SELF)
  return {"cpu_s": r.ru_utime + r.ru_stime, "minflt": r.ru_minflt,
          "majflt": r.ru_majflt, "nivcsw": r.ru_nivcsw}


class _Mallinfo2(ctypes.Structure):
  _fields_ = [(f, ctypes.c_size_t) for f in (
      "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
      "uordblks", "fordblks", "keepcost")]


class ReleaseWait:
  """Waits, after a JAX step's result is ready, until XLA has freed the
  step's block of temporaries (on its own thread, a few ms later: ViT-Ti/16
  train, Zen 5, 4.3 ms median); a step dispatched at once takes its block
  from new memory, every page of it faulting (the step ~1.6x as long).
  Polls glibc's bytes in use (``mallinfo2``, ~1 us) until back within half
  a block of the level at rest, at most ``timeout_s``, inside JAX's timed
  turn. Does nothing without glibc or for blocks under 16 MiB."""

  def __init__(self, temp_bytes: int, timeout_s: float = 0.05):
    self.limit, self.timeout_s, self.temp_bytes = None, timeout_s, temp_bytes
    self.waited_s, self.timeouts = 0.0, 0
    try:
      self._mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
      self._mallinfo2.restype = _Mallinfo2
    except (OSError, AttributeError):
      self._mallinfo2 = None
    self.active = self._mallinfo2 is not None and temp_bytes >= 2 ** 24

  def in_use(self) -> int:
    """Bytes glibc has handed out: from its heap, and as own mappings."""
    m = self._mallinfo2()
    return int(m.uordblks + m.hblkhd)

  def settle(self):
    """Takes the level at rest (after warm-up)."""
    if self.active:
      time.sleep(0.05)
      self.limit = self.in_use() + self.temp_bytes // 2

  def take(self) -> dict:  # since the last take: each turn's reply
    out = {"release_wait_s": self.waited_s, "release_timeouts": self.timeouts}
    self.waited_s, self.timeouts = 0.0, 0
    return out

  def __call__(self):
    if self.limit is None:
      return
    t0 = time.perf_counter()
    while self.in_use() > self.limit:
      if time.perf_counter() - t0 > self.timeout_s:
        self.timeouts += 1
        break
      time.sleep(0.0001)
    self.waited_s += time.perf_counter() - t0


def _inputs(spec):
  """The batch every contestant gets: NHWC float32 images, int labels."""
  rs = np.random.RandomState(spec["seed"])
  b, s = spec["batch"], spec["image_size"]
  images = rs.standard_normal((b, s, s, 3)).astype(np.float32)
  labels = rs.randint(0, spec["num_classes"], size=(b,)).astype(np.int64)
  return images, labels


def naflex_inputs(spec, form: str, patch: int):
  """A NaFlex model's input of the square batch's token count: the same
  images as a NaFlex dict (``naflex_square``: the mask and per-image grid
  resize alone), or images of :data:`RATIOS` padded to it (``naflex``)."""
  from vit_jax.data import naflex  # pylint: disable=import-outside-toplevel
  b, s = spec["batch"], spec["image_size"]
  tokens = (s // patch) ** 2
  if form == "naflex_square":
    return naflex.collate([dict(zip(naflex.KEYS, naflex.patchify(x, patch)))
                           for x in _inputs(spec)[0]], tokens)
  rng = np.random.default_rng(spec["seed"])
  hw = [RATIOS[i % len(RATIOS)] for i in range(b)]
  return naflex.batch_images([rng.integers(0, 256, (
      int(1.5 * s * h / max(h, w)) + 7, int(1.5 * s * w / max(h, w)) + 3, 3),
                                           dtype=np.uint8) for h, w in hw],
                             patch_size=patch, max_seq_len=tokens)


_send = print  # main() sends on the real stdout


def _on_host(out) -> np.ndarray:
  """A step's output (a torch tensor or a JAX array), flat, in float64."""
  out = out.detach().float().numpy() if hasattr(out, "detach") else out
  return np.asarray(out, np.float64).ravel()


def _serve(spec, step, info, t0, compile_s="first", turn_extra=None,
           settle=None):
  """Times the first call (``compile_s="first"``: its time is the compile
  time), warms up, says it is ready (``setup_s``: since ``t0``, compile
  aside; ``check``: the first output) and answers run requests until told
  to quit. ``step()`` runs one synchronous step; ``settle()`` runs after
  the warm-up; ``turn_extra()`` adds fields to each turn's reply."""
  setup_s = time.perf_counter() - t0 - (compile_s if isinstance(
      compile_s, float) else 0.0)
  t = time.perf_counter()
  out = step()  # first call: compiles, plans, creates oneDNN primitives
  compile_s = time.perf_counter() - t if compile_s == "first" else compile_s
  for _ in range(spec["warmup"]):
    step()
  if settle:
    settle()
  _send({"ready": True, "setup_s": setup_s, "compile_s": compile_s,
         "check": _on_host(out)[:4000].tolist(),
         "info": dict(info, pid=os.getpid(), isa_env={
             k: os.environ[k] for k in ISA_ENV if k in os.environ})})
  try:  # bounds a long child's kept heap (vit_jax/train/host_memory.py)
    from vit_jax.train.host_memory import HeapGuard, MALLOC_ENV  # pylint: disable=import-outside-toplevel
    kept = all(os.environ.get(k) == v for k, v in MALLOC_ENV.items())
    heap = HeapGuard(settle=1) if kept else None  # glibc's defaults: none
  except ImportError:  # src= of a checkout from before it
    heap = None
  trimmed = False
  for line in sys.stdin:
    msg = json.loads(line)
    if msg["cmd"] == "quit":
      return
    times, cnt0, wall0 = [], _counters(), time.perf_counter()
    for _ in range(int(msg["iters"])):
      t = time.perf_counter()
      step()
      times.append(time.perf_counter() - t)
    wall = time.perf_counter() - wall0
    _send(dict({k: v - cnt0[k] for k, v in _counters().items()}, wall_s=wall,
               step_s=times, trimmed_before=trimmed,
               **(turn_extra() if turn_extra else {})))
    # Between turns, never inside a timed one; the next reply says whether
    # it started on a trimmed heap (its pages to fault in again).
    trimmed = bool(heap.step()) if heap is not None else False


# torch.
def _torch_model(spec):
  """torchvision's ViT (or timm's model by name), seeded, its head given
  weights (torchvision zero-initialises it) so the logits mean something;
  the weights saved to ``weights_out`` for the JAX side."""
  import torch  # pylint: disable=import-outside-toplevel
  torch.manual_seed(spec["seed"])
  if spec.get("timm"):
    import timm  # pylint: disable=import-outside-toplevel
    model = timm.create_model(spec["name"], pretrained=False,
                              num_classes=spec["num_classes"],
                              img_size=spec["image_size"],
                              **({"depth": spec["layers"]} if spec.get(
                                  "layers") else {}))
    head = model.get_classifier()
  else:
    import torchvision  # pylint: disable=import-outside-toplevel
    v = spec["variant"]
    model = torchvision.models.VisionTransformer(
        image_size=spec["image_size"], patch_size=v["patch_size"],
        num_layers=v["num_layers"], num_heads=v["num_heads"],
        hidden_dim=v["hidden_size"], mlp_dim=v["mlp_dim"],
        num_classes=spec["num_classes"])
    head = model.heads.head
  with torch.no_grad():
    head.weight.normal_(0.0, 0.02)
  if spec.get("weights_out"):
    np.savez(spec["weights_out"], **{k: t.detach().cpu().numpy()
                                     for k, t in model.state_dict().items()})
  return model


def _torch_step(spec, model, fwd):
  """One synchronous step of torch's ``model`` (called as ``fwd``) on the
  batch: inference, or forward + cross-entropy + backward + AdamW; in
  bfloat16 under ``torch.autocast``."""
  import torch  # pylint: disable=import-outside-toplevel
  images, labels = _inputs(spec)
  x = torch.from_numpy(images.transpose(0, 3, 1, 2).copy())  # NCHW
  y = torch.from_numpy(labels)
  bf16 = spec["dtype"] == "bfloat16"
  autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
  if spec["mode"] == "infer":
    model.eval()

    def step():
      with torch.inference_mode(), autocast():
        return fwd(x)
    return step
  model.train()
  opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"],
                          weight_decay=spec["weight_decay"])

  def train_step():
    opt.zero_grad(set_to_none=True)
    with autocast():
      loss = torch.nn.functional.cross_entropy(fwd(x), y)
    loss.backward()
    opt.step()
    return loss
  return train_step


def torch_main(spec):
  t0 = time.perf_counter()
  import torch  # pylint: disable=import-outside-toplevel
  model = _torch_model(spec)
  fwd = torch.compile(model) if spec.get("torch_compile") else model
  _serve(spec, _torch_step(spec, model, fwd), {
      "threads": torch.get_num_threads(), "torch": torch.__version__}, t0,
         "first" if spec.get("torch_compile") else None)


# JAX.
def _overrides(spec):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  out = dict(spec.get("model_overrides") or {})
  if spec["dtype"] == "bfloat16":
    out.setdefault("dtype", "bfloat16")
  for k in ("dtype", "param_dtype"):
    if isinstance(out.get(k), str):
      out[k] = jnp.dtype(out[k])
  return out


def _jax_model(spec, **overrides):
  """Our model with the torch side's weights (``weights_in``)."""
  with np.load(spec["weights_in"]) as f:
    state_dict = {k: f[k] for k in f.files}
  if spec.get("timm"):
    from vit_jax import formats  # pylint: disable=import-outside-toplevel
    return formats.from_timm(state_dict, spec["name"], **overrides)
  from vit_jax import convert  # pylint: disable=import-outside-toplevel
  return convert.from_torchvision(state_dict, spec["name"], **dict(
      {"num_layers": spec["variant"]["num_layers"]}, **overrides))


def jax_main(spec):
  t0 = time.perf_counter()
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import vit_jax  # pylint: disable=import-outside-toplevel
  from bench import steps  # pylint: disable=import-outside-toplevel
  overrides = _overrides(spec)
  model, variables = _jax_model(spec, **overrides)
  variables = jax.device_put(variables)
  images, labels = _inputs(spec)
  x, y = jnp.asarray(images), jnp.asarray(labels.astype(np.int32))
  tx = steps.adamw(spec["lr"], spec["weight_decay"])
  t = time.perf_counter()
  compiled = steps.lower(model, spec["mode"], variables, x, y, tx,
                         donate=spec.get("donate", True)).compile()
  run = steps.runner(compiled, spec["mode"], variables, x, y, tx)
  compile_s = time.perf_counter() - t
  mem = steps.peak_bytes(compiled)
  # Waits for XLA to free the step's temporaries (settled after warm-up).
  wait = ReleaseWait(mem["temp"] if spec.get("release_wait", True) else 0)
  step = lambda: (run(), wait())[0]
  _serve(spec, step, {
      "jax": jax.__version__, "devices": str(jax.devices()),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "overrides": {k: str(v) for k, v in overrides.items()},
      # which checkout ran (ab.py's src=)
      "vit_jax": os.path.dirname(os.path.abspath(vit_jax.__file__)),
      "memory": mem, "release_wait": wait.active},
         t0, compile_s, wait.take, wait.settle)


# Exported artifacts in their runtimes: python -m vit_jax.export's format
# and file suffix.
FORMATS = {"stablehlo": ("stablehlo", ".shlo"),
           "savedmodel": ("savedmodel", ""), "onnxruntime": ("onnx", ".onnx")}


def runtime_main(framework: str, spec):
  """Setup: our model exported (dynamic batch) and loaded by its runtime;
  a step: one call on the batch (already the runtime's own array type)."""
  t0 = time.perf_counter()
  if framework == "onnxruntime":  # the ONNX exporter needs torch
    import torch  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  from vit_jax import export  # pylint: disable=import-outside-toplevel
  fmt, suffix = FORMATS[framework]
  path = os.path.join(tempfile.mkdtemp(prefix=f"vit_bench_{fmt}_"),
                      "artifact" + suffix)
  t = time.perf_counter()
  export.export(_jax_model(spec), fmt, path)
  export_s = time.perf_counter() - t
  images, _ = _inputs(spec)
  if fmt == "stablehlo":
    import jax  # pylint: disable=import-outside-toplevel
    art, x = export.load_stablehlo(path), jax.device_put(images)
    step = lambda: art(x).block_until_ready()
    info = {"jax": jax.__version__}
  elif fmt == "savedmodel":
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    serve = tf.saved_model.load(path).signatures["serving_default"]
    x = tf.constant(images)
    step = lambda: serve(images=x)["logits"].numpy()
    info = {"tensorflow": tf.__version__}
  else:
    import onnxruntime as ort  # pylint: disable=import-outside-toplevel
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    step = lambda: sess.run(["logits"], {"images": images})[0]
    info = {"onnxruntime": ort.__version__, "intra_op_threads":
            sess.get_session_options().intra_op_num_threads}
  _serve(spec, step, dict(info, export_s=export_s), t0)


# One-shot kinds.
def inprocess(spec):
  """ab.py --in-process: each config's step lowered from shapes (timed, a
  hash of its StableHLO), compiled (timed, XLA's memory analysis), then
  stepped in rotation, one step at a time: each step's time and faults."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from bench import steps  # pylint: disable=import-outside-toplevel
  from vit_jax import models  # pylint: disable=import-outside-toplevel
  if spec.get("src") and not models.__file__.startswith(spec["src"]):
    raise RuntimeError(f"src={spec['src']}: imported {models.__file__}")
  images, labels = _inputs(spec)
  y = jnp.asarray(labels.astype(np.int32))
  runs, info = {}, {}
  for cfg in spec["configs"]:
    jax.clear_caches()
    model = models.get_model(spec["name"], num_classes=spec["num_classes"],
                             **_overrides(dict(spec, **cfg)))
    form = cfg.get("input") or "square"
    x = jax.tree_util.tree_map(jnp.asarray, images if form == "square" else
                               naflex_inputs(spec, form, model.patch_size))
    tx = steps.adamw(spec["lr"], spec["weight_decay"])
    t0 = time.perf_counter()
    lowered = steps.lower(model, spec["mode"], jax.eval_shape(
        lambda m=model: models.init_params(m, spec["image_size"])), x, y, tx,
                          donate=cfg["donate"],
                          compiler_options=cfg["compiler_options"] or None)
    inf = info[cfg["label"]] = {"lower_s": time.perf_counter() - t0, "hash":
                                hashlib.sha256(lowered.as_text().encode())
                                .hexdigest()[:16]}
    if spec.get("lower_only"):
      continue
    t0 = time.perf_counter()
    compiled = lowered.compile()
    inf.update(compile_s=time.perf_counter() - t0,
               memory=steps.peak_bytes(compiled))
    if spec["steps"]:
      run = steps.runner(compiled, spec["mode"], jax.device_put(
          steps.perturbed(models.init_params(model, spec["image_size"],
                                             spec["seed"]), spec["seed"])),
                         x, y, tx)
      runs[cfg["label"]] = (run, ReleaseWait(inf["memory"]["temp"]))
      inf["check"] = float(jnp.asarray(run(), jnp.float32).sum())
  for run, release in runs.values():  # warm-up
    for _ in range(spec["warmup"]):
      run()
    release.settle()
  labels = list(runs)
  times, faults = {k: [] for k in labels}, {k: [] for k in labels}
  for i in range(spec["steps"]):
    for k in labels[i % len(labels):] + labels[:i % len(labels)]:
      f0, t0 = _counters()["minflt"], time.perf_counter()
      runs[k][0]()
      runs[k][1]()
      times[k].append(time.perf_counter() - t0)
      faults[k].append(_counters()["minflt"] - f0)
  return {"times": times, "faults": faults, "info": info}


def _median_ms(step, steps: int) -> float:
  times = []
  for _ in range(max(1, steps)):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
  return sorted(times)[len(times) // 2] * 1e3


def ops_main(spec):
  """``bench/ops.py``'s child: one framework's step (float32) profiled op
  by op and grouped; with ``ablate``, each variant of ``ops.VARIANTS`` (the
  stand-ins in place while JAX traces, around each torch step) and each
  one's first output, the variants timed in rotation over ``rounds``."""
  from bench import ops  # pylint: disable=import-outside-toplevel
  runs, n = {}, spec["steps"]
  variants = ops.VARIANTS if spec["ablate"] else [""]
  if spec["framework"] == "torch":
    import torch  # pylint: disable=import-outside-toplevel
    from torch.nn import functional  # pylint: disable=import-outside-toplevel
    for v in variants:
      model = _torch_model(spec)
      runs[v] = ops.standing_in(functional, ops.TORCH_STAND_INS, v,
                                _torch_step(spec, model, model))

    def profile(step):
      with torch.profiler.profile(
          activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n):
          step()
      return ops.torch_op_groups(prof.events(), n)
  else:
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    from bench import steps  # pylint: disable=import-outside-toplevel
    from vit_jax import models  # pylint: disable=import-outside-toplevel
    from vit_jax.models import kernels  # pylint: disable=import-outside-toplevel
    images, labels = _inputs(spec)
    x, y = jnp.asarray(images), jnp.asarray(labels.astype(np.int32))
    tx = steps.adamw(spec["lr"], spec["weight_decay"])
    for v in variants:
      with ops.stand_ins(kernels, ops.JAX_STAND_INS, v):
        model = models.get_model(spec["name"], num_classes=spec["num_classes"],
                                 num_layers=spec["variant"]["num_layers"])
        variables = jax.device_put(steps.perturbed(models.init_params(
            model, spec["image_size"], spec["seed"]), spec["seed"]))
        compiled = steps.lower(model, spec["mode"], variables, x, y,
                               tx).compile()
        runs[v] = steps.runner(compiled, spec["mode"], variables, x, y, tx)
      if not v:  # the full step, whose HLO names the profile's ops
        hlo = compiled.as_text()

    def profile(step):
      with tempfile.TemporaryDirectory(prefix="vit_jax_ops_") as d:
        with jax.profiler.trace(d):
          for _ in range(n):
            step()
        return ops.jax_groups(ops.op_times(d)[0], hlo, n)[:2]
  first = {v: _on_host(step())[:4].tolist() for v, step in runs.items()}
  for step in runs.values():
    for _ in range(spec["warmup"]):
      step()
  if spec["ablate"]:
    order, walls = list(runs), {v: [] for v in runs}
    for r in range(spec["rounds"]):
      for v in (order if r % 2 == 0 else order[::-1]):
        walls[v].append(_median_ms(runs[v], n))
    return {"walls": walls, "first": first}
  wall = _median_ms(runs[""], n)
  groups, detail = profile(runs[""])
  return dict(wall_ms=wall, groups=dict(groups),
              top=detail.most_common(spec["top"]))


def once(kind: str, spec):
  """A one-shot kind's result: torch's weights saved for the parent,
  :func:`inprocess`, :func:`ops_main` or ``machine.gemm_child``."""
  if kind == "weights":
    _torch_model(spec)
    return {"weights_out": spec["weights_out"]}
  if kind == "gemm":
    from bench import machine  # pylint: disable=import-outside-toplevel
    return machine.gemm_child(spec)
  return (ops_main if kind == "ops" else inprocess)(spec)


ONCE = ("weights", "inprocess", "gemm", "ops")


def main():
  kind, spec = sys.argv[1], json.loads(sys.argv[2])
  if spec.get("src"):  # ab.py's src=: vit_jax from that checkout, on the
    sys.path.insert(0, spec["src"])  # path before anything imports it
  from vit_jax.data import console  # pylint: disable=import-outside-toplevel
  console.lean_start_up()
  console.quiet_native_logs()  # TensorFlow's load-time INFO lines off
  # Results to the parent on stdout; framework logs and warnings to stderr.
  real_stdout, sys.stdout = sys.stdout, sys.stderr
  global _send  # pylint: disable=global-statement
  _send = lambda obj: print(json.dumps(obj), file=real_stdout, flush=True)  # noqa: E731
  if kind in ONCE:
    _send(once(kind, spec))
  elif kind in FORMATS:
    runtime_main(kind, spec)
  else:
    {"torch": torch_main, "jax": jax_main}[kind](spec)


if __name__ == "__main__":
  main()
