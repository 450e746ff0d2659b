"""python -m vit_jax.export: write (and --verify) an artifact; see
:mod:`vit_jax.export`."""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from vit_jax.data import console
from vit_jax.export.types import DTYPES, FORMATS, OUTPUTS


def _size_of(path: str) -> int:
  if os.path.isdir(path):
    return sum(os.path.getsize(os.path.join(d, f))
               for d, _, fs in os.walk(path) for f in fs)
  return os.path.getsize(path)


def _parser():
  ap = console.Parser(
      prog="python -m vit_jax.export",
      description="Export a ViT checkpoint as a StableHLO, TensorFlow "
                  "SavedModel or ONNX artifact (images in, logits or "
                  "features out).")
  ap.add_argument("--checkpoint", required=True,
                  help="anything vit_jax.weights.load reads: a pretrained "
                       "name (vit_small_patch14_reg4_dinov2.lvd142m; "
                       "vit_jax.list_models(pretrained=True)), a training "
                       "workdir, .pth, .npz, .safetensors, hf-hub:org/name, "
                       "torchvision:NAME")
  ap.add_argument("--format", required=True, choices=FORMATS)
  ap.add_argument("--out", required=True,
                  help="output file (stablehlo, onnx) or directory "
                       "(savedmodel)")
  ap.add_argument("--batch", type=int, default=None,
                  help="fixed batch size (default: dynamic)")
  ap.add_argument("--dtype", choices=DTYPES, default="float32")
  ap.add_argument("--with-preprocessing", action="store_true",
                  help="take uint8 (batch, H, W, 3) images of any size; "
                       "resize, crop and normalise inside")
  ap.add_argument("--platforms", default="cpu",
                  help="stablehlo/savedmodel: comma-separated platforms to "
                       "lower for (cpu, cuda, rocm, tpu)")
  ap.add_argument("--model", default=None,
                  help="variant when the weights cannot tell (vit_b_16)")
  ap.add_argument("--image-size", type=int, default=None,
                  help="export at this resolution (position embedding "
                       "resampled)")
  ap.add_argument("--seq-len", type=int, default=None,
                  help="a NaFlex model's fixed sequence length (default: "
                       "symbolic, any length)")
  ap.add_argument("--output", choices=OUTPUTS, default=None,
                  help="what the artifact returns: logits, or features "
                       "(forward_features: the tokens after the final norm; "
                       "SAM's neck map). Default: logits, or features for a "
                       "model without a classification head")
  ap.add_argument("--verify", action="store_true",
                  help="run the artifact in its runtime on random inputs "
                       "(batch 1 and 7; NaFlex: two sequence lengths) and "
                       "print its error against JAX")
  return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
  console.lean_start_up()
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  args = _parser().parse_args(argv)
  from vit_jax import export as export_lib  # pylint: disable=import-outside-toplevel
  from vit_jax import weights  # pylint: disable=import-outside-toplevel
  servable, export, input_spec = (export_lib.servable, export_lib.export,
                                  export_lib.input_spec)
  output_shape = export_lib.output_shape
  verify, ExportError = export_lib.verify, export_lib.ExportError  # pylint: disable=invalid-name
  try:
    s = servable(args.checkpoint, model_name=args.model,
                 image_size=args.image_size, output=args.output)
    platforms = tuple(p.strip() for p in args.platforms.split(",") if p.strip())
    out = export(s, args.format, args.out, batch=args.batch, dtype=args.dtype,
                 with_preprocessing=args.with_preprocessing,
                 platforms=platforms, seq_len=args.seq_len)
    spec = input_spec(s, batch=args.batch,
                      with_preprocessing=args.with_preprocessing,
                      seq_len=args.seq_len)
  except (ExportError, weights.CheckpointError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  print(f"wrote {out} ({args.format}, {_size_of(out) / 2 ** 20:.1f} MiB)")
  dims = ", ".join("batch" if d is None else str(d)
                   for d in output_shape(s, batch=args.batch))
  print(f"  images: {spec.describe()} -> {s.output}: float32 ({dims}); "
        f"computed in {args.dtype}")
  if args.with_preprocessing:
    p = s.preprocessing
    print(f"  preprocessing: resize {p.resize_size}, center crop "
          f"{p.crop_size}, {p.interpolation} (antialiased), mean "
          f"{tuple(round(m, 4) for m in p.mean)}, std "
          f"{tuple(round(v, 4) for v in p.std)}")
  if args.verify:
    err = verify(s, args.format, out,
                 with_preprocessing=args.with_preprocessing, dtype=args.dtype,
                 batch=args.batch)
    print(f"  verify: max relative error against JAX {err.max_rel_err:.2e}"
          + (f" ({err.note})" if err.note else ""))
  return 0


if __name__ == "__main__":
  console.one_line_warnings()
  sys.exit(main())
