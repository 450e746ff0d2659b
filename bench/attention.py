r"""Self-attention alone, forward and backward, at a ViT's shapes: each
implementation the model could run on an accelerator, side by side in one
process.

    .venv/bin/python bench/attention.py                     # ViT-B/16, batch 256
    .venv/bin/python bench/attention.py --heads 16 --batch 128   # ViT-L/16
    .venv/bin/python bench/attention.py --impl pallas --pallas-blocks 64 128

Implementations (``--impl``): ``cudnn`` (what the model runs on a GPU:
:func:`vit_jax.models.kernels.padded_attention`, an odd length padded by
one masked token), ``xla`` (``jax.nn.dot_product_attention`` lowered by
XLA), ``pallas`` (JAX's Pallas flash attention for GPUs,
``jax.experimental.pallas.ops.gpu.attention.mha``, which takes lengths in
multiples of its blocks: the tokens are padded to one, the padding a
segment of its own that no real token reads) per ``--pallas-blocks``
(forward block size; the backward's blocks are JAX's defaults, or
``--pallas-bwd-blocks``). Each is timed as one jitted call of the output
and the q, k, v gradients of a weighted sum, in bfloat16; its FLOPs are the
four (N x N x d) products of the forward and ten of the backward, of the
real tokens only (padding is the implementation's cost). Every output and
gradient is compared with XLA's float32 attention at the highest matmul
precision (max error over max value). ``--interpret`` runs Pallas's
kernels in its interpreter (on a CPU: a test of the code, not a speed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

IMPLS = ("cudnn", "xla", "pallas")


def flops(batch: int, heads: int, tokens: int, head_dim: int) -> float:
  """Forward (q k^T and p v: 2 products, 2 FLOPs each) and backward (5
  products) of the real tokens."""
  return 14.0 * batch * heads * tokens * tokens * head_dim


def pallas_attention(q, k, v, block: int, bwd_block=None, interpret=False):
  """``mha`` of (B, N, H, d) q, k, v: N padded to a multiple of ``block``;
  the padding is segment 0, the tokens segment 1 (a padded query reads only
  padding: its row is finite and dropped)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas.ops.gpu import attention as pa  # pylint: disable=import-outside-toplevel
  b, n, _, d = q.shape
  padded = -(-n // block) * block
  pad = ((0, 0), (0, padded - n), (0, 0), (0, 0))
  q, k, v = (jnp.pad(t, pad) for t in (q, k, v))
  segments = jnp.broadcast_to((jnp.arange(padded) < n).astype(jnp.int32),
                              (b, padded))
  blocks = pa.BlockSizes.get_default()
  kw = dict(block_q=block, block_k=block)
  if bwd_block:
    kw.update(block_q_dkv=bwd_block, block_kv_dkv=bwd_block,
              block_q_dq=bwd_block, block_kv_dq=bwd_block)
  blocks = pa.BlockSizes(**{**{f: getattr(blocks, f) for f in (
      "block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq")}, **kw})
  out = pa.mha(q, k, v, segments, sm_scale=d ** -0.5, block_sizes=blocks,
               interpret=interpret)
  return out[:, :n]


def attention_fn(impl: str, args):
  """(q, k, v) -> out for ``impl`` (bfloat16 in, bfloat16 out)."""
  import jax  # pylint: disable=import-outside-toplevel
  from vit_jax.models import kernels  # pylint: disable=import-outside-toplevel
  if impl == "cudnn":
    return lambda q, k, v: kernels.padded_attention(q, k, v,
                                                    implementation="cudnn")
  if impl == "xla":
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="xla")
  if impl.startswith("pallas"):
    block = int(impl.split(":")[1])
    return lambda q, k, v: pallas_attention(
        q, k, v, block, args.pallas_bwd_blocks, args.interpret)
  raise ValueError(f"--impl {impl!r}: expected one of {IMPLS}")


def _rel(a, b) -> float:
  import numpy as np  # pylint: disable=import-outside-toplevel
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def measure(args) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  shape = (args.batch, args.tokens, args.heads, args.head_dim)
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, w = (jax.random.normal(key, shape, jnp.float32) for key in keys)

  def out_and_grads(fn, dtype):
    def f(q, k, v):
      return fn(q.astype(dtype), k.astype(dtype), v.astype(dtype)).astype(
          jnp.float32)

    def g(q, k, v, w):
      out, vjp = jax.vjp(f, q, k, v)
      return (out,) + vjp(w)
    return jax.jit(g)

  with jax.default_matmul_precision("highest"):
    ref = out_and_grads(attention_fn("xla", args), jnp.float32)(q, k, v, w)
    ref = [np.asarray(r) for r in ref]
  impls = [i for i in args.impl if i != "pallas"] + [
      f"pallas:{b}" for b in args.pallas_blocks if "pallas" in args.impl]
  fl = flops(args.batch, args.heads, args.tokens, args.head_dim)
  rows = []
  for impl in impls:
    row = {"impl": impl}
    try:
      run = out_and_grads(attention_fn(impl, args), jnp.bfloat16)
      t0 = time.perf_counter()
      got = jax.block_until_ready(run(q, k, v, w))
      row["compile_s"] = time.perf_counter() - t0
      row["rel_err"] = {n: _rel(a, r) for n, a, r in zip(
          ("out", "dq", "dk", "dv"), got, ref)}
      times = []
      for _ in range(args.steps):
        t0 = time.perf_counter()
        jax.block_until_ready(run(q, k, v, w))
        times.append(time.perf_counter() - t0)
      best = float(np.median(times))
      row.update(ms=best * 1e3, tflops=fl / best / 1e12)
    except Exception as e:  # pylint: disable=broad-except
      row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    rows.append(row)
  return {"device": str(jax.devices()[0].device_kind),
          "backend": jax.default_backend(), "jax": jax.__version__,
          "shape (B, N, H, d)": list(shape), "flops": fl, "rows": rows}


def format_rows(result: dict) -> str:
  b, n, h, d = result["shape (B, N, H, d)"]
  lines = [f"self-attention forward + backward, bfloat16, B={b} N={n} H={h} "
           f"d={d} on {result['device']} ({result['backend']}, jax "
           f"{result['jax']}); {result['flops'] / 1e9:.1f} GFLOP a call",
           f"{'impl':>12} {'ms':>8} {'TFLOP/s':>8} {'compile s':>9}  "
           "max error / max value (out, dq, dk, dv) against float32"]
  for r in result["rows"]:
    if "error" in r:
      lines.append(f"{r['impl']:>12}  not run: {r['error']}")
      continue
    errs = " ".join(f"{e:.1e}" for e in r["rel_err"].values())
    lines.append(f"{r['impl']:>12} {r['ms']:8.3f} {r['tflops']:8.1f} "
                 f"{r['compile_s']:9.1f}  {errs}")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--tokens", type=int, default=197)
  p.add_argument("--heads", type=int, default=12)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
  p.add_argument("--pallas-blocks", nargs="+", type=int, default=[64, 128])
  p.add_argument("--pallas-bwd-blocks", type=int, default=None)
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--interpret", action="store_true",
                 help="Pallas's interpreter (a CPU: correctness only)")
  p.add_argument("--json", help="also write the result here")
  args = p.parse_args(argv)
  result = measure(args)
  print(format_rows(result), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
