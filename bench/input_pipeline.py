"""Images per second of the training input pipeline alone, on synthetic JPEGs.

    .venv/bin/python bench/input_pipeline.py --cores 1 2 --step-rate 2900

Generated photo-like JPEGs (``--jpeg-size``) through ``train.py``'s
``vit_jax.data.batches.train_dataset`` (Inception crop, flip, uint8), with
and without RandAugment, on ``--cores`` tf.data threads; nothing goes to a
device. It prints img/s, images per CPU-second (robust to other processes
starving it) and the cores a step rate (``--step-rate``) needs.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench import harness, machine  # noqa: E402
from vit_jax.data import console  # noqa: E402


def write_jpegs(directory: str, n: int, height: int, width: int,
                classes: int = 10, seed: int = 0, quality: int = 90) -> str:
  """``n`` photo-like JPEGs (smooth gradients + noise, so they compress like
  photos, not like flat colour) as ``<dir>/train/<class>/<i>.jpg`` and a
  small ``test`` split; returns ``directory``."""
  from PIL import Image  # pylint: disable=import-outside-toplevel
  rng = np.random.RandomState(seed)
  y, x = np.mgrid[0:height, 0:width].astype(np.float32)
  for split, count in (("train", n), ("test", max(classes, n // 10))):
    for i in range(count):
      d = os.path.join(directory, split, f"c{i % classes}")
      os.makedirs(d, exist_ok=True)
      f = rng.uniform(0.5, 4.0, 3)
      img = 127 + 100 * np.sin(np.stack(
          [x / width * f[0] * 6, y / height * f[1] * 6,
           (x + y) / (width + height) * f[2] * 6], -1) + rng.uniform(0, 6, 3))
      img += rng.normal(0, 12, img.shape)
      Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(
          os.path.join(d, f"{i}.jpg"), quality=quality)
  return directory


def pipeline_config(folder: str, *, image_size: int = 224,
                    randaugment: bool = False):
  """configs/common.py's defaults (Inception crop + flip, as the b16
  recipes) on the folder; RandAugment 2 x 9 like ``:scratch``."""
  from configs import common  # pylint: disable=import-outside-toplevel
  c = common.get_config()
  c.dataset, c.image_size = f"folder:{folder}", image_size
  c.pp.randaugment_layers = 2 if randaugment else 0
  c.pp.randaugment_magnitude = 9
  return c


def measure(config, *, cores: int, batch: int, batches: int,
            warmup: int = 3) -> dict:
  """img/s of ``batches`` uint8 batches of ``train_dataset`` (after
  ``warmup`` untimed ones) on ``cores`` tf.data threads."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  from vit_jax.data import batches as data_batches, sources  # pylint: disable=import-outside-toplevel
  src = sources.get_source(config)
  ds = data_batches.train_dataset(config, src, local_batch=batch,
                                  start_step=0, process_index=0,
                                  process_count=1)
  opts = tf.data.Options()
  opts.threading.private_threadpool_size = int(cores)
  opts.threading.max_intra_op_parallelism = 1
  it = data_batches.as_numpy(ds.with_options(opts))
  for _ in range(warmup):
    b = next(it)
  assert b["image"].dtype == np.uint8, b["image"].dtype
  t0, c0 = time.perf_counter(), time.process_time()
  for _ in range(batches):
    next(it)
  wall, cpu = time.perf_counter() - t0, time.process_time() - c0
  return {"img_per_s": batches * batch / wall, "seconds": wall,
          "cpu_use": cpu / wall, "images": batches * batch,
          "img_per_cpu_s": batches * batch / max(cpu, 1e-9)}


def run(args) -> dict:
  from vit_jax.data import transforms  # pylint: disable=import-outside-toplevel
  margin = transforms._JPEG_CROP_MARGIN  # pylint: disable=protected-access
  folder, rows = tempfile.mkdtemp(prefix="vit_jax_jpegs_"), []
  try:
    write_jpegs(folder, args.images, *args.jpeg_size)
    for ra in args.randaugment:
      cfg = pipeline_config(folder, image_size=args.image_size,
                            randaugment=ra == "on")
      for cores in args.cores:
        for decode in args.decode:
          harness.log(f"[input_pipeline] randaugment {ra}, {cores} core(s), "
                      f"{decode} decode ...")
          # 'full': a margin wider than any image makes the crop's decode
          # window the whole JPEG (the pipeline before decode_and_crop).
          transforms._JPEG_CROP_MARGIN = (  # pylint: disable=protected-access
              margin if decode == "crop" else 1 << 20)
          r = measure(cfg, cores=cores, batch=args.batch, batches=args.batches)
          rows.append(dict(r, randaugment=ra, cores=cores, decode=decode))
  finally:
    transforms._JPEG_CROP_MARGIN = margin  # pylint: disable=protected-access
    shutil.rmtree(folder, ignore_errors=True)
  return {"cpu": machine.describe().replace("CPU: ", "", 1), "rows": rows,
          "jpeg_size": args.jpeg_size, "image_size": args.image_size,
          "batch": args.batch, "step_rates": args.step_rate}


def report(res) -> str:
  h, w = res["jpeg_size"]
  lines = [f"Input pipeline alone (vit_jax.data.batches.train_dataset, "
           f"uint8 out), {h}x{w} JPEGs -> {res['image_size']}px Inception "
           f"crop + flip, batch {res['batch']}",
           f"CPU: {res['cpu']}",
           f"{'randaug':>8s} {'cores':>6s} {'decode':>7s} {'img/s':>9s} "
           f"{'img/s/core':>11s} {'cpu use':>8s} {'img/cpu-s':>10s}"]
  widest = {}
  for r in res["rows"]:
    lines.append(f"{r['randaugment']:>8s} {r['cores']:6d} {r['decode']:>7s} "
                 f"{r['img_per_s']:9.1f} {r['img_per_s'] / r['cores']:11.1f} "
                 f"{r['cpu_use']:8.2f} {r['img_per_cpu_s']:10.1f}")
    if r["decode"] == "crop" and r["cores"] >= widest.get(
        r["randaugment"], r)["cores"]:
      widest[r["randaugment"]] = r
    if r["cpu_use"] < 0.8 * r["cores"]:
      lines[-1] += "  (starved: other processes held the cores)"
  for rate in res["step_rates"]:
    for ra, r in widest.items():
      lines.append(f"A step rate of {rate:,.0f} img/s needs about "
                   f"{math.ceil(rate / r['img_per_cpu_s'])} such cores with "
                   f"RandAugment {ra} ({r['img_per_cpu_s']:.1f} images per "
                   f"CPU-second at {r['cores']} core(s)).")
  return "\n".join(lines)


def main(argv=None):
  console.lean_start_up()
  console.quiet_native_logs()
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--cores", type=int, nargs="+", default=[1, 2])
  p.add_argument("--randaugment", nargs="+", choices=("off", "on"),
                 default=["off", "on"])
  p.add_argument("--decode", nargs="+", choices=("crop", "full"),
                 default=["crop"],
                 help="crop: decode_and_crop_jpeg (the pipeline); full: "
                      "decode the whole JPEG first (before), side by side")
  p.add_argument("--images", type=int, default=256)
  p.add_argument("--jpeg-size", type=int, nargs=2, default=[375, 500],
                 metavar=("H", "W"))
  p.add_argument("--image-size", type=int, default=224)
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--batches", type=int, default=8, help="timed batches")
  p.add_argument("--step-rate", type=float, nargs="*", default=[2900.0],
                 help="accelerator img/s to size the host for")
  p.add_argument("--json", action="store_true")
  args = p.parse_args(argv)
  res = run(args)
  harness.emit(report(res), res, args.json)
  return res


if __name__ == "__main__":
  main()
