"""What a user sees: metrics.jsonl, TensorBoard events, progress lines, plots.

``<workdir>/metrics.jsonl`` holds one JSON object per event: a ``step`` plus
named scalars (``train_loss``, ``learning_rate``, ``img_per_sec``,
``eval_loss``, ``eval_accuracy``, ``eval_top5_accuracy``...). Every (re)start
first writes a row with the run's facts (``event: "start"``,
``num_devices``, ``num_processes``, ``global_batch_size``...). Only process 0
writes; other processes get a writer that does nothing.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"


def _jsonable(v):
  if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
    v = v.item()
  if isinstance(v, float) and not math.isfinite(v):
    return str(v)  # 'nan' / 'inf': keep the file valid JSON
  return v


def _scalar_metadata():
  from tensorflow.core.framework import summary_pb2  # pylint: disable=import-outside-toplevel
  meta = summary_pb2.SummaryMetadata()
  meta.plugin_data.plugin_name = "scalars"
  return meta


def read_metrics(workdir: str) -> List[Dict[str, Any]]:
  """All rows of ``<workdir>/metrics.jsonl`` (ignores a torn last line)."""
  path = os.path.join(workdir, METRICS_FILE)
  rows = []
  if not os.path.exists(path):
    return rows
  with open(path) as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        pass  # a line cut short by a kill
  return rows


def _have_tensorflow() -> bool:
  try:
    return importlib.util.find_spec("tensorflow") is not None
  except ValueError:  # sys.modules["tensorflow"] = None: blocked
    return False


class MetricsWriter:
  """Appends rows to metrics.jsonl and TensorBoard; prints progress lines."""

  def __init__(self, workdir: str, *, enabled: bool = True,
               tensorboard: bool = True, stream=None):
    self.workdir = workdir
    self.enabled = enabled
    self.stream = stream or sys.stdout
    self._tb = None
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      if tensorboard and not _have_tensorflow():
        print("note: TensorFlow is not installed: no TensorBoard events "
              "(metrics.jsonl and the plots are written).", file=self.stream)
      elif tensorboard:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        self._tb = tf.summary.create_file_writer(workdir)

  def truncate_after(self, step: int):
    """Drops rows of steps after ``step`` (a resumed run redoes them)."""
    if not self.enabled:
      return
    path = os.path.join(self.workdir, METRICS_FILE)
    rows = read_metrics(self.workdir)
    kept = [r for r in rows if int(r.get("step", 0)) <= step]
    if len(kept) != len(rows) or os.path.exists(path):
      tmp = path + ".tmp"
      with open(tmp, "w") as f:
        for r in kept:
          f.write(json.dumps(r) + "\n")
      os.replace(tmp, path)

  def write(self, step: int, **scalars):
    if not self.enabled:
      return
    row = {"step": int(step)}
    row.update({k: _jsonable(v) for k, v in scalars.items()})
    with open(os.path.join(self.workdir, METRICS_FILE), "a") as f:
      f.write(json.dumps(row) + "\n")
      f.flush()
    if self._tb is not None:
      import tensorflow as tf  # pylint: disable=import-outside-toplevel
      with self._tb.as_default():
        for k, v in row.items():
          if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
            # tf.summary.write + the 'scalars' plugin tag is what
            # tf.summary.scalar emits, without needing the tensorboard package.
            tf.summary.write(k, tf.constant(float(v), tf.float32),
                             step=int(step), metadata=_scalar_metadata())
      self._tb.flush()

  def print(self, msg: str):
    if self.enabled:
      print(msg, file=self.stream, flush=True)

  def close(self):
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def format_duration(seconds: float) -> str:
  seconds = max(0, int(round(seconds)))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class Progress:
  """Step rate and ETA from the time spent training (eval excluded)."""

  def __init__(self, start_step: int, total_steps: int):
    self.total = total_steps
    self.last_step = start_step
    self.last_time = time.perf_counter()
    self.train_seconds = 0.0
    self.steps_done = 0
    self.paused = 0.0
    self._pause_start = self.last_time

  def restart(self, step: int):
    """Starts timing at ``step`` (e.g. after the first, compiling, step)."""
    self.last_step, self.last_time, self.paused = step, time.perf_counter(), 0.0

  def pause(self):
    self._pause_start = time.perf_counter()

  def resume(self):
    self.paused += time.perf_counter() - self._pause_start

  def tick(self, step: int):
    """Returns (steps/s over the window, ETA in seconds)."""
    now = time.perf_counter()
    dt = max(1e-9, now - self.last_time - self.paused)
    n = step - self.last_step
    self.train_seconds += dt
    self.steps_done += n
    self.last_step, self.last_time, self.paused = step, now, 0.0
    rate = n / dt
    avg = self.steps_done / max(self.train_seconds, 1e-9)
    return rate, (self.total - step) / max(avg, 1e-9)


def progress_line(step, total, loss, lr, img_per_sec, eta) -> str:
  width = len(str(total))
  return (f"step {step:>{width}}/{total} ({100.0 * step / total:5.1f}%) | "
          f"loss {loss:.4f} | lr {lr:.3g} | {img_per_sec:,.0f} img/s | "
          f"ETA {format_duration(eta)}")


def write_plots(workdir: str, path: Optional[str] = None) -> Optional[str]:
  """Loss and accuracy curves from metrics.jsonl -> ``<workdir>/curves.png``."""
  rows = read_metrics(workdir)
  train = [(r["step"], r["train_loss"]) for r in rows
           if isinstance(r.get("train_loss"), (int, float))]
  ev = [r for r in rows if isinstance(r.get("eval_loss"), (int, float))]
  if not train and not ev:
    return None
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  if train:  # a run stopped early may have one point: draw it as one
    ax1.plot(*zip(*train), marker="o" if len(train) < 20 else None,
             label="train loss")
  if ev:
    ax1.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-",
             label="eval loss")
    ax2.plot([r["step"] for r in ev], [r["eval_accuracy"] for r in ev], "o-",
             label="eval accuracy")
    if any("eval_top5_accuracy" in r for r in ev):
      ax2.plot([r["step"] for r in ev],
               [r.get("eval_top5_accuracy", float("nan")) for r in ev], "s--",
               label="eval top-5 accuracy")
  ax1.set_xlabel("step")
  ax1.set_ylabel("loss")
  ax1.set_yscale("log")
  ax1.legend()
  ax1.grid(alpha=0.3)
  ax2.set_xlabel("step")
  ax2.set_ylabel("accuracy")
  ax2.set_ylim(0, 1)
  if ev:
    ax2.legend(loc="lower right")
  else:  # stopped before its first evaluation
    ax2.text(0.5, 0.5, "no evaluation yet", ha="center", va="center",
             transform=ax2.transAxes, color="gray")
  ax2.grid(alpha=0.3)
  fig.suptitle(os.path.basename(os.path.abspath(workdir)))
  fig.tight_layout()
  path = path or os.path.join(workdir, PLOT_FILE)
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path

