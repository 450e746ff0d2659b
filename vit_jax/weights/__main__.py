"""Any weights :func:`vit_jax.weights.load` reads -> one torch-free file.

    python -m vit_jax.weights SOURCE OUT.safetensors [--model NAME] [--image-size N]
        [--overrides JSON] [--then JSON]

``SOURCE`` is anything ``load`` accepts (a ``.pth`` state dict, a Google
``.npz``, ``hf-hub:org/name``, ``torchvision:IMAGENET1K_V1`` with
``--model vit_b_16`` ...). ``OUT`` holds our parameter tree bit for bit with
the architecture, the preprocessing and the label names in its header, so
``weights.load(OUT)`` gives back the same model without torch. ``train.py``
runs this in a child process to fine-tune from PyTorch weights without
importing torch beside JAX.

Exit status: 0 written; 1 an error (one ``error:`` line); 3 the weights are
not of the ``--model`` named; 4 they need a ``--model`` name (what the
keys cannot show); 5 they need ``num_heads`` (a width without a usual
number of heads). With ``--then``, further tries (another name, other
stated sizes) are made in the same process, where the ones before fail:
the error and the status are the last try's, and the output's last line
``try N`` says which was written (torch is imported once, not once a
try).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional


def convert(source: str, out: str, **load_kwargs):
  """Loads ``source`` and writes it to ``out`` (our safetensors layout,
  written to a temporary name first: ``out`` is whole or absent). Returns
  the :class:`~vit_jax.weights.Loaded`."""
  from vit_jax import weights  # pylint: disable=import-outside-toplevel
  from vit_jax.weights import saving  # pylint: disable=import-outside-toplevel

  loaded = weights.load(source, **load_kwargs)
  meta = {"preprocessing": loaded.preprocessing.as_dict(),
          "source": str(source), "description": loaded.description}
  if loaded.label_names is not None:
    meta["label_names"] = list(loaded.label_names)
  tmp = f"{out}.tmp-{os.getpid()}"
  try:
    saving.save_safetensors(loaded.variables, tmp, model=loaded.model,
                             metadata=meta)
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return loaded


def _status(e: BaseException) -> int:
  """The exit status that says why (see the module docstring)."""
  from vit_jax.weights import build, layouts  # pylint: disable=import-outside-toplevel
  while e is not None:
    if isinstance(e, build.NameMismatch):
      return 3
    if isinstance(e, layouts.Undecided):
      return 4 if e.field == "model_name" else 5
    e = e.__cause__
  return 1


def main(argv: Optional[list] = None) -> int:
  from vit_jax.data import console  # pylint: disable=import-outside-toplevel
  p = console.Parser(
      prog="python -m vit_jax.weights",
      description="Convert weights (any layout vit_jax.weights.load reads) "
                  "to a torch-free safetensors file in vit_jax's layout.")
  p.add_argument("source", help="a file, a directory, hf-hub:org/name or "
                                "torchvision:WEIGHTS")
  p.add_argument("out", help="the .safetensors file to write")
  p.add_argument("--model", default=None,
                 help="ours (vit_b_16) or timm's (vit_base_patch16_224) name, "
                      "where the weights cannot tell (torchvision: names)")
  p.add_argument("--image-size", type=int, default=None,
                 help="resample the position embedding to this resolution")
  p.add_argument("--overrides", default="{}",
                 help="JSON object of model fields the checkpoint is stated to "
                      "have (e.g. '{\"num_heads\": 2}')")
  p.add_argument("--then", default="[]",
                 help="JSON list of further tries, each {\"model\": NAME or "
                      "null, \"overrides\": {...}}, made in order where the "
                      "ones before fail to load; the last line of the output "
                      "says which was written ('try N', 0 the first)")
  args = p.parse_args(argv)
  from vit_jax import weights  # pylint: disable=import-outside-toplevel
  console.lean_start_up()
  console.quiet_native_logs()
  try:
    tries = [{"model": args.model, "overrides": json.loads(args.overrides)},
             *json.loads(args.then)]
  except ValueError as e:
    print(f"error: --overrides / --then are not JSON: {e}", file=sys.stderr)
    return 1
  for i, t in enumerate(tries):
    try:
      loaded = convert(args.source, args.out, model_name=t.get("model"),
                       image_size=args.image_size,
                       **(t.get("overrides") or {}))
    except (weights.CheckpointError, ValueError, FileNotFoundError) as e:
      if i + 1 < len(tries):
        continue
      print(f"error: {e}", file=sys.stderr, flush=True)
      return _status(e)
    print(f"{args.out}: {loaded.description}")
    if len(tries) > 1:
      print(f"try {i}")
    return 0
  return 1


if __name__ == "__main__":
  from vit_jax.data import console  # pylint: disable=ungrouped-imports
  console.one_line_warnings()
  sys.exit(main())
