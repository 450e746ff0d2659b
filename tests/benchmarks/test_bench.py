"""Smoke tests of bench/: every tool runs end to end at the smallest size
that still checks its output, and reports what it promises. Nothing here
asserts a speed."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from train_helpers import REPO  # noqa: E402
from test_layout import _cycles  # noqa: E402
sys.path.insert(0, REPO)

from bench import ab, bench, harness, machine, ops, worker  # noqa: E402  pylint: disable=wrong-import-position
from vit_jax import models  # noqa: E402  pylint: disable=wrong-import-position

RUN = ["--rounds", "1", "--round-seconds", "0.05", "--warmup", "0",
       "--max-retries", "0"]
# Two blocks: what every tool does is checked as well as with twelve.
BASE = ["--model", "vit_ti_16", "--image-size", "32", "--batch", "2",
        "--layers", "2"] + RUN
TINY = BASE + ["--no-gemm"]
# The roofline measured, but small: a 128^3 GEMM and the tiny model's shapes.
SMALL_GEMM = ["--gemm-seconds", "0.02", "--gemm-square", "128"]

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse sse2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni

processor\t: 1
vendor_id\t: AuthenticAMD
"""
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8
"""


def test_no_import_cycle_outside_tests():
  """The import graph of every module outside tests/ (bench/, vit_jax/,
  configs/, the scripts; function-level imports included) has no cycle."""
  mods = {}
  for root, dirs, files in os.walk(REPO):
    dirs[:] = [d for d in dirs if not d.startswith((".", "__")) and
               os.path.join(root, d) != os.path.join(REPO, "tests")]
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(root, f), REPO)[:-3]
        name = rel.replace(os.sep, ".").removesuffix(".__init__")
        mods[name] = os.path.join(root, f)
  longest = lambda n: n if n in mods or not n else longest(  # noqa: E731
      n.rpartition(".")[0])
  graph = {}
  for name, path in mods.items():  # edges as tests/test_layout.py reads them
    pkg = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
      if isinstance(node, ast.Import):
        found |= {longest(a.name) for a in node.names}
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
          base = ".".join(parts + ([base] if base else []))
        found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else
                  longest(base) for a in node.names}
    graph[name] = found - {name, ""}
  assert {"bench.harness", "bench.worker", "vit_jax.models"} <= set(graph)
  assert _cycles(graph) == []


def test_analytic_flops():
  b16 = machine.vit_forward_flops(image_size=224, **vars(
      models.decode_variant("vit_b_16")))
  assert b16.tokens == 197
  # The usual "17.6 GFLOPs" of ViT-B/16 counts multiply-adds.
  assert 17.4e9 < b16.total / 2 < 17.7e9
  assert 0.03 < b16.attention_fraction < 0.05
  big = machine.vit_forward_flops(image_size=512, **vars(
      models.decode_variant("vit_b_16")))
  assert big.attention_fraction > 2 * b16.attention_fraction
  v = models.decode_variant("vit_ti_16")
  assert machine.step_flops(v, 224, "train") == 3 * machine.step_flops(
      v, 224, "infer")


def test_cpuinfo_names_the_cpu_and_its_isa():
  zen4 = machine.parse_cpuinfo(ZEN4)
  assert (zen4["vendor"], zen4["family"], zen4["model"]) == (
      "AuthenticAMD", 25, 17)
  assert zen4["uarch"] == "Zen 4"
  assert zen4["isa"]["AVX-512"] and zen4["isa"]["AVX512-BF16"]
  assert not zen4["isa"]["AMX-BF16"]
  line = machine.describe(zen4)
  assert ("AMD EPYC 9R14" in line and "family 25, model 17: Zen 4" in line
          and "AVX512-BF16 yes" in line and "AMX no" in line)
  spr = machine.parse_cpuinfo(SAPPHIRE_RAPIDS)
  assert spr["uarch"] == "Sapphire Rapids" and spr["isa"]["AMX-BF16"]
  assert "AMX yes" in machine.describe(spr)
  here = machine.cpu_info()  # this machine, whatever it is, is named
  assert here["model_name"] and machine.describe(here).startswith("CPU: ")


def _isa_env(monkeypatch):
  """Lets machine.set_isa write the environment; restored afterwards."""
  for k in machine.EMULATE_AVX2:
    monkeypatch.setenv(k, "")


def test_isa_avx2_uses_documented_switches_and_says_emulated(monkeypatch):
  """--isa avx2 sets only the switches the packages document, and the line
  every table prints says what was real, what emulated, what not capped."""
  _isa_env(monkeypatch)
  assert machine.set_isa("native", machine.parse_cpuinfo(ZEN4)) == (
      "ISA: native (AVX-512, real)")
  line = machine.set_isa("avx2", machine.parse_cpuinfo(ZEN4))
  assert line.startswith("ISA: AVX2 emulated on this AVX-512 CPU")
  assert "documented switches only" in line and machine.NOT_CAPPED in line
  assert "XLA_FLAGS=--xla_cpu_max_isa=AVX2" in line
  assert "ATEN_CPU_CAPABILITY=avx2" in line and machine.EMULATION_CAVEAT in line
  assert os.environ["XLA_FLAGS"] == "--xla_cpu_max_isa=AVX2"
  assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
  no512 = machine.parse_cpuinfo(ZEN4.replace("avx512", "x"))
  assert machine.set_isa("avx2", no512) == (
      "ISA: AVX2 (real: this CPU has no AVX-512)")
  with pytest.raises(ValueError, match="expected one of"):
    machine.set_isa("avx512")


def test_a_gemm_slower_than_its_budget_is_timed_once():
  calls = []

  def slow():
    calls.append(1)
    time.sleep(0.05)

  rate = machine._time_gemm(slow, 1e9, seconds=0.02)  # pylint: disable=protected-access
  assert len(calls) == 2  # the warm-up and one timed call, not 1 + 5
  assert 0 < rate <= 20.0  # 1 GFLOP in one call of at least 0.05 s


def test_machine_cli_names_the_cpu_and_times_every_gemm(capsys):
  """bench/machine.py: the CPU, the ISA line, and the GEMM rates of both
  frameworks in both dtypes, on a square GEMM and the model's shapes."""
  pytest.importorskip("torch")
  assert machine.model_gemm_shapes("vit_ti_16", 2, 32) == [
      (10, 192, 192), (10, 192, 768), (10, 768, 192)]
  res = machine.main(["--model", "vit_ti_16", "--batch", "2", "--image-size",
                      "32", "--gemm-seconds", "0.01", "--gemm-square", "64"])
  out = capsys.readouterr().out
  assert out.startswith("CPU: ") and out.splitlines()[1].startswith("ISA: ")
  g = res["gemms"]
  assert {(r["framework"], r["dtype"]) for r in g["rates"]} == set(
      machine.GEMM_KINDS)
  assert len(g["rates"]) == 4 * 4 and all(r["gflops"] > 0 for r in g["rates"])
  best = machine.roofline(g, "bfloat16")
  assert best["gflops"] == max(r["gflops"] for r in g["rates"]
                               if r["dtype"] == "bfloat16")
  assert "torch bfloat16 (oneDNN)" in out
  assert "roofline (float32)" in machine.format_gemms(g, "float32")
  assert machine.percent_of(best["gflops"] / 2, best) == "50%"
  assert machine.roofline(None, "float32") is None


def test_bench_infer_against_torch_with_the_roofline(capsys):
  pytest.importorskip("torch")
  rec = bench.main(BASE + SMALL_GEMM + ["--json"])
  out = json.loads(capsys.readouterr().out)
  for key in ("jax_img_per_sec", "torch_img_per_sec", "ratio",
              "cpu_time_ratio", "gflop_per_image", "jax_compile_s",
              "gemm_peak_gflops", "jax_pct_of_gemm_peak"):
    assert key in out and out[key] is not None and out[key] > 0, key
  assert out["ratio"] == rec["ratio"] and out["tokens"] == 5
  assert out["check_max_abs_diff"] < 1e-3  # the same weights and inputs
  first = out["details"]["rounds"][0]["jax"]
  # What explains a slow round is recorded with it.
  assert first["iters"] >= 1 and first["steal"] >= 0
  assert first["faults_per_step"] >= 0 and first["nivcsw_per_s"] >= 0
  assert isinstance(first["trimmed_before"], bool)
  assert first["release_wait_ms"] >= 0 and first["release_timeouts"] == 0
  table = bench.format_table(rec)
  assert table.startswith("CPU: ") and "vs jax" in table
  assert "% GEMM" in table and "roofline (float32)" in table
  # Only the workload's dtype is timed for the roofline.
  assert {r["dtype"] for r in out["gemms"]["rates"]} == {"float32"}


def test_bench_train_emulated_avx2_with_model_options(monkeypatch):
  """A train step with JAX model options, --isa avx2: both children run
  under the documented switches, and the record says it was emulated."""
  pytest.importorskip("torch")
  _isa_env(monkeypatch)
  rec = bench.main(TINY + ["--mode", "train", "--isa", "avx2",
                           "--jax-opt", "scan_layers=true",
                           "--jax-opt", "remat_policy=dots"])
  assert rec["isa"] == "avx2" and rec["isa_line"].startswith("ISA: AVX2")
  c = rec["details"]["contestants"]
  assert c["jax"]["info"]["overrides"]["scan_layers"] == "True"
  assert c["jax"]["info"]["memory"]["peak"] > 0
  assert "--xla_cpu_max_isa=AVX2" in c["jax"]["info"]["isa_env"]["XLA_FLAGS"]
  assert c["torch"]["info"]["isa_env"]["ATEN_CPU_CAPABILITY"] == "avx2"
  assert rec["check_max_abs_diff"] < 1e-4  # first-step losses
  assert rec["jax_img_per_sec"] > 0 and rec["torch_img_per_sec"] > 0


def test_bench_family_against_timm_and_a_sweep(capsys):
  """A timm family (EVA-02: RoPE, SwiGLU) against timm's own model, and a
  classic ViT against torchvision's, in one run of two points: each point's
  table, then the sweep's."""
  pytest.importorskip("timm")
  recs = bench.main(["--model", "vit_ti_16", "eva02_tiny_patch14_224",
                     "--image-size", "112", "--batch", "1", "--layers", "2",
                     "--no-gemm"] + RUN)
  ti, eva = recs
  assert "torch_img_per_sec" in ti and "timm_img_per_sec" in eva
  assert ti["tokens"] == 50 and eva["tokens"] is None
  for r in recs:
    assert r["jax_img_per_sec"] > 0 and r["ratio"] > 0
    assert r["check_max_abs_diff"] < 1e-3, r["model"]
  out = capsys.readouterr().out
  sweep = out[out.rindex("model "):]
  assert re.search(r"^vit_ti_16 +1 +112 +50 ", sweep, re.M)
  assert re.search(r"^eva02_tiny_patch14_224 +1 +112 +- ", sweep, re.M)


@pytest.mark.slow
def test_bench_exported_runtimes(capfd):
  """--peer stablehlo / savedmodel / onnxruntime: our model exported and
  run by each runtime against jax.jit on the same weights, the runtime
  children without TensorFlow's load-time INFO lines."""
  rec = bench.main(TINY + ["--peer", "stablehlo", "--peer", "savedmodel",
                           "--peer", "onnxruntime"])
  c = rec["details"]["contestants"]
  assert list(c) == ["jax", "stablehlo", "savedmodel", "onnxruntime"]
  for lab in ("stablehlo", "savedmodel", "onnxruntime"):
    assert c[lab]["img_per_sec"]["median"] > 0 and c[lab]["info"]["export_s"]
    assert c[lab]["check_max_abs_diff"] < 1e-4, lab
    assert rec[f"ratio_vs_{lab}" if lab != "stablehlo" else "ratio"] > 0
  assert c["stablehlo"]["check_max_abs_diff"] == 0  # the same XLA program
  with pytest.raises(SystemExit, match="inference, float32"):
    bench.main(TINY + ["--mode", "train", "--peer", "onnxruntime"])
  from vit_jax.data import console  # pylint: disable=import-outside-toplevel
  err = capfd.readouterr().err.encode()
  noise = [line for line in err.splitlines() if console.is_noise(line)]
  assert not noise, noise[:3]


def test_bench_and_ab_run_as_scripts():
  for script in ("bench.py", "ab.py", "ops.py", "machine.py"):
    p = subprocess.run([sys.executable, f"bench/{script}", "--help"],
                       cwd=REPO, capture_output=True, text=True, check=True)
    assert p.stdout.startswith("usage: ") and p.stderr == "", script


def test_ab_config_parsing_and_what_in_process_refuses():
  c = ab.parse_config("x:flags=--xla_cpu_use_onednn=true;opt.scan_layers=true;"
                      "donate=false;env.FOO=1;input=naflex")
  assert c.label == "x" and c.framework == "jax"
  assert c.xla_flags == "--xla_cpu_use_onednn=true"
  assert c.options["model_overrides"] == {"scan_layers": True}
  assert c.options["donate"] is False and c.env == {"FOO": "1"}
  assert c.options["input"] == "naflex"
  for bad in ("y:nonsense=1", "y:input=round"):
    with pytest.raises(ValueError, match="unknown key"):
      ab.parse_config(bad)
  assert ab.compile_options(
      "--xla_a=true --xla_b=3 --xla_c=NAME --xla_d=False") == {
          "xla_a": True, "xla_b": 3, "xla_c": "NAME", "xla_d": False}
  with pytest.raises(ValueError, match="expected --xla_name=value"):
    ab.compile_options("xla_a")
  for bad in ("old:src=/tmp", "x:env.FOO=1"):
    with pytest.raises(ValueError, match="need a process of their own"):
      ab.inprocess_config(ab.parse_config(bad), {})
  assert ab.inprocess_config(ab.parse_config("s:opt.scan_layers=true;"
                                             "donate=false"), {"a": 1}) == {
      "label": "s", "compiler_options": {}, "input": "square",
      "model_overrides": {"a": 1, "scan_layers": True}, "donate": False}
  assert [c.label for c in ab.replicate(
      [ab.parse_config("a:"), ab.parse_config("b:")], 2)] == [
          "a", "a/2", "b", "b/2"]
  with pytest.raises(ValueError, match="expected 1 or more"):
    ab.replicate([ab.parse_config("a:")], 0)


def test_ab_processes_and_another_checkout(tmp_path, capsys):
  """Two configs in two processes each, one from another checkout (src=):
  four children, each config's spread over its processes, the roofline."""
  other = tmp_path / "checkout"
  shutil.copytree(os.path.join(REPO, "vit_jax"), other / "vit_jax",
                  ignore=shutil.ignore_patterns("__pycache__"))
  res = ab.main(["--model", "vit_ti_16", "--image-size", "32", "--batch", "1",
                 "--processes", "2", "--jax-opt", "num_layers=2",
                 "--config", "here:",
                 "--config", f"there:src={other};opt.scan_layers=true"]
                + RUN + SMALL_GEMM)
  out = capsys.readouterr().out
  c = res["contestants"]
  assert set(c) == {"here", "here/2", "there", "there/2"}
  assert len({v["info"]["pid"] for v in c.values()}) == 4
  assert c["here/2"]["info"]["vit_jax"] == os.path.join(REPO, "vit_jax")
  assert c["there"]["info"]["vit_jax"] == str(other / "vit_jax")
  assert out.startswith("CPU: ") and "% GEMM" in out and "vs here" in out
  assert "per config over its 2 processes" in out
  assert re.search(r"^there +img/s .* vs here \d\.\d{3}x \[", out, re.M)
  assert re.search(r"^there/2 +\d+\.\d\d .* \d\.\d{3}x \[", out, re.M)
  assert {r["dtype"] for r in res["gemms"]["rates"]} == {"float32"}


def test_ab_in_process_steps_every_config_in_rotation(capsys):
  """--in-process: one child compiles each configuration (here a compile
  option with a model option) and steps them in rotation; compile time,
  memory, median step time and the ratio to the first."""
  res = ab.main(["--model", "vit_ti_16", "--batch", "2", "--image-size", "32",
                 "--mode", "train", "--in-process", "--steps", "3",
                 "--warmup", "1", "--jax-opt", "num_layers=2",
                 "--config", "base:", "--config", "memopt:flags=--xla_cpu_"
                 "scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED;"
                 "opt.remat_policy=full"])
  table = capsys.readouterr().out
  assert table.startswith("CPU: ") and "one process" in table
  summ, info = res["summary"], res["info"]
  assert list(summ) == ["base", "memopt"]
  assert summ["base"]["time_ratio"] == 1.0 and summ["memopt"]["time_ratio"]
  for k, c in summ.items():
    assert c["steps"] == 3 and 0 <= c["faulted"] <= 3
    assert info[k]["lower_s"] > 0 and info[k]["compile_s"] > 0
    assert info[k]["memory"]["peak"] >= info[k]["memory"]["temp"] > 0
  # The same weights and batch in every configuration: the same first loss.
  assert abs(info["base"]["check"] - info["memopt"]["check"]) < 1e-4
  assert re.search(r"^memopt +\d+\.\d\d +\d+\.\d\d +\d+ +\d+ +\d+\.\d ", table,
                   re.M), table


def test_ab_in_process_compiles_naflex_inputs_only(capsys):
  """--steps 0: compile time and memory, nothing run; a NaFlex model's three
  input forms of one token count (input=)."""
  res = ab.main(["--model", "vit_ti_16", "--batch", "3", "--image-size", "32",
                 "--in-process", "--steps", "0",
                 "--jax-opt", "num_layers=1", "--jax-opt", "naflex=bilinear_aa",
                 "--jax-opt", "naflex_grid=[2,2]", "--jax-opt",
                 "classifier=map", "--config", "square:input=square",
                 "--config", "dict:input=naflex_square",
                 "--config", "naflex:input=naflex"])
  out = capsys.readouterr().out
  assert "summary" not in res and "ms/step" not in out
  for k in ("square", "dict", "naflex"):
    assert res["info"][k]["memory"]["peak"] > 0 and res["info"][k]["lower_s"]
    assert re.search(rf"^{k} +\d+\.\d\d +\d+\.\d\d ", out, re.M)
  nf = worker.naflex_inputs(dict(seed=0, batch=8, image_size=32), "naflex", 8)
  assert nf["patches"].shape == (8, 16, 192)  # padded to (32 / 8)^2 tokens
  assert 0 < nf["patch_valid"].sum(1).min() < 16 == nf["patch_valid"].sum(
      1).max()


def test_ab_same_graph_compares_lowered_programs(capsys):
  """--same-graph: a checkout against itself is the same program, another
  model option another program."""
  got = ab.main(["--model", "vit_ti_16", "--batch", "1", "--image-size", "32",
                 "--mode", "train", "--jax-opt", "num_layers=1",
                 "--same-graph", "--config", f"a:src={REPO}",
                 "--config", "b:", "--config", "c:opt.scan_layers=true"])
  out = capsys.readouterr().out
  assert got["a"] == got["b"] != got["c"] and len(got["a"]) == 16
  assert re.search(rf"^  a +{got['a']}$", out, re.M)
  assert out.rstrip().endswith("DIFFERENT programs")


def test_ops_profile_groups_both_frameworks(capsys):
  """bench/ops.py: each framework's step profiled op by op and grouped;
  every group the step must have is found in both."""
  res = ops.main(["--model", "vit_ti_16", "--batch", "2", "--image-size",
                  "32", "--layers", "2", "--steps", "1", "--warmup", "1",
                  "--top", "3"])
  out = capsys.readouterr().out
  assert out.startswith("CPU: ") and "ISA: " in out
  for fw in ("jax", "torch"):
    g = res[fw]["groups"]
    for name in ("dense GEMMs", "attention matmuls", "LayerNorm",
                 "optimizer"):
      assert g.get(name, 0) > 0, (fw, name, g)
    assert set(g) <= set(ops.GROUPS)
  # The groups account for the step (the thunks run on its threads).
  j = res["jax"]
  assert 0.3 < sum(j["groups"].values()) / j["wall_ms"] < 3


def test_ops_ablation_replaces_each_group_in_both_frameworks(capsys):
  """--ablate: every group's stand-in takes effect in both frameworks (the
  first step's loss changes with it), and each group's cost is the full
  step minus the step without it, paired within a round."""
  res = ops.main(["--model", "vit_ti_16", "--batch", "2", "--image-size",
                  "32", "--layers", "2", "--steps", "1", "--warmup", "0",
                  "--ablate", "--rounds", "2"])
  out = capsys.readouterr().out
  assert out.startswith("CPU: ") and "ISA: " in out
  for fw in ("jax", "torch"):
    first, walls, costs = res["first"][fw], res["walls"][fw], res["costs"][fw]
    for v in list(ops.ABLATIONS) + ["all"]:
      assert first[v] != first[""], (fw, v, first)
    for g in ops.ABLATIONS:
      assert len(walls[g]) == 2
      assert costs[g][1] == pytest.approx(
          min(a - b for a, b in zip(walls[""], walls[g])))
    assert costs["the rest"][1] == min(walls["all"]) > 0
  for row in list(ops.ABLATIONS) + ["the rest", "step"]:
    assert re.search(rf"^{re.escape(row)} ", out, re.M), (row, out)


def test_release_wait_waits_until_the_block_is_freed():
  """The JAX step waits until XLA has freed the step's temporaries (freed
  on another thread, after the result is ready) before the next step; here
  a 64 MiB block freed by a timer thread."""
  import ctypes  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  libc = ctypes.CDLL("libc.so.6")
  libc.malloc.restype = ctypes.c_void_p
  libc.free.argtypes = [ctypes.c_void_p]
  size = 64 * 2 ** 20
  wait = worker.ReleaseWait(size, timeout_s=2.0)
  wait.settle()
  assert wait.limit is not None and wait.in_use() <= wait.limit
  wait()
  assert wait.timeouts == 0
  block = libc.malloc(size)
  ctypes.memset(block, 1, size)
  threading.Timer(0.2, libc.free, (block,)).start()
  t0 = time.perf_counter()
  wait()
  assert time.perf_counter() - t0 >= 0.15 and wait.timeouts == 0
  # A block that stays: the wait gives up after timeout_s and counts it.
  short = worker.ReleaseWait(size, timeout_s=0.05)
  short.settle()
  block = libc.malloc(size)
  ctypes.memset(block, 1, size)
  short()
  libc.free(block)
  assert short.timeouts == 1
  small = worker.ReleaseWait(2 ** 20)  # small temporaries: nothing to wait
  small.settle()
  assert small.limit is None


def test_each_child_runs_as_its_users_run_it(monkeypatch):
  """The JAX children get train.py's malloc settings; torch (or any other
  runtime) glibc's defaults: under the JAX settings torch's own bfloat16
  train step ran at 0.66x its speed, which flattered every ratio."""
  from vit_jax.train import host_memory  # pylint: disable=import-outside-toplevel
  for k in list(host_memory.MALLOC_ENV) + [host_memory.SWITCH, "XLA_FLAGS"]:
    monkeypatch.delenv(k, raising=False)
  envs = {fw: harness.child_env(fw, {"A": "1"}, "--xla_x=1")
          for fw in ("jax", "stablehlo", "torch", "onnxruntime")}
  if host_memory.wanted(os.environ):  # Linux with glibc
    for fw in ("jax", "stablehlo"):  # jax.jit and jax.export
      assert all(envs[fw].get(k) == v
                 for k, v in host_memory.MALLOC_ENV.items()), fw
  for fw in ("torch", "onnxruntime"):
    assert not set(host_memory.MALLOC_ENV) & set(envs[fw]), fw
    assert "XLA_FLAGS" not in envs[fw]
  assert envs["jax"]["XLA_FLAGS"] == "--xla_x=1" and envs["torch"]["A"] == "1"
  assert envs["jax"]["PYTHONPATH"].split(os.pathsep)[0] == REPO
