"""Smoke tests of bench/accelerator.py and bench/input_pipeline.py: on this
CPU they run at tiny sizes, say that they measured a CPU, and report every
part they promise. Nothing here asserts a speed."""

import json
import os
import subprocess
import sys

import pytest

from train_helpers import REPO  # noqa: E402
sys.path.insert(0, REPO)

from bench import accelerator  # noqa: E402  pylint: disable=wrong-import-position
from bench import input_pipeline as ip_bench  # noqa: E402  pylint: disable=wrong-import-position


def test_peak_table_and_mfu_inputs():
  assert accelerator.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert accelerator.peak_flops("NVIDIA H100 PCIe") == 756e12
  assert accelerator.peak_flops("NVIDIA H200") == 989e12
  assert accelerator.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
  assert accelerator.peak_flops("TPU v4") == 275e12
  assert accelerator.peak_flops("TPU v5 lite") == 197e12
  assert accelerator.peak_flops("cpu") is None  # "unknown"


def test_input_pipeline_bench_reports_cores_needed():
  res = ip_bench.main(["--cores", "1", "--randaugment", "off", "on",
                       "--images", "12", "--jpeg-size", "40", "56",
                       "--image-size", "24", "--batch", "4", "--batches", "2",
                       "--step-rate", "2900"])
  assert res["cpu"] and "AVX-512" in res["cpu"]  # machine.describe()
  assert [r["randaugment"] for r in res["rows"]] == ["off", "on"]
  assert all(r["img_per_s"] > 0 and r["images"] == 8 for r in res["rows"])
  text = ip_bench.report(res)
  assert "A step rate of 2,900 img/s needs about" in text and "CPU:" in text


@pytest.mark.slow
def test_accelerator_bench_runs_on_cpu_and_says_so(tmp_path):
  out = tmp_path / "acc.json"
  cmd = [sys.executable, os.path.join(REPO, "bench", "accelerator.py"),
         "--batch", "2", "--attention", "auto", "--scan", "on", "--steps", "1",
         "--e2e-steps", "3", "--images", "16", "--jpeg-size", "40", "48",
         "--profile", str(tmp_path / "prof"), "--json", str(out)]
  p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                     check=False, timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "This is a CPU" in p.stdout and "MFU is unknown" in p.stdout
  for part in ("1. train step", "2. input pipeline alone",
               "3. train.py end to end (synthetic data", "4. float32 logits",
               "5. vit_tiny_patch16_224 (2 blocks", "6. torch's train step"):
    assert part in p.stdout, p.stdout
  res = json.loads(out.read_text())
  assert res["backend"] == "cpu" and res["peak_bf16_flops"] is None
  (step,) = res["train_step"]
  assert step["img_per_s_per_device"] > 0 and step["mfu"] is None
  assert step["scan"] is True and step["train_flops_per_image"] > 0
  assert res["input_pipeline"]["img_per_s"] > 0
  e2e = res["end_to_end"]
  assert e2e["ratio"] > 0 and e2e["data"] == "synthetic", e2e
  assert len(e2e["logged_rates"]) >= 1
  assert res["logits"]["same_device"] and res["logits"]["rel_max_diff"] == 0
  diffs = res["timm_parity"]["rel_max_diff"]  # no accelerator: two CPU rows
  assert sorted(diffs) == ["ours float32, cpu (CPU)", "timm float32, CPU"]
  assert all(0 < d < 1e-5 for d in diffs.values()), diffs
  assert "torch_step" not in res  # only where torch has CUDA
  # The saved trace read back: every op named by the HLO saved beside it,
  # the GEMMs' FLOPs counted.
  from bench import ops  # pylint: disable=import-outside-toplevel
  groups, top = ops.read_jax_trace(str(tmp_path / "prof" / "jax"), 3)
  assert groups["dense GEMMs"] > 0 and groups["LayerNorm"] > 0, groups
  assert groups["optimizer"] > 0 and groups["idle (no op running)"] >= 0
  assert set(groups) <= set(ops.GROUPS) | {"idle (no op running)"}
  assert len(top) == 20 and all(ms > 0 for _, ms, _ in top)
  _, _, span = ops.op_times(str(tmp_path / "prof" / "jax"))
  assert span > 0


def test_torch_step_rate_runs_timm_on_the_cpu_without_cuda():
  import argparse  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  if torch.cuda.is_available():
    pytest.skip("torch has CUDA here: the step runs there")
  args = argparse.Namespace(model="vit_ti_16", image_size=32, timm_depth=1,
                            steps=1)
  r = accelerator.torch_step_rate(args, 2)
  assert r["device"] == "cpu" and r["img_per_s"] > 0 and r["mfu"] is None


def test_accelerator_without_tensorflow_says_what_it_did_not_run(
    monkeypatch, capsys):
  """A GPU machine has no TensorFlow: the input pipeline alone is not run
  and says so; part 3 on the JPEG folder neither (synthetic needs none)."""
  monkeypatch.setattr(accelerator, "has_tensorflow", lambda: False)
  res = accelerator.main(["--skip", "step", "logits", "timm", "torch",
                          "--e2e-data", "folder"])
  out = capsys.readouterr().out
  assert "2. input pipeline alone: not run (no TensorFlow here)" in out
  assert "3. train.py end to end on the JPEG folder: not run" in out
  assert "input_pipeline" not in res and "end_to_end" not in res


def test_trace_readers_count_gemm_flops_and_group_cuda_kernels(tmp_path):
  """What bench/ops.py --trace reads from a GPU run: cuBLAS GEMMs in the
  HLO (FLOPs from their shapes), cuDNN attention, torch's CUDA kernels."""
  from bench import ops  # pylint: disable=import-outside-toplevel
  gemm = ('  %custom-call.3 = (bf16[512,768]{1,0}, s8[4194304]{0}) '
          'custom-call(bf16[512,3072]{1,0} %a, bf16[3072,768]{1,0} %b), '
          'custom_call_target="__cublas$lt$matmul", backend_config={"gemm_'
          'backend_config":{"dot_dimension_numbers":{"lhs_contracting_'
          'dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_'
          'dimensions":[],"rhs_batch_dimensions":[]}}}, metadata={op_name='
          '"jit(f)/jvp(VisionTransformer)/MlpBlock_0/Dense_1/dot_general"}')
  fmha = ('  %custom-call.4 = (bf16[8,197,12,64]{3,2,1,0}, u8[0]{0}) '
          'custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax",'
          ' metadata={op_name="jit(f)/jvp(VisionTransformer)/attention"}')
  dot = ('  ROOT %dot.1 = f32[4,6]{1,0} dot(%p, %q), lhs_contracting_dims={1}, '
         'rhs_contracting_dims={0}, metadata={op_name="jit(f)/jvp('
         'VisionTransformer)/Dense_0/dot_general"}')
  instrs, _ = ops.parse_hlo("ENTRY %main (a: f32[4,5]) -> f32[4,6] {\n"
                            "  %p = f32[4,5]{1,0} parameter(0)\n" +
                            "\n".join((gemm, fmha, dot)) + "\n}")
  assert instrs["custom-call.3"][0] == "dot"
  assert instrs["custom-call.3"][3] == 2 * 512 * 768 * 3072
  assert instrs["dot.1"][3] == 2 * 4 * 6 * 5  # lhs shape from its definition
  assert ops.group_of(*ops._inner("custom-call.4", instrs, {})[:2]) == (  # pylint: disable=protected-access
      "attention matmuls")
  events = [{"ph": "X", "cat": "kernel", "name": n, "ts": t, "dur": d}
            for n, t, d in (
                ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 0, 40),
                ("pytorch_flash::flash_fwd_kernel", 40, 20),
                ("triton_per_fused_native_layer_norm_0", 70, 10),
                ("void at::native::vectorized_elementwise_kernel<gelu>", 80,
                 10),
                ("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 90, 10))]
  path = tmp_path / "torch_default.trace.json"
  path.write_text(json.dumps({"traceEvents": events}))
  groups, top = ops.read_torch_trace(str(path), 1)
  assert groups["dense GEMMs"] == 40e-3 and groups["attention matmuls"] == (
      20e-3)
  assert groups["LayerNorm"] == groups["GELU"] == groups["optimizer"] == (
      10e-3)
  assert groups["idle (no op running)"] == 10e-3  # 60..70 us: nothing ran
  assert len(top) == 5


def test_gpu_trace_kernels_named_by_fusion_or_library():
  """jax 0.11 on a GPU traces the step's kernels (one CUDA graph) by their
  fusion's name with '_N' for '.N', or by cuBLAS's / cuDNN's kernel name;
  all GEMM FLOPs of the HLO (XLA's batched kernel gradients included) are
  what the GEMM kernels' time is divided into."""
  from bench import ops  # pylint: disable=import-outside-toplevel
  batched = ('  %custom-call.182 = (f32[4,768,768]{2,1,0}, s8[33554432]{0}) '
             'custom-call(bf16[4,50688,768]{2,1,0} %a, bf16[4,50688,768]'
             '{2,1,0} %b), custom_call_target="__cublas$lt$matmul", '
             'backend_config={"gemm_backend_config":{"dot_dimension_numbers"'
             ':{"lhs_contracting_dimensions":["1"],"rhs_contracting_'
             'dimensions":["1"],"lhs_batch_dimensions":["0"],"rhs_batch_'
             'dimensions":["0"]}}}')
  plain = ('  %custom-call.3 = (bf16[512,768]{1,0}, s8[4194304]{0}) '
           'custom-call(bf16[512,3072]{1,0} %c, bf16[3072,768]{1,0} %d), '
           'custom_call_target="__cublas$lt$matmul", backend_config={"gemm_'
           'backend_config":{"dot_dimension_numbers":{"lhs_contracting_'
           'dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_'
           'dimensions":[],"rhs_batch_dimensions":[]}}}')
  fusion = '  %loop_add_fusion.11 = f32[8]{0} fusion(%e), kind=kLoop'
  hlo = "ENTRY %main () -> f32[8] {\n" + "\n".join((batched, plain,
                                                    fusion)) + "\n}"
  assert ops.hlo_dot_flops(hlo) == (2 * 4 * 768 * 768 * 50688 +
                                    2 * 512 * 768 * 3072)
  instrs, _ = ops.parse_hlo(hlo)
  assert ops._hlo_name("loop_add_fusion_11", instrs) == "loop_add_fusion.11"  # pylint: disable=protected-access
  assert ops._hlo_name("nvjet_sm90_tst_128x128", instrs) == (  # pylint: disable=protected-access
      "nvjet_sm90_tst_128x128")
  for kernel, group in (
      ("nvjet_sm90_tss_192x192_64x3_1x2_h_bz_coopB_splitK_NTN", "dense GEMMs"),
      ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "dense GEMMs"),
      ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16",
       "attention matmuls"),
      ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>",
       "attention matmuls"),
      ("Memset", "layout copies")):
    assert ops.kernel_group(kernel) == group, kernel
  assert ops.trace_label("a/jax", ["a/jax", "b/jax/"]) == "a/jax"
  assert ops.trace_label("t.json", ["a/jax", "t.json"]) == "t.json"


def test_attention_bench_checks_each_implementation_on_the_cpu():
  """bench/attention.py on a CPU: XLA's attention and Pallas's flash
  kernels (in Pallas's interpreter, the tokens padded to its blocks) each
  within bfloat16 rounding of float32 attention, output and gradients;
  cuDNN, which a CPU has not, says so in its row."""
  from bench import attention  # pylint: disable=import-outside-toplevel
  res = attention.main(["--batch", "2", "--tokens", "13", "--heads", "2",
                        "--head-dim", "16", "--pallas-blocks", "16",
                        "--pallas-bwd-blocks", "16", "--steps", "1",
                        "--interpret"])
  rows = {r["impl"]: r for r in res["rows"]}
  assert list(rows) == ["cudnn", "xla", "pallas:16"]
  assert "error" in rows["cudnn"]
  for impl in ("xla", "pallas:16"):
    assert "error" not in rows[impl], rows[impl]
    assert max(rows[impl]["rel_err"].values()) < 2e-2, rows[impl]
  assert res["flops"] == 14 * 2 * 2 * 13 * 13 * 16
  assert "pallas:16" in attention.format_rows(res)
