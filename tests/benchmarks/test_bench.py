"""Smoke tests of the benchmark harness (bench/): it runs end to end and
reports what it promises. Nothing here asserts a speed."""

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

import pytest

from train_helpers import REPO  # noqa: E402
sys.path.insert(0, REPO)

from bench import ab, bench, flops, inprocess, machine, mlas_isa, worker, ynnpack_isa  # noqa: E402  pylint: disable=wrong-import-position
from vit_jax import models  # noqa: E402  pylint: disable=wrong-import-position

TINY = ["--model", "vit_ti_16", "--image-size", "32", "--batch", "2",
        "--rounds", "1", "--round-seconds", "0.05", "--warmup", "0",
        "--max-retries", "0", "--no-gemm"]
# The roofline measured, but small: a 256^3 GEMM and the tiny model's shapes.
TINY_GEMM = [a for a in TINY if a != "--no-gemm"] + [
    "--gemm-seconds", "0.05", "--gemm-square", "256"]

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


def test_analytic_flops():
  b16 = flops.vit_forward_flops(image_size=224, **vars(
      models.decode_variant("vit_b_16")))
  assert b16.tokens == 197
  # The usual "17.6 GFLOPs" of ViT-B/16 counts multiply-adds.
  assert 17.4e9 < b16.total / 2 < 17.7e9
  assert 0.03 < b16.attention_fraction < 0.05
  big = flops.vit_forward_flops(image_size=512, **vars(
      models.decode_variant("vit_b_16")))
  assert big.attention_fraction > 2 * b16.attention_fraction
  v = models.decode_variant("vit_ti_16")
  assert flops.step_flops(v, 224, "train") == 3 * flops.step_flops(v, 224,
                                                                   "infer")


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
  # This machine: whatever it is, it is named.
  here = machine.cpu_info()
  assert here["model_name"] and machine.describe(here).startswith("CPU: ")


def test_gemm_rates_and_roofline():
  pytest.importorskip("torch")
  shapes = [(128, 64, 96)] + machine.model_gemm_shapes("vit_ti_16", 2, 32)
  assert shapes[1:] == [(10, 192, 192), (10, 192, 768), (10, 768, 192)]
  g = machine.measure_gemms(shapes, seconds=0.02)
  kinds = {(r["framework"], r["dtype"]) for r in g["rates"]}
  assert kinds == set(machine.GEMM_KINDS)
  assert len(g["rates"]) == 4 * len(shapes)
  assert all(r["gflops"] > 0 for r in g["rates"])
  best = machine.roofline(g, "bfloat16")
  assert best["gflops"] == max(r["gflops"] for r in g["rates"]
                               if r["dtype"] == "bfloat16")
  table = machine.format_gemms(g, "float32")
  assert "torch bfloat16 (oneDNN)" in table and "roofline (float32)" in table
  assert machine.percent_of(best["gflops"] / 2, best) == "50%"
  assert machine.roofline(None, "float32") is None


@pytest.mark.parametrize("mode", ["infer", "train"])
def test_bench_jax_vs_torch_json(mode, capsys):
  pytest.importorskip("torch")
  rec = bench.main((TINY_GEMM if mode == "infer" else TINY) +
                   ["--mode", mode, "--json"])
  out = json.loads(capsys.readouterr().out)
  for key in ("jax_img_per_sec", "torch_img_per_sec", "ratio",
              "cpu_time_ratio", "gflop_per_image", "jax_compile_s"):
    assert key in out and out[key] is not None, key
  assert out["jax_img_per_sec"] > 0 and out["torch_img_per_sec"] > 0
  assert out["ratio"] > 0
  assert out["ratio"] == rec["ratio"]
  # Same weights and inputs on both sides.
  assert out["check_max_abs_diff"] < (1e-3 if mode == "infer" else 1e-4)
  first = out["details"]["rounds"][0]["jax"]
  assert first["iters"] >= 1
  # What explains a slow round is recorded with it: the hypervisor's steal,
  # page faults per step (the first turn touches fresh memory), preemptions.
  assert first["steal"] >= 0 and first["nivcsw_per_s"] >= 0
  assert first["faults_per_step"] >= 0
  assert isinstance(first["trimmed_before"], bool)
  assert first["release_wait_ms"] >= 0 and first["release_timeouts"] == 0
  table = bench.format_table(rec)
  assert "vs torch" in table and "img/s" in table
  # Every table names the CPU; with the GEMMs timed, the roofline column.
  assert table.startswith("CPU: ") and out["machine"]["model_name"]
  if mode == "infer":
    assert out["gemm_peak_gflops"] > 0 and out["jax_pct_of_gemm_peak"] > 0
    assert "% GEMM" in table and "roofline (float32)" in table
    # Only the workload's dtype is timed (a bf16 GEMM on a CPU without bf16
    # arithmetic takes up to a minute a call, and is no float32 workload's
    # roofline).
    assert {r["dtype"] for r in out["gemms"]["rates"]} == {"float32"}


def test_a_gemm_slower_than_its_budget_is_timed_once():
  calls = []

  def slow():
    calls.append(1)
    time.sleep(0.05)

  rate = machine._time_gemm(slow, 1e9, seconds=0.02)  # pylint: disable=protected-access
  assert len(calls) == 2  # the warm-up and one timed call, not 1 + 5
  assert 0 < rate <= 20.0  # 1 GFLOP in one call of at least 0.05 s


def test_bench_jax_only_with_options():
  rec = bench.main(TINY + ["--no-torch", "--mode", "train",
                           "--jax-opt", "scan_layers=true",
                           "--jax-opt", "remat_policy=dots"])
  jx = rec["details"]["contestants"]["jax"]
  assert jx["info"]["overrides"]["scan_layers"] == "True"
  assert jx["info"]["memory"]["peak"] > 0
  assert "torch_img_per_sec" not in rec


def test_ab_config_parsing():
  c = ab.parse_config("x:flags=--xla_cpu_use_onednn=true;opt.scan_layers=true;"
                      "donate=false;env.FOO=1")
  assert c.label == "x" and c.framework == "jax"
  assert c.xla_flags == "--xla_cpu_use_onednn=true"
  assert c.options["model_overrides"] == {"scan_layers": True}
  assert c.options["donate"] is False and c.env == {"FOO": "1"}
  with pytest.raises(ValueError, match="unknown key"):
    ab.parse_config("y:nonsense=1")


def test_ab_runs_two_configs_side_by_side(capsys):
  res = ab.main(["--model", "vit_ti_16", "--image-size", "32", "--batch", "2",
                 "--rounds", "1", "--round-seconds", "0.05",
                 "--max-retries", "0", "--gemm-seconds", "0.02",
                 "--gemm-square", "128", "--config", "a:",
                 "--config", "b:opt.scan_layers=true"])
  out = capsys.readouterr().out
  assert set(res["contestants"]) == {"a", "b"}
  assert out.startswith("CPU: ") and "% GEMM" in out and "vs a" in out
  # Only the workload's dtype is timed for the roofline.
  assert {r["dtype"] for r in res["gemms"]["rates"]} == {"float32"}


def test_ab_processes_repeats_each_config(capsys):
  """--processes 2: each config in two child processes, and a summary of
  each config's spread over them."""
  assert [c.label for c in ab.replicate(
      [ab.parse_config("a:"), ab.parse_config("b:opt.scan_layers=true")],
      2)] == ["a", "a/2", "b", "b/2"]
  with pytest.raises(ValueError, match="expected 1 or more"):
    ab.replicate([ab.parse_config("a:")], 0)
  res = ab.main(["--model", "vit_ti_16", "--image-size", "32", "--batch", "1",
                 "--rounds", "1", "--round-seconds", "0.05",
                 "--max-retries", "0", "--no-gemm", "--processes", "2",
                 "--config", "a:", "--config", "b:"])
  out = capsys.readouterr().out
  assert set(res["contestants"]) == {"a", "a/2", "b", "b/2"}
  # four child processes, not one answering under four labels
  assert len({c["info"]["pid"] for c in res["contestants"].values()}) == 4
  assert "per config over its 2 processes" in out
  assert re.search(r"^b +img/s .* vs a \d\.\d{3}x \[", out, re.M)


def test_machine_cli_names_the_cpu_the_isa_and_the_gemm_rates(capsys):
  """bench/machine.py alone: the CPU, the ISA line and the GEMM table."""
  res = machine.main(["--gemm-seconds", "0.02", "--gemm-square", "64",
                      "--isa", "native"])
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith("CPU: ") and out[1].startswith("ISA: native")
  assert any(r["framework"] == "jax" and r["gflops"] > 0
             for r in res["gemms"]["rates"])


def test_memory_and_compile_time_scripts_run():
  from bench import compile_time, memory  # pylint: disable=import-outside-toplevel
  m = memory.measure("vit_ti_16", 2, 32, "none")
  r = memory.measure("vit_ti_16", 2, 32, "full")
  assert m["peak"] > 0 and r["temp"] <= m["temp"]
  t = compile_time.measure("vit_ti_16", 1, True, 2, 32)
  assert t["total_s"] > 0


def test_bench_cli_help_runs_as_a_script():
  out = subprocess.run([sys.executable, "bench/bench.py", "--help"], cwd=REPO,
                       capture_output=True, text=True, check=True).stdout
  assert "--json" in out and "--mode" in out


def test_scaling_writes_table_png_and_json(tmp_path, monkeypatch, capsys):
  pytest.importorskip("matplotlib")
  from bench import scaling  # pylint: disable=import-outside-toplevel
  tiny = dict(name="vit_ti_16", image_size=32)
  monkeypatch.setattr(scaling, "SWEEPS", {
      "batch": [dict(tiny, batch=2)],
      "resolution": [dict(tiny, batch=1), dict(tiny, batch=1, image_size=48)],
      "model": [dict(tiny, batch=1)]})
  png, js = tmp_path / "s.png", tmp_path / "s.json"
  res = scaling.main(["--rounds", "1", "--round-seconds", "0.05", "--no-torch",
                      "--png", str(png), "--json-out", str(js),
                      "--gemm-seconds", "0.02", "--gemm-square", "128"])
  assert png.stat().st_size > 1000
  assert json.loads(js.read_text()).keys() == res.keys()
  r = res["resolution"]
  assert r[1]["tokens"] == 10 and r[1]["attention_fraction"] > r[0][
      "attention_fraction"]
  out = capsys.readouterr().out
  assert "jax ms/img if ~FLOPs" in out
  assert out.startswith("CPU: ") and "% GEMM" in out
  assert out.splitlines()[1].startswith("ISA: native")  # real or emulated
  assert res["machine"]["gemms"]["rates"]


@pytest.mark.slow
def test_families_bench_smoke():
  """bench/families.py: timm's EVA-02-T (RoPE, SwiGLU) against ours on the
  same weights, end to end (no speed asserted; the logits agree)."""
  from bench import families  # pylint: disable=import-outside-toplevel
  res = families.main([
      "--model", "eva02_tiny_patch14_224", "--image-size", "28", "--batch",
      "2", "--rounds", "1", "--round-seconds", "0.05", "--warmup", "0",
      "--max-retries", "0"])
  c = res["eva02_tiny_patch14_224"]["contestants"]
  assert c["jax"]["img_per_sec"]["median"] > 0
  assert c["timm"]["img_per_sec"]["median"] > 0
  assert c["jax"]["check_max_abs_diff"] < 1e-4
  table = families.format_table(res)
  assert "eva02_tiny_patch14_224" in table
  assert table.splitlines()[1].startswith("ISA: native")  # real or emulated


def test_same_graph_compares_lowered_programs(capsys):
  """bench/same_graph.py: a checkout against itself is the same program."""
  from bench import same_graph  # pylint: disable=import-outside-toplevel
  assert same_graph.main([REPO, REPO, "--model", "vit_ti_16", "--batch", "1",
                          "--image-size", "32", "--quick"]) == 0
  out = capsys.readouterr().out
  assert out.count("==") == 2 and "same program" in out


def test_isa_avx2_caps_both_frameworks_and_says_so():
  """--isa avx2 (in a child process: it sets the run's environment) caps
  JAX and torch at AVX2 and the table names what was real and emulated."""
  import subprocess  # pylint: disable=import-outside-toplevel
  p = subprocess.run(
      [sys.executable, os.path.join(REPO, "bench", "bench.py")] + TINY +
      ["--isa", "avx2", "--json"], cwd=REPO, capture_output=True, text=True,
      timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  rec = json.loads(p.stdout.strip().splitlines()[-1])
  has512 = machine.cpu_info()["isa"].get("AVX-512")
  assert rec["isa"] == "avx2"
  assert ("emulated on this AVX-512 CPU" in rec["isa_line"]) == bool(has512)
  # An emulated table says that the cores are still the AVX-512 CPU's.
  assert (machine.EMULATION_CAVEAT in rec["isa_line"]) == bool(has512)
  assert rec["isa_line"] in p.stderr  # the table printed with the result
  got = {c: v["info"]["isa_env"] for c, v in
         rec["details"]["contestants"].items()}
  assert "--xla_cpu_max_isa=AVX2" in got["jax"]["XLA_FLAGS"]
  assert got["torch"]["ATEN_CPU_CAPABILITY"] == "avx2"
  assert got["torch"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"
  # JAX's GEMM libraries ignore --xla_cpu_max_isa: oneDNN (under XLA's Eigen
  # dots) is capped by its variable, YNNPACK by bench/ynnpack_isa.py.
  assert got["jax"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"
  flags = rec["details"]["contestants"]["jax"]["info"]["ynnpack_flags"]
  assert flags["after"] == flags["before"] & ynnpack_isa.AVX2_FMA3_BITS
  assert bool(flags["before"] & ynnpack_isa.AVX512F_BIT) == bool(has512)
  assert not flags["after"] & ynnpack_isa.AVX512F_BIT
  assert rec["jax_img_per_sec"] > 0 and rec["torch_img_per_sec"] > 0


_YNN_PROBE = """
import sys, numpy as np, jax, jax.numpy as jnp
from bench import ynnpack_isa
rs = np.random.RandomState(0)
a = rs.standard_normal((256, 384)).astype(np.float32)
b = rs.standard_normal((384, 512)).astype(np.float32)
print(ynnpack_isa.apply_from_environment())
got = np.asarray(jax.jit(jnp.matmul)(a, b), np.float64)
want = a.astype(np.float64) @ b.astype(np.float64)
print(float(np.abs(got - want).max() / np.abs(want).max()))
"""


def test_ynnpack_cap_changes_its_kernels_not_its_results():
  """bench/ynnpack_isa.py: with $VIT_JAX_BENCH_YNNPACK_ISA=avx2 a child
  clears YNNPACK's AVX-512 flags before compiling, and its GEMMs still give
  the right numbers; any other value is refused."""
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  env[ynnpack_isa.ENV] = "avx2"
  p = subprocess.run([sys.executable, "-c", _YNN_PROBE], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  flags, err = p.stdout.strip().splitlines()[-2:]
  before, after = (int(v) for v in flags.strip("()").split(","))
  assert after == before & ynnpack_isa.AVX2_FMA3_BITS and after
  assert float(err) < 1e-5
  env[ynnpack_isa.ENV] = "avx512"
  p = subprocess.run([sys.executable, "-c", _YNN_PROBE], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode != 0 and "expected 'avx2' or unset" in p.stderr


_MLAS_PROBE = """
import sys, numpy as np
from bench import mlas_isa
print(mlas_isa.apply_from_environment())
import onnx, onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
rs = np.random.RandomState(0)
a = rs.standard_normal((64, 96)).astype(np.float32)
b = rs.standard_normal((96, 80)).astype(np.float32)
g = helper.make_graph(
    [helper.make_node("MatMul", ["a", "b"], ["c"])], "g",
    [helper.make_tensor_value_info("a", TensorProto.FLOAT, [64, 96])],
    [helper.make_tensor_value_info("c", TensorProto.FLOAT, [64, 80])],
    initializer=[numpy_helper.from_array(b, "b")])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
m.ir_version = 8
s = ort.InferenceSession(m.SerializeToString(),
                         providers=["CPUExecutionProvider"])
got = s.run(None, {"a": a})[0].astype(np.float64)
want = a.astype(np.float64) @ b.astype(np.float64)
print(ort.__file__)
print(float(np.abs(got - want).max() / np.abs(want).max()))
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 code")
def test_mlas_cap_patches_a_copy_and_keeps_its_results(tmp_path):
  """bench/mlas_isa.py: the AVX-512 gate of onnxruntime's MLAS and its
  CPUIDInfo checks are found exactly where expected and switched off in a
  copy of the package (the installed one untouched); a child with
  $VIT_JAX_BENCH_MLAS_ISA=avx2 imports the copy and multiplies right; code
  it does not know is refused, any other value too."""
  ext = mlas_isa._extension(mlas_isa._installed_package())  # pylint: disable=protected-access
  with open(ext, "rb") as f:
    original = f.read()
  data = bytearray(original)
  changes = mlas_isa.patch(data)
  assert changes[0].startswith("MLAS AVX-512F gate") and len(changes) == 3
  diff = [i for i, (x, y) in enumerate(zip(original, data)) if x != y]
  # one byte each: 0x00010000 -> 0, then 0xE6 -> 0xE7
  assert len(diff) == len(changes) and original[diff[0]] == 0x01
  assert all(original[i] == 0xE6 and data[i] == 0xE7 for i in diff[1:])
  broken = bytearray(original)
  broken[diff[0]] = 0x02  # test reg, 0x20000: not the gate any more
  with pytest.raises(ValueError, match="AVX-512F gate .* found 0 times"):
    mlas_isa.patch(broken)

  assert machine.EMULATE_AVX2[mlas_isa.ENV] == "avx2"  # --isa avx2 sets it
  env = dict(os.environ, PYTHONPATH=REPO, XDG_CACHE_HOME=str(tmp_path))
  env[mlas_isa.ENV] = "avx2"
  made = None
  for _ in range(2):  # made, then reused
    p = subprocess.run([sys.executable, "-c", _MLAS_PROBE], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    root, where, err = p.stdout.strip().splitlines()[-3:]
    assert root.startswith(str(tmp_path / "vit_jax_bench" / "mlas_avx2"))
    assert where.startswith(root) and float(err) < 1e-5
    stamp = os.stat(os.path.join(root, "PATCHED.txt")).st_mtime_ns
    assert made in (None, stamp)  # the second child reused the copy
    made = stamp
    assert os.listdir(os.path.dirname(root)) == [os.path.basename(root)]
    with open(os.path.join(root, "PATCHED.txt"), encoding="utf-8") as f:
      assert f.read().splitlines()[1:] == changes
  with open(ext, "rb") as f:
    assert f.read() == original
  env[mlas_isa.ENV] = "avx512"
  p = subprocess.run([sys.executable, "-c", _MLAS_PROBE], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=300)
  assert p.returncode != 0 and "expected 'avx2' or unset" in p.stderr


def test_ab_src_runs_the_other_checkout(tmp_path, capsys):
  """ab.py's src=PATH: the JAX worker imports vit_jax from PATH."""
  other = tmp_path / "checkout"
  shutil.copytree(os.path.join(REPO, "vit_jax"), other / "vit_jax",
                  ignore=shutil.ignore_patterns("__pycache__"))
  res = ab.main(["--model", "vit_ti_16", "--image-size", "32", "--batch", "1",
                 "--rounds", "1", "--round-seconds", "0.05",
                 "--max-retries", "0", "--gemm-seconds", "0.02",
                 "--gemm-square", "128", "--config", "here:",
                 "--config", f"there:src={other}"])
  capsys.readouterr()
  got = {c: v["info"]["vit_jax"] for c, v in res["contestants"].items()}
  assert got["here"] == os.path.join(REPO, "vit_jax")
  assert got["there"] == str(other / "vit_jax")


def test_naflex_bench_smoke(capsys):
  """bench/naflex.py: a NaFlex batch against a square one of the same token
  count, the CPU named, one compilation per sequence length drawn."""
  from bench import naflex as naflex_bench  # pylint: disable=import-outside-toplevel
  assert naflex_bench.main([
      "--mode", "infer", "--mode", "train", "--width", "64", "--depth", "1",
      "--heads", "2", "--image-size", "64", "--batch", "3", "--rounds", "1",
      "--steps", "1", "--seq-lens", "8,16", "--run-steps", "4"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("CPU: ")
  for mode in ("infer", "train"):
    for row in ("square", "naflex_square", "naflex"):
      assert re.search(rf"^{mode} +{row} ", out, re.M), (mode, row, out)
  m = re.search(r"\(drew \[([\d, ]+)\]\): (\d+) compilations", out)
  assert m and int(m.group(2)) == len(m.group(1).split(",")), out


def test_ops_profile_groups_both_frameworks(capsys):
  """bench/ops.py: the step of each framework profiled op by op and
  grouped; every group the step must have is found in both (a grouping
  that lost the GEMMs or the optimizer to 'other' would show here)."""
  from bench import ops  # pylint: disable=import-outside-toplevel
  res = ops.main(["--model", "vit_ti_16", "--batch", "2", "--image-size",
                  "32", "--steps", "1", "--warmup", "1", "--top", "3"])
  out = capsys.readouterr().out
  assert out.startswith("CPU: ") and "ISA: " in out
  for fw in ("jax", "torch"):
    g = res[fw]["groups"]
    for name in ("dense GEMMs", "attention matmuls", "LayerNorm",
                 "optimizer"):
      assert g.get(name, 0) > 0, (fw, name, g)
    assert set(g) <= set(ops.GROUPS)
  # The groups account for the step: their sum is within a factor of the
  # step's wall time (the thunks run on the step's threads).
  j = res["jax"]
  assert 0.3 < sum(j["groups"].values()) / j["wall_ms"] < 3


@pytest.mark.slow
def test_ops_ablation_replaces_each_group_in_both_frameworks(capsys):
  """bench/ops.py --ablate: every group's stand-in takes effect in both
  frameworks (the first step's loss changes with it: a stand-in that
  replaced nothing would leave it), and each group's cost is the full step
  minus the step without it, paired within a round."""
  from bench import ops  # pylint: disable=import-outside-toplevel
  res = ops.main(["--model", "vit_ti_16", "--batch", "2", "--image-size",
                  "32", "--steps", "1", "--warmup", "0", "--ablate",
                  "--rounds", "1"])
  out = capsys.readouterr().out
  assert out.startswith("CPU: ") and "ISA: " in out
  for fw in ("jax", "torch"):
    first, walls, costs = res["first"][fw], res["walls"][fw], res["costs"][fw]
    for v in list(ops.ABLATIONS) + ["all"]:
      assert first[v] != first[""], (fw, v, first)
    for g in ops.ABLATIONS:
      assert costs[g][0] == pytest.approx(walls[""][0] - walls[g][0])
    assert costs["the rest"][0] == walls["all"][0] > 0
  for row in list(ops.ABLATIONS) + ["the rest", "step"]:
    assert re.search(rf"^{re.escape(row)} ", out, re.M), (row, out)


def test_release_wait_waits_until_the_block_is_freed():
  """bench/worker.py's JAX step waits until XLA has freed the step's
  temporaries (freed on another thread, after the result is ready) before
  the next step; here a 64 MiB block freed by a timer thread."""
  import ctypes  # pylint: disable=import-outside-toplevel
  import threading  # pylint: disable=import-outside-toplevel
  libc = ctypes.CDLL("libc.so.6")
  libc.malloc.restype = ctypes.c_void_p
  libc.free.argtypes = [ctypes.c_void_p]
  size = 64 * 2 ** 20
  wait = worker.ReleaseWait(size, timeout_s=2.0)
  wait.settle()
  assert wait.limit is not None
  assert wait.in_use() <= wait.limit  # nothing to wait for
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
  # Small temporaries: nothing to wait for.
  small = worker.ReleaseWait(2 ** 20)
  small.settle()
  assert small.limit is None


def test_inprocess_ab_steps_every_config_in_one_process(capsys):
  """bench/inprocess.py: one child compiles each configuration (a compile
  option, a model option) and steps them in rotation; the table and the
  record give each one's median step time and its ratio to the first."""
  res = inprocess.main([
      "--model", "vit_ti_16", "--batch", "2", "--image-size", "32",
      "--steps", "3", "--warmup", "1", "--config", "base:",
      "--config", "memopt:flags=--xla_cpu_scheduler_type="
      "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
      "--config", "scan:opt.scan_layers=true"])
  table = capsys.readouterr().out
  assert table.startswith("CPU: ") and "one process" in table
  summ = res["summary"]
  assert list(summ) == ["base", "memopt", "scan"]
  assert summ["base"]["time_ratio"] == 1.0
  for c in summ.values():
    assert c["steps"] == 3 and 0 <= c["faulted"] <= 3
  # The same weights and batch in every configuration: the same first loss.
  checks = [res["info"][k]["check"] for k in summ]
  assert max(checks) - min(checks) < 1e-4, checks
  assert all(res["info"][k]["memory"]["temp"] > 0 for k in summ)


def test_inprocess_ab_options_and_what_it_refuses():
  assert inprocess.compile_options(
      "--xla_a=true --xla_b=3 --xla_c=NAME --xla_d=False") == {
          "xla_a": True, "xla_b": 3, "xla_c": "NAME", "xla_d": False}
  with pytest.raises(ValueError, match="expected --xla_name=value"):
    inprocess.compile_options("xla_a")
  with pytest.raises(ValueError, match="need a process of their own"):
    inprocess.parse_config("old:src=/tmp")
  with pytest.raises(ValueError, match="need a process of their own"):
    inprocess.parse_config("x:env.FOO=1")
  c = inprocess.parse_config("s:opt.scan_layers=true;donate=false")
  assert c == {"label": "s", "compiler_options": {},
               "model_overrides": {"scan_layers": True}, "donate": False}


def test_each_child_runs_as_its_users_run_it(monkeypatch):
  """The JAX child gets train.py's malloc settings; torch (or any other
  runtime) glibc's defaults: under the JAX settings torch's own bfloat16
  train step ran at 0.66x its speed, which flattered every ratio."""
  from bench import harness  # pylint: disable=import-outside-toplevel
  from vit_jax.train import host_memory  # pylint: disable=import-outside-toplevel
  for k in list(host_memory.MALLOC_ENV) + [host_memory.SWITCH]:
    monkeypatch.delenv(k, raising=False)
  envs = {}

  class Popen:  # records the environment instead of starting a child
    def __init__(self, argv, env=None, **kw):
      envs[argv[3]] = env
  monkeypatch.setattr(harness.subprocess, "Popen", Popen)
  for fw in ("jax", "stablehlo", "torch", "onnxruntime"):
    harness.Worker(harness.Contestant(fw, fw), {})
  if host_memory.wanted(os.environ):  # Linux with glibc
    for fw in ("jax", "stablehlo"):  # jax.jit and jax.export
      assert all(envs[fw].get(k) == v
                 for k, v in host_memory.MALLOC_ENV.items()), fw
  for fw in ("torch", "onnxruntime"):
    assert not set(host_memory.MALLOC_ENV) & set(envs[fw]), fw
