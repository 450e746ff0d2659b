"""A long-lived benchmark child process: one framework, one compiled step.

The parent (:mod:`bench.harness`) starts one worker per contestant so that
torch's OpenMP pool and XLA's thread pool never share a process, and talks to
it over stdin/stdout, one JSON object per line:

  child -> parent   {"ready": true, "setup_s": ..., "compile_s": ...,
                     "check": [...], "info": {...}}   once, after warm-up
  parent -> child   {"cmd": "run", "iters": k}
  child -> parent   {"wall_s": ..., "cpu_s": ..., "step_s": [...]}
  parent -> child   {"cmd": "quit"}

``spec`` (argv[1], JSON) says what to build; see ``harness.Spec``. Nothing
here imports the other framework: the JAX worker reads the torch worker's
weights from a ``.npz`` file.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import time

import numpy as np

from bench import ynnpack_isa


def _cpu_seconds() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _counters() -> dict:
  """Per-process counters that explain a slow turn: page faults (memory
  handed back and touched again) and context switches (involuntary: the
  scheduler took a core away)."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return {"minflt": r.ru_minflt, "majflt": r.ru_majflt,
          "nivcsw": r.ru_nivcsw}


class _Mallinfo2(ctypes.Structure):
  _fields_ = [(f, ctypes.c_size_t) for f in (
      "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
      "uordblks", "fordblks", "keepcost")]


class ReleaseWait:
  """Waits, after a JAX step's result is ready, until XLA has freed the
  step's block of temporaries, before the next step is dispatched.

  XLA:CPU frees that block on its own thread a few milliseconds after the
  step's outputs are all ready (ViT-Ti/16 train, Zen 5: 4.3 ms median, in
  43 of 60 steps); a step dispatched at once then allocates its own block
  first, two blocks are alive, and the second comes from new memory whose
  every page faults (191,000 faults, the step ~1.6x as long; later steps
  alternate between the two, and the bench's heap guard trims one away
  between turns, to be faulted in again). In a loop of 150 Ti/16 steps,
  glibc's bytes in use right after a step were 221 MiB at the least and
  968 MiB at the most (the 746 MiB block not yet freed). This polls glibc's
  count of bytes in use (``mallinfo2``, ~1 us) until it is back within half
  a block of the level measured at rest, at most ``timeout_s``. The wait is
  inside the timed turn: it counts against JAX. Does nothing without glibc
  or without a block worth waiting for (16 MiB)."""

  def __init__(self, temp_bytes: int, timeout_s: float = 0.05):
    self.limit, self.timeout_s = None, timeout_s
    self.waited_s, self.timeouts = 0.0, 0
    try:
      self._mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
      self._mallinfo2.restype = _Mallinfo2
    except (OSError, AttributeError):
      self._mallinfo2 = None
    self.temp_bytes = int(temp_bytes)

  def in_use(self) -> int:
    """Bytes glibc has handed out: from its heap, and as blocks of their
    own mapping."""
    m = self._mallinfo2()
    return int(m.uordblks + m.hblkhd)

  def settle(self):
    """Takes the level at rest: called after warm-up, once the last step's
    block has surely been freed."""
    if self._mallinfo2 is None or self.temp_bytes < 2 ** 24:
      return
    time.sleep(0.05)
    self.limit = self.in_use() + self.temp_bytes // 2

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
  rs = np.random.RandomState(spec["seed"])
  b, s = spec["batch"], spec["image_size"]
  images = rs.standard_normal((b, s, s, 3)).astype(np.float32)  # NHWC
  labels = rs.randint(0, spec["num_classes"], size=(b,)).astype(np.int64)
  return images, labels


def _send(obj):
  sys.stdout.write(json.dumps(obj) + "\n")
  sys.stdout.flush()


def _serve(step, check, info, setup_s, compile_s, turn_extra=None):
  """Answers run requests until told to quit. ``step()`` runs one
  synchronous step (it must block until the result is ready);
  ``turn_extra()``, if given, returns fields added to each turn's reply."""
  info = dict(info, pid=os.getpid(), isa_env={k: os.environ[k] for k in (
      "XLA_FLAGS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
      "MKL_ENABLE_INSTRUCTIONS", ynnpack_isa.ENV) if k in os.environ})
  _send({"ready": True, "setup_s": setup_s, "compile_s": compile_s,
         "check": check, "info": info})
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
    if msg["cmd"] == "run":
      times = []
      cnt0 = _counters()
      cpu0, wall0 = _cpu_seconds(), time.perf_counter()
      for _ in range(int(msg["iters"])):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
      wall = time.perf_counter() - wall0
      cpu = _cpu_seconds() - cpu0
      cnt = {k: v - cnt0[k] for k, v in _counters().items()}
      _send(dict(cnt, wall_s=wall, cpu_s=cpu, step_s=times,
                 trimmed_before=trimmed, **(turn_extra() if turn_extra
                                            else {})))
      # Between turns, never inside a timed one; the next turn's reply says
      # whether it started on a trimmed heap (its pages to fault in again).
      trimmed = bool(heap.step()) if heap is not None else False


# --------------------------------------------------------------------------- #
# torch
# --------------------------------------------------------------------------- #


def torch_main(spec):
  t0 = time.perf_counter()
  import torch  # pylint: disable=import-outside-toplevel
  import torchvision  # pylint: disable=import-outside-toplevel

  if spec.get("threads"):
    torch.set_num_threads(int(spec["threads"]))
  torch.manual_seed(spec["seed"])
  if spec.get("timm"):  # timm's own model of a family (bench/families.py)
    import timm  # pylint: disable=import-outside-toplevel
    model = timm.create_model(spec["name"], pretrained=False,
                              num_classes=spec["num_classes"],
                              img_size=spec["image_size"])
    head = model.get_classifier()
  else:
    v = spec["variant"]
    model = torchvision.models.VisionTransformer(
        image_size=spec["image_size"], patch_size=v["patch_size"],
        num_layers=v["num_layers"], num_heads=v["num_heads"],
        hidden_dim=v["hidden_size"], mlp_dim=v["mlp_dim"],
        num_classes=spec["num_classes"])
    head = model.heads.head
  # torchvision zero-initialises the head (timm scales it down); give it
  # weights so that the logits of the two frameworks can be compared
  # meaningfully.
  with torch.no_grad():
    head.weight.normal_(0.0, 0.02)
  if spec.get("weights_out"):
    np.savez(spec["weights_out"],
             **{k: t.detach().cpu().numpy()
                for k, t in model.state_dict().items()})

  images, labels = _inputs(spec)
  x = torch.from_numpy(images.transpose(0, 3, 1, 2).copy())  # NCHW
  y = torch.from_numpy(labels)
  bf16 = spec["dtype"] == "bfloat16"
  autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
  fwd = model
  if spec.get("torch_compile"):
    fwd = torch.compile(model)

  if spec["mode"] == "infer":
    model.eval()

    def step():
      with torch.inference_mode(), autocast():
        return fwd(x)

    def first():
      return step().float().numpy()
  else:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"],
                            weight_decay=spec["weight_decay"])

    def step():
      opt.zero_grad(set_to_none=True)
      with autocast():
        loss = torch.nn.functional.cross_entropy(fwd(x), y)
      loss.backward()
      opt.step()
      return loss

    def first():
      return [float(step().detach())]

  setup_s = time.perf_counter() - t0
  t = time.perf_counter()
  check = first()  # first call: oneDNN primitive creation / torch.compile
  compile_s = time.perf_counter() - t
  for _ in range(spec["warmup"]):
    step()
  check = np.asarray(check, np.float64).ravel()[:spec["check_size"]].tolist()
  info = {"threads": torch.get_num_threads(), "torch": torch.__version__,
          "compiled": bool(spec.get("torch_compile"))}
  _serve(step, check, info, setup_s, compile_s if spec.get("torch_compile")
         else None)


# --------------------------------------------------------------------------- #
# JAX
# --------------------------------------------------------------------------- #


def jax_main(spec):
  t0 = time.perf_counter()
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import vit_jax  # pylint: disable=import-outside-toplevel
  ynnpack = ynnpack_isa.apply_from_environment()  # --isa avx2
  from vit_jax import convert  # pylint: disable=import-outside-toplevel

  overrides = dict(spec.get("model_overrides") or {})
  if spec["dtype"] == "bfloat16":
    overrides.setdefault("dtype", jnp.bfloat16)
  for k in ("dtype", "param_dtype"):
    if isinstance(overrides.get(k), str):
      overrides[k] = jnp.dtype(overrides[k])

  with np.load(spec["weights_in"]) as f:
    state_dict = {k: f[k] for k in f.files}
  if spec.get("timm"):
    from vit_jax import formats  # pylint: disable=import-outside-toplevel
    model, variables = formats.from_timm(state_dict, spec["name"], **overrides)
  else:
    model, variables = convert.from_torchvision(state_dict, spec["name"],
                                                **overrides)
  variables = jax.device_put(variables)
  images, labels = _inputs(spec)
  x = jnp.asarray(images)
  y = jnp.asarray(labels.astype(np.int32))

  from bench import steps  # pylint: disable=import-outside-toplevel
  release = lambda: None  # the step's temporaries freed (ReleaseWait)
  if spec["mode"] == "infer":
    fn = steps.make_infer_step(model)
    t = time.perf_counter()
    compiled = fn.lower(variables, x).compile()
    compile_s = time.perf_counter() - t

    def step():
      out = compiled(variables, x).block_until_ready()
      release()
      return out

    def first():
      return np.asarray(step(), np.float32)
  else:
    tx = steps.adamw(spec["lr"], spec["weight_decay"])
    params = variables["params"]
    state = [params, tx.init(params)]
    fn = steps.make_train_step(model, tx, donate=spec.get("donate", True))
    t = time.perf_counter()
    compiled = fn.lower(*state, x, y).compile()
    compile_s = time.perf_counter() - t

    def step():
      state[0], state[1], loss = compiled(state[0], state[1], x, y)
      jax.block_until_ready(state)
      loss = loss.block_until_ready()
      release()
      return loss

    def first():
      return [float(step())]

  mem = steps.peak_bytes(compiled)
  setup_s = time.perf_counter() - t0 - compile_s
  check = first()
  for _ in range(spec["warmup"]):
    step()
  if spec.get("release_wait", True):
    release = ReleaseWait(mem["temp"])
    release.settle()
  check = np.asarray(check, np.float64).ravel()[:spec["check_size"]].tolist()
  info = {"jax": jax.__version__, "devices": str(jax.devices()),
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "overrides": {k: str(v) for k, v in overrides.items()},
          # which checkout ran (ab.py's src=)
          "vit_jax": os.path.dirname(os.path.abspath(vit_jax.__file__))}
  if ynnpack:
    info["ynnpack_flags"] = {"before": ynnpack[0], "after": ynnpack[1]}
  info["memory"] = mem
  info["release_wait"] = getattr(release, "limit", None) is not None
  last = [0.0, 0]

  def turn_extra():
    """Seconds this turn waited for the temporaries, and waits that gave
    up after ``timeout_s``."""
    now = [getattr(release, "waited_s", 0.0), getattr(release, "timeouts", 0)]
    out = {"release_wait_s": now[0] - last[0],
           "release_timeouts": now[1] - last[1]}
    last[:] = now
    return out

  _serve(step, check, info, setup_s, compile_s, turn_extra)


def main():
  framework, spec = sys.argv[1], json.loads(sys.argv[2])
  if spec.get("src"):  # ab.py's src=: vit_jax from that checkout, so it
    # goes on the path before anything imports vit_jax
    sys.path.insert(0, spec["src"])
  # TensorFlow's load-time INFO lines off the parent's screen, as in the
  # CLIs (a runtime child imports it).
  from vit_jax.data import console  # pylint: disable=import-outside-toplevel
  console.quiet_native_logs()
  # Results go to the parent on stdout; everything else (framework logs and
  # warnings) to stderr.
  real_stdout = sys.stdout
  sys.stdout = sys.stderr
  global _send  # pylint: disable=global-statement

  def _send_real(obj):
    real_stdout.write(json.dumps(obj) + "\n")
    real_stdout.flush()

  _send = _send_real
  if framework in ("stablehlo", "savedmodel", "onnxruntime"):
    from bench import export_worker  # pylint: disable=import-outside-toplevel
    export_worker.runtime_main(framework, spec, _serve, _inputs)
    return
  {"torch": torch_main, "jax": jax_main}[framework](spec)


if __name__ == "__main__":
  main()
