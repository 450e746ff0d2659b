"""Smoke tests of the benchmark harness (bench/): it runs end to end and
reports what it promises. Nothing here asserts a speed."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench import ab, bench, flops  # noqa: E402  pylint: disable=wrong-import-position
from vit_jax import models  # noqa: E402  pylint: disable=wrong-import-position

TINY = ["--model", "vit_ti_16", "--image-size", "32", "--batch", "2",
        "--rounds", "1", "--round-seconds", "0.05", "--warmup", "0",
        "--max-retries", "0"]


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


@pytest.mark.parametrize("mode", ["infer", "train"])
def test_bench_jax_vs_torch_json(mode, capsys):
  pytest.importorskip("torch")
  rec = bench.main(TINY + ["--mode", mode, "--json"])
  out = json.loads(capsys.readouterr().out)
  for key in ("jax_img_per_sec", "torch_img_per_sec", "ratio",
              "cpu_time_ratio", "gflop_per_image", "jax_compile_s"):
    assert key in out and out[key] is not None, key
  assert out["jax_img_per_sec"] > 0 and out["torch_img_per_sec"] > 0
  assert out["ratio"] > 0
  assert out["ratio"] == rec["ratio"]
  # Same weights and inputs on both sides.
  assert out["check_max_abs_diff"] < (1e-3 if mode == "infer" else 1e-4)
  assert out["details"]["rounds"][0]["jax"]["iters"] >= 1
  table = bench.format_table(rec)
  assert "vs torch" in table and "img/s" in table


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
                      "--png", str(png), "--json-out", str(js)])
  assert png.stat().st_size > 1000
  assert json.loads(js.read_text()).keys() == res.keys()
  r = res["resolution"]
  assert r[1]["tokens"] == 10 and r[1]["attention_fraction"] > r[0][
      "attention_fraction"]
  assert "jax ms/img if ~FLOPs" in capsys.readouterr().out
