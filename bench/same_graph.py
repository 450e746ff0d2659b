"""Is a model's compiled program the same in two checkouts? Hashes of the
lowered StableHLO of inference and of a training gradient, float32 and
bfloat16, unrolled and scanned, one line per case: identical hashes mean the
same XLA program, hence the same speed, whatever the machine's load (the
load-free complement of ``ab.py``).

    git archive main | tar -x -C /tmp/base
    .venv/bin/python bench/same_graph.py /tmp/base .      # vit_b_16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import hashlib, json, sys
src, name, batch, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
quick = sys.argv[5] == "1"
sys.path.insert(0, src)
import jax, jax.numpy as jnp
from vit_jax import models
assert models.__file__.startswith(src), models.__file__
out = {}
for dtype in ("float32",) if quick else ("float32", "bfloat16"):
  for scan in (False,) if quick else (False, True):
    m = models.get_model(name, dtype=jnp.dtype(dtype), scan_layers=scan)
    x = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32)
    v = jax.eval_shape(lambda x: m.init(jax.random.key(0), x), x)
    infer = jax.jit(lambda v, x: m.apply(v, x)).lower(v, x).as_text()
    loss = lambda v, x: jnp.mean(m.apply(
        v, x, train=True, rngs={"dropout": jax.random.key(1)}) ** 2)
    train = jax.jit(jax.grad(loss)).lower(v, x).as_text()
    h = lambda t: hashlib.sha256(t.encode()).hexdigest()[:16]
    out[f"{dtype} scan={scan}"] = {"infer": h(infer), "train": h(train)}
print(json.dumps(out))
"""


def hashes(src: str, name: str, batch: int, size: int,
           quick: bool = False) -> dict:
  src = os.path.abspath(src)
  p = subprocess.run([sys.executable, "-c", _CHILD, src, name, str(batch),
                      str(size), str(int(quick))], capture_output=True,
                     text=True, check=True,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("a", help="checkout A (e.g. /tmp/base)")
  p.add_argument("b", help="checkout B (e.g. .)")
  p.add_argument("--model", default="vit_b_16")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--quick", action="store_true",
                 help="float32, unrolled only")
  args = p.parse_args(argv)
  ha = hashes(args.a, args.model, args.batch, args.image_size, args.quick)
  hb = hashes(args.b, args.model, args.batch, args.image_size, args.quick)
  same = True
  print(f"{args.model}, batch {args.batch}, {args.image_size} px: lowered "
        f"StableHLO hashes, {args.a} vs {args.b}")
  for case in ha:
    for kind in ("infer", "train"):
      eq = ha[case][kind] == hb[case][kind]
      same &= eq
      print(f"  {case:22s} {kind:5s} {ha[case][kind]} "
            f"{'==' if eq else '!='} {hb[case][kind]}")
  print("same program" if same else "DIFFERENT programs")
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
