"""What NaFlex costs (issue 22): a NaFlex batch (images of different aspect
ratios, each resized within the token budget, padded to one length, masked
in every attention and the pooling, each image's position grid resized
inside the step) against a square batch of the same token count (NHWC
images, one grid for the batch, no mask), on the same NaFlex model.

Three inputs per workload, alternating in rounds (``A B C``, ``C B A``...)
in this one process: ``square`` (B images of S x S px: (S/P)^2 tokens each),
``naflex_square`` (the same images as a NaFlex dict: the mask and the
per-image resize alone) and ``naflex`` (B images of other aspect ratios
within the same (S/P)^2 tokens, padded to it: a real NaFlex batch). For
each: wall seconds and CPU seconds (``time.process_time``: every thread of
the process, the load-robust number on a shared machine) per step, their
ratios to ``square`` (median of the per-round ratios), the compiled step's
temporary memory (``memory_analysis``), and how many programs a run of
steps at ``--seq-lens`` compiles (one per length).

    .venv/bin/python bench/naflex.py --mode infer --mode train --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import machine  # noqa: E402
from vit_jax import models  # noqa: E402
from vit_jax.data import naflex  # noqa: E402

# (height, width) aspect ratios of the NaFlex batch's images (cycled).
RATIOS = ((1, 1), (4, 3), (3, 4), (16, 9), (9, 16), (2, 1), (1, 2), (1, 3))


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--mode", action="append", choices=("infer", "train"),
                 help="repeatable; default: infer and train")
  p.add_argument("--width", type=int, default=384)
  p.add_argument("--depth", type=int, default=12)
  p.add_argument("--heads", type=int, default=6)
  p.add_argument("--patch", type=int, default=16)
  p.add_argument("--image-size", type=int, default=256,
                 help="the square images' side: (S / patch)^2 tokens")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--dtype", choices=("float32", "bfloat16"),
                 default="float32")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--steps", type=int, default=2, help="steps per turn")
  p.add_argument("--seq-lens", default="128,256",
                 help="lengths a run of --run-steps NaFlex steps draws from")
  p.add_argument("--run-steps", type=int, default=8)
  p.add_argument("--attention", default=None,
                 help="attention_impl (matmul, xla, cudnn); default: the "
                      "backend's choice")
  p.add_argument("--json", action="store_true")
  return p


def _model(args):
  m = args.width * 4
  return models.get_model(dict(
      hidden_size=args.width, num_layers=args.depth, num_heads=args.heads,
      mlp_dim=m, patch_size=args.patch, num_classes=1000, classifier="map",
      act="gelu_tanh", naflex="bilinear_aa", naflex_grid=(16, 16),
      dtype=jnp.dtype(args.dtype), attention_impl=args.attention))


def _inputs(args, seed=0):
  rng = np.random.default_rng(seed)
  s, p, b = args.image_size, args.patch, args.batch
  tokens = (s // p) ** 2
  square = rng.integers(0, 256, (b, s, s, 3), dtype=np.uint8)
  norm = lambda x: (x.astype(np.float32) / 255.0 - 0.5) / 0.5  # noqa: E731
  as_dict = naflex.collate([dict(zip(naflex.KEYS, naflex.patchify(norm(x), p)))
                            for x in square], tokens)
  imgs = []
  for i in range(b):
    h, w = RATIOS[i % len(RATIOS)]
    scale = s / max(h, w)
    imgs.append(rng.integers(0, 256, (int(h * scale * 1.5) + 7,
                                      int(w * scale * 1.5) + 3, 3),
                             dtype=np.uint8))
  flex = naflex.batch_images(imgs, patch_size=p, max_seq_len=tokens)
  return {"square": norm(square), "naflex_square": as_dict, "naflex": flex}


def _step(model, mode):
  if mode == "infer":
    return jax.jit(lambda v, x: model.apply(v, x, train=False))

  def loss(params, x):
    logits = model.apply({"params": params}, x, train=True,
                         rngs={"dropout": jax.random.key(0)})
    return jnp.mean(logits.astype(jnp.float32) ** 2)

  grad = jax.jit(jax.value_and_grad(loss))
  return lambda v, x: grad(v["params"], x)


def _temp_bytes(fn_jitted, *args):
  try:
    return int(fn_jitted.lower(*args).compile().memory_analysis()
               .temp_size_in_bytes)
  except Exception:  # pylint: disable=broad-except
    return None


def run_mode(model, variables, inputs, mode, args) -> dict:
  step = _step(model, mode)
  jitted = (step if mode == "infer" else
            jax.jit(jax.value_and_grad(lambda p, x: jnp.mean(model.apply(
                {"params": p}, x, train=True,
                rngs={"dropout": jax.random.key(0)}).astype(
                    jnp.float32) ** 2))))
  names = list(inputs)
  mem = {}
  for n in names:
    x = jax.tree_util.tree_map(jnp.asarray, inputs[n])
    inputs[n] = x
    jax.block_until_ready(step(variables, x))  # compile + warm
    jax.block_until_ready(step(variables, x))
    mem[n] = _temp_bytes(jitted, variables if mode == "infer"
                         else variables["params"], x)
  wall = {n: [] for n in names}
  cpu = {n: [] for n in names}
  for r in range(args.rounds):
    for n in (names if r % 2 == 0 else names[::-1]):
      t0, c0 = time.perf_counter(), time.process_time()
      for _ in range(args.steps):
        jax.block_until_ready(step(variables, inputs[n]))
      wall[n].append((time.perf_counter() - t0) / args.steps)
      cpu[n].append((time.process_time() - c0) / args.steps)
  out = {}
  for n in names:
    out[n] = dict(
        wall_s=statistics.median(wall[n]), cpu_s=statistics.median(cpu[n]),
        wall_ratio=statistics.median(
            a / b for a, b in zip(wall[n], wall["square"])),
        cpu_ratio=statistics.median(
            a / b for a, b in zip(cpu[n], cpu["square"])),
        temp_mib=None if mem[n] is None else mem[n] / 2 ** 20)
  return out


def compiles_per_run(model, variables, args) -> dict:
  """A run of NaFlex steps whose lengths are drawn from ``--seq-lens``:
  how many programs the jitted step compiles (one per length)."""
  lens = tuple(int(x) for x in args.seq_lens.split(","))
  fn = jax.jit(lambda v, x: model.apply(v, x, train=False))
  rng = np.random.default_rng(1)
  drawn = []
  for i in range(args.run_steps):
    seq = int(rng.choice(lens))
    drawn.append(seq)
    imgs = [rng.integers(0, 256, (int(rng.integers(16, 400)),
                                  int(rng.integers(16, 400)), 3),
                         dtype=np.uint8) for _ in range(2)]
    x = naflex.batch_images(imgs, patch_size=args.patch, max_seq_len=seq)
    jax.block_until_ready(fn(variables, x))
    del i
  return dict(seq_lens=list(lens), steps=args.run_steps,
              lengths_drawn=sorted(set(drawn)),
              compilations=int(fn._cache_size()))  # pylint: disable=protected-access


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  modes = args.mode or ["infer", "train"]
  model = _model(args)
  variables = jax.jit(model.init)(
      jax.random.key(0), jnp.zeros((1, args.image_size, args.image_size, 3)))
  inputs = _inputs(args)
  tokens = (args.image_size // args.patch) ** 2
  valid = inputs["naflex"]["patch_valid"].sum(axis=1)
  result = dict(
      machine=machine.cpu_info(),
      model=dict(width=args.width, depth=args.depth, heads=args.heads,
                 patch=args.patch, dtype=args.dtype),
      batch=args.batch, tokens_per_image=tokens,
      naflex_valid_tokens=valid.tolist(),
      load_before=os.getloadavg()[0], modes={})
  for mode in modes:
    result["modes"][mode] = run_mode(model, variables, dict(inputs), mode,
                                     args)
  result["compiles"] = compiles_per_run(model, variables, args)
  result["load_after"] = os.getloadavg()[0]
  if args.json:
    print(json.dumps(result, indent=2))
    return 0
  print(machine.describe(result["machine"]))
  print(f"NaFlex model width {args.width}, depth {args.depth}, patch "
        f"{args.patch}, {args.dtype}; batch {args.batch} x {tokens} tokens "
        f"(NaFlex batch: {valid.tolist()} valid); load "
        f"{result['load_before']:.1f} -> {result['load_after']:.1f}")
  print(f"{'mode':6} {'input':14} {'wall s':>8} {'CPU s':>8} "
        f"{'wall x':>7} {'CPU x':>7} {'temp MiB':>9}")
  for mode, rows in result["modes"].items():
    for n, r in rows.items():
      mem = "-" if r["temp_mib"] is None else f"{r['temp_mib']:.1f}"
      print(f"{mode:6} {n:14} {r['wall_s']:8.3f} {r['cpu_s']:8.3f} "
            f"{r['wall_ratio']:7.3f} {r['cpu_ratio']:7.3f} {mem:>9}")
  c = result["compiles"]
  print(f"a run of {c['steps']} NaFlex steps drawing lengths from "
        f"{c['seq_lens']} (drew {c['lengths_drawn']}): {c['compilations']} "
        f"compilations")
  return 0


if __name__ == "__main__":
  sys.exit(main())
