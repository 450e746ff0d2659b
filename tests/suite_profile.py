"""Where the suite's time goes: a pytest plugin, on when the environment
names a file (``VIT_JAX_SUITE_PROFILE=/tmp/profile.jsonl``; conftest.py
registers it).

Per test (setup + call + teardown), in seconds, one JSON line each:

- ``wall``: the whole test;
- ``compile``: XLA compilation in this process (jax's own
  ``/jax/core/compile/*`` duration events: tracing, lowering, compiling);
- ``subprocess``: time with at least one child process alive (the CLIs,
  train.py, multi-process runs: their own compilation and imports are in
  here, not in ``compile``);
- ``torch_build``: building timm / torchvision / transformers models;
- ``sleep``: ``time.sleep`` in this process (waits and polls);
- ``fixture_setup``: the setup phase (shared fixtures land on the first
  test that asks for them);
- ``cpu``: CPU seconds of this process (every thread: user + system);
- ``children_cpu``: CPU seconds of the processes it started and waited
  for (and theirs), user + system;
- ``worker`` and ``start`` (Unix time): which pytest-xdist worker ran it,
  and when (the run's timeline: idle workers at its end).

``python tests/suite_profile.py /tmp/profile.jsonl`` prints the table per
file and per kind (docs/development.md).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time

_lock = threading.Lock()
_acc = collections.Counter()
_children: dict[int, float] = {}  # id(Popen) -> start, while alive
_child_busy_since = None
_ACTIVE = {"on": False}


def _add(kind, seconds):
  if _ACTIVE["on"]:
    with _lock:
      _acc[kind] += seconds


def _child_started(p):
  global _child_busy_since  # pylint: disable=global-statement
  with _lock:
    if not _children:
      _child_busy_since = time.perf_counter()
    _children[id(p)] = time.perf_counter()


def _child_ended(p):
  global _child_busy_since  # pylint: disable=global-statement
  with _lock:
    if _children.pop(id(p), None) is not None and not _children:
      if _ACTIVE["on"] and _child_busy_since is not None:
        _acc["subprocess"] += time.perf_counter() - _child_busy_since
      _child_busy_since = None


def _install():
  import jax  # pylint: disable=import-outside-toplevel

  def on_duration(event, duration, **_):
    if event.startswith("/jax/core/compile/"):
      _add("compile", duration)
  jax.monitoring.register_event_duration_secs_listener(on_duration)

  init, wait = subprocess.Popen.__init__, subprocess.Popen.wait

  @functools.wraps(init)
  def popen_init(self, *a, **k):
    init(self, *a, **k)
    _child_started(self)

  @functools.wraps(wait)
  def popen_wait(self, *a, **k):
    try:
      return wait(self, *a, **k)
    finally:
      if self.returncode is not None:
        _child_ended(self)
  subprocess.Popen.__init__, subprocess.Popen.wait = popen_init, popen_wait
  poll = subprocess.Popen.poll

  @functools.wraps(poll)
  def popen_poll(self):
    r = poll(self)
    if r is not None:
      _child_ended(self)
    return r
  subprocess.Popen.poll = popen_poll

  sleep = time.sleep

  def timed_sleep(s):
    t = time.perf_counter()
    try:
      sleep(s)
    finally:
      if threading.current_thread() is threading.main_thread():
        _add("sleep", time.perf_counter() - t)
  time.sleep = timed_sleep

  def wrap_build(mod, name):
    fn = getattr(mod, name)

    @functools.wraps(fn)
    def timed(*a, **k):
      t = time.perf_counter()
      try:
        return fn(*a, **k)
      finally:
        _add("torch_build", time.perf_counter() - t)
    setattr(mod, name, timed)
  try:
    import timm  # pylint: disable=import-outside-toplevel
    wrap_build(timm, "create_model")
    import timm.models  # pylint: disable=import-outside-toplevel
    wrap_build(timm.models, "create_model")
  except ImportError:
    pass
  try:
    import torchvision.models  # pylint: disable=import-outside-toplevel
    wrap_build(torchvision.models, "get_model")
  except ImportError:
    pass


def _children_cpu() -> float:
  r = resource.getrusage(resource.RUSAGE_CHILDREN)
  return r.ru_utime + r.ru_stime


class SuiteProfile:
  """The plugin: one line per test into ``path``."""

  def __init__(self, path):
    self.path = path
    self.rows = []
    _install()

  def pytest_runtest_protocol(self, item, nextitem):  # noqa: D401
    del nextitem
    with _lock:
      _acc.clear()
    _ACTIVE["on"] = True
    self._t0 = time.perf_counter()
    self._start = time.time()
    self._cpu0 = time.process_time()
    self._children0 = _children_cpu()
    self._item = item
    self._setup = 0.0

  def pytest_runtest_logreport(self, report):
    if getattr(self, "_item", None) is None or (
        report.nodeid != self._item.nodeid):
      return  # pytest-xdist's controller: its workers write the lines
    if report.when == "setup":
      self._setup = report.duration
    if report.when != "teardown":
      return
    _ACTIVE["on"] = False
    with _lock:
      row = dict(_acc)
    row.update(nodeid=report.nodeid,
               wall=time.perf_counter() - self._t0,
               fixture_setup=self._setup,
               cpu=time.process_time() - self._cpu0,
               children_cpu=_children_cpu() - self._children0,
               worker=os.environ.get("PYTEST_XDIST_WORKER", ""),
               start=self._start,
               slow=bool(self._item.get_closest_marker("slow")))
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")


KINDS = ("compile", "subprocess", "torch_build", "sleep", "fixture_setup",
         "cpu", "children_cpu")


def table(path):
  """Markdown: seconds per file (and the suite) per kind."""
  rows = [json.loads(line) for line in open(path)]
  per = collections.defaultdict(collections.Counter)
  for r in rows:
    f = r["nodeid"].split("::")[0]
    for k in ("wall",) + KINDS:
      per[f][k] += r.get(k, 0.0)
    per[f]["tests"] += 1
    per[f]["slow"] += r["slow"]
  total = sum(per.values(), collections.Counter())
  out = ["| file | tests (slow) | wall s | compile | subprocess | torch/timm "
         "builds | sleeps | fixture setup | CPU | children's CPU |",
         "|---|---|---|---|---|---|---|---|---|---|"]
  for f, c in sorted(per.items(), key=lambda kv: -kv[1]["wall"]) + [
      ("**all**", total)]:
    out.append(f"| {f} | {c['tests']} ({c['slow']}) | {c['wall']:.0f} | " +
               " | ".join(f"{c[k]:.0f}" for k in KINDS) + " |")
  return "\n".join(out)


def slow_list(path, under: float = 1.0):
  """tests/slow_tests.txt from a profile: every test that took ``under``
  seconds or more (setup included), except each file's quickest, so that
  ``-m "not slow"`` still runs every file."""
  per = collections.defaultdict(list)
  for line in open(path):
    r = json.loads(line)
    # pytest-xdist's loadgroup reports a grouped test as "id@group".
    r["nodeid"] = re.sub(r"@[\w.-]+$", "", r["nodeid"])
    per[r["nodeid"].split("::")[0]].append(r)
  out = [f"# Tests marked slow (conftest.py): {under:g} s or more in "
         f"`VIT_JAX_SUITE_PROFILE={os.path.basename(path)}`, the README's "
         "command;", "# each file's quickest test is kept in the fast set. "
         "Regenerate: python tests/suite_profile.py PROFILE --slow-list"]
  for f in sorted(per):
    rs = sorted(per[f], key=lambda r: r["wall"])
    out += [f"{r['wall']:.1f} {r['nodeid']}" for r in rs[1:]
            if r["wall"] >= under]
  return "\n".join(out)


if __name__ == "__main__":
  if "--slow-list" in sys.argv:
    # 1 s: the fast set within 5 minutes on an AMD Zen 1 (553 tests took
    # 5m48s at 2 s there; the test machines compile a third faster since).
    under = [float(a.split("=", 1)[1]) for a in sys.argv
             if a.startswith("--under=")]
    print(slow_list(sys.argv[1], *under))
    sys.exit()
  print(table(sys.argv[1]))
  if os.environ.get("SHOW_SLOWEST"):
    rows = sorted((json.loads(line) for line in open(sys.argv[1])),
                  key=lambda r: -r["wall"])
    for r in rows[:int(os.environ["SHOW_SLOWEST"])]:
      print(f"{r['wall']:7.1f} {r['nodeid']}")
