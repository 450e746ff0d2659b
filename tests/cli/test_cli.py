"""What the command-line tools share: one option spelling (dashes, with the
underscore spelling accepted), the shared checkpoint and dataset options,
and errors that name the tool's own flags."""

import subprocess

import pytest

from train_helpers import PYTHON, REPO, env
from vit_jax import cli, evaluate, features, predict, probe, visualize
from vit_jax.data import console
from vit_jax.export import __main__ as export_cli

PARSERS = {"predict": predict._parser, "evaluate": evaluate._parser,  # pylint: disable=protected-access
           "visualize": visualize._parser, "features": features._parser,  # pylint: disable=protected-access
           "probe": probe._parser, "export": export_cli._parser}  # pylint: disable=protected-access


def test_both_spellings_of_an_option():
  ap = cli.parser("vit_jax.x", "test")
  cli.add_checkpoint(ap)
  cli.add_dataset(ap)
  for argv in (["--checkpoint", "a", "--image-size", "64", "--data-dir",
                "d_1", "--no-download"],
               ["--checkpoint", "a", "--image_size", "64", "--data_dir=d_1",
                "--no_download"]):
    args = ap.parse_args(argv)
    assert (args.image_size, args.data_dir, args.no_download) == (64, "d_1",
                                                                  True)
  with pytest.raises(SystemExit):  # an unknown option stays unknown
    ap.parse_args(["--checkpoint", "a", "--image_sizes", "64"])
  # Values are left alone.
  args = ap.parse_args(["--checkpoint", "my_dir", "--dataset", "a_b"])
  assert args.checkpoint == "my_dir" and args.dataset == "a_b"


@pytest.mark.parametrize("tool", sorted(PARSERS))
def test_every_tool_spells_its_options_with_dashes(tool):
  ap = PARSERS[tool]()
  assert isinstance(ap, console.Parser)
  longs = [s for a in ap._actions for s in a.option_strings  # pylint: disable=protected-access
           if s.startswith("--")]
  assert longs and not [s for s in longs if "_" in s], longs
  if tool not in ("probe",):
    assert {"--checkpoint", "--model", "--image-size"} <= set(longs)
    help_text = " ".join(ap.format_help().split())
    assert "a pretrained name" in help_text and (
        "vit_small_patch14_reg4_dinov2.lvd142m" in help_text)


def test_weights_cli_takes_both_spellings(tmp_path):
  p = subprocess.run([PYTHON, "-m", "vit_jax.weights", "--help"], cwd=REPO,
                     env=env(), capture_output=True, text=True, timeout=120)
  assert p.returncode == 0 and "--image-size" in p.stdout
  p = subprocess.run([PYTHON, "-m", "vit_jax.weights", str(tmp_path / "no.pth"),
                      str(tmp_path / "o.safetensors"), "--image_size", "32"],
                     cwd=REPO, env=env(), capture_output=True, text=True,
                     timeout=120)
  assert p.returncode == 1 and "no such file" in p.stderr.lower(), p.stderr


def test_a_missing_dataset_names_the_tools_own_flags(tmp_path, monkeypatch,
                                                     capsys):
  from vit_jax.data import sources  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(sources, "_online", lambda *a, **k: False)
  from compare import random_ours  # pylint: disable=import-outside-toplevel
  from vit_jax import formats  # pylint: disable=import-outside-toplevel
  model, variables = random_ours(num_layers=1, size=32)
  ckpt = str(tmp_path / "w.safetensors")
  formats.save_safetensors(variables, ckpt, model=model)
  assert evaluate.main(["--checkpoint", ckpt, "--dataset", "cifar10",
                        "--data-dir", str(tmp_path / "tfds")]) == 1
  err = capsys.readouterr().err
  assert "then pass --data-dir=" in err and "--config." not in err, err
  assert evaluate.main(["--checkpoint", ckpt, "--dataset", "cifar10",
                        "--data-dir", str(tmp_path / "tfds"),
                        "--no-download"]) == 1
  err = capsys.readouterr().err
  assert "--no-download was given" in err and "--config." not in err, err


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
  """Our safetensors of a classic ViT (its architecture recorded)."""
  from compare import random_ours  # pylint: disable=import-outside-toplevel
  from vit_jax import formats  # pylint: disable=import-outside-toplevel
  from PIL import Image  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  d = tmp_path_factory.mktemp("names")
  model, variables = random_ours(num_layers=1, size=32)
  formats.save_safetensors(variables, str(d / "w.safetensors"), model=model)
  Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(d / "x.png")
  return d


# Names checked where they are typed, in every tool that takes --model: a
# misspelt architecture (the close names), a misspelt tag (the tags), a
# known name of another architecture (the difference).
BAD_MODELS = [
    ("vit_small_patch16_dinov33", r"not a model name vit_jax knows \(did you "
                                  r"mean vit_small_patch16_dinov3"),
    ("vit_small_patch16_dinov3.lvd1689", r"invalid pretrained tag 'lvd1689'"
                                         r".*vit_small_patch16_dinov3.lvd1689m"),
    ("vit_small_patch16_dinov3", r"not a vit_small_patch16_dinov3: they have "
                                 r"0 registers \(the name: 4 registers\)"),
]
TOOLS = {
    "predict": lambda d: (predict.main, [str(d / "x.png")]),
    "evaluate": lambda d: (evaluate.main, ["--dataset", "cifar10",
                                           "--data-dir", str(d / "tfds")]),
    "visualize": lambda d: (visualize.main, [str(d / "x.png"), "--out",
                                             str(d / "viz")]),
    "features": lambda d: (features.main, ["--dataset", "cifar10",
                                           "--data-dir", str(d / "tfds"),
                                           "--out", str(d / "f.npz")]),
    "export": lambda d: (export_cli.main, ["--format", "stablehlo", "--out",
                                           str(d / "x.shlo")]),
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
@pytest.mark.parametrize("model,says", BAD_MODELS, ids=["arch", "tag", "other"])
def test_every_tool_checks_the_model_name(tool, model, says, tiny_ckpt,
                                          capsys):
  import re  # pylint: disable=import-outside-toplevel
  main, rest = TOOLS[tool](tiny_ckpt)
  rc = main(["--checkpoint", str(tiny_ckpt / "w.safetensors"), "--model",
             model] + rest)
  err = capsys.readouterr().err
  assert rc == 1 and re.search(says, err), (tool, err)


def test_weights_cli_tries_in_order_in_one_process(tmp_path, capsys):
  """``--then``: train.py's fallbacks (the recipe's name, then only what
  was stated) in one child; the error and exit status are the last try's,
  the last line of the output says which try was written."""
  import json  # pylint: disable=import-outside-toplevel

  import torch  # pylint: disable=import-outside-toplevel
  import torchvision  # pylint: disable=import-outside-toplevel
  from vit_jax import weights  # pylint: disable=import-outside-toplevel
  from vit_jax.weights import __main__ as weights_cli  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  tv = torchvision.models.VisionTransformer(  # width 32: no usual heads
      image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=32,
      mlp_dim=64, num_classes=3)
  pth = str(tmp_path / "tiny.pth")
  torch.save(tv.state_dict(), pth)
  out = str(tmp_path / "o.safetensors")
  args = [pth, out, "--model", "vit_b_16", "--overrides", '{"num_heads": 2}']
  assert weights_cli.main(args) == 3  # one try: not ViT-B/16's sizes
  assert "try" not in capsys.readouterr().out
  unnamed = {"model": None, "overrides": {}}
  assert weights_cli.main(args + ["--then", json.dumps([unnamed])]) == 5
  err = capsys.readouterr().err
  assert err.startswith("error: ") and "num_heads" in err, err
  import os  # pylint: disable=import-outside-toplevel
  assert not os.path.exists(out)
  headed = {"model": None, "overrides": {"num_heads": 2}}
  assert weights_cli.main(args + ["--then", json.dumps([unnamed,
                                                        headed])]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[-1] == "try 2" and lines[0].startswith(out), lines
  assert weights.load(out).model.num_heads == 2
