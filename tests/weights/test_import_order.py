"""Loading after ``import tensorflow``: every format, in a process that
imported TensorFlow (and tensorflow_datasets) first, as a notebook or a
training script does. torchvision and timm import triton, whose native
library crashed such a process (exit 139) as soon as a 1,000-class
checkpoint looked up ImageNet's names through torchvision."""

import json
import os
import subprocess

import numpy as np
import torch

import hf_cache
from compare import random_ours
from train_helpers import PYTHON, REPO, env
from vit_jax.train import checkpoint
from vit_jax import convert, formats
from vit_jax.data import labels

SIZE = 32


def _files(d):
  """Every kind of source weights.load reads, of one 1,000-class ViT."""
  model, variables = random_ours("vit_ti_16", num_classes=1000, num_layers=2,
                                 size=SIZE)
  out = {}
  out["npz"] = str(d / "w.npz")
  formats.save_npz(variables, out["npz"])
  out["ours.safetensors"] = str(d / "ours.safetensors")
  formats.save_safetensors(variables, out["ours.safetensors"], model=model)
  out["timm.safetensors"] = str(d / "timm.safetensors")
  formats.save_safetensors(variables, out["timm.safetensors"], layout="timm")
  out["torchvision.pth"] = str(d / "tv.pth")
  torch.save(convert.to_torchvision(variables), out["torchvision.pth"])
  out["timm.pth"] = str(d / "timm.pth")
  torch.save(formats.to_timm(variables), out["timm.pth"])
  hub = d / "timm_hub"
  hub.mkdir()
  formats.save_safetensors(variables, str(hub / "model.safetensors"),
                           layout="timm")
  (hub / "config.json").write_text(json.dumps(
      {"architecture": "vit_tiny_patch16_224", "num_classes": 1000,
       "pretrained_cfg": {"input_size": [3, SIZE, SIZE]}}))
  out["timm model dir"] = str(hub)
  hf = d / "hf"
  hf.mkdir()
  formats.save_safetensors(variables, str(hf / "model.safetensors"),
                           layout="transformers")
  (hf / "config.json").write_text(json.dumps(
      {"model_type": "vit", "hidden_size": 192, "num_hidden_layers": 2,
       "num_attention_heads": 3, "intermediate_size": 768,
       "image_size": SIZE, "patch_size": 16, "layer_norm_eps": 1e-6}))
  out["transformers model dir"] = str(hf)
  cache = d / "hub_cache"
  hf_cache.put(str(cache), "timm/vit_tiny_patch16_224.test", str(hub))
  out["hf-hub"] = "hf-hub:timm/vit_tiny_patch16_224.test"
  m = checkpoint.CheckpointManager(str(d / "run" / "checkpoints"), keep=1)
  m.save(1, {"variables": variables, "train": {"step": np.int32(1)}},
         {"model_name": "vit_ti_16",
          "model_kwargs": {"num_classes": 1000, "num_layers": 2},
          "image_size": SIZE, "mean": [0.5] * 3, "std": [0.5] * 3, "step": 1})
  m.close()
  out["orbax workdir"] = str(d / "run")
  return out, str(cache)


_CHILD = r"""
import json, sys
import tensorflow as tf  # first, as a notebook or a training script
import tensorflow_datasets as tfds
from vit_jax import convert, weights
from vit_jax.weights import files
sources = json.loads(sys.argv[1])
for kind, src in sources.items():
  loaded = weights.load(src, model_name="vit_tiny_patch16_224"
                        if "timm" in kind and "dir" not in kind else None)
  print(json.dumps([kind, loaded.num_classes, loaded.label(0)]), flush=True)
enum = files.torchvision_weights("vit_b_16", "IMAGENET1K_V1")
print("torchvision:IMAGENET1K_V1", len(enum.meta["categories"]), flush=True)
tv = convert.to_torchvision_model(loaded.variables, "vit_ti_16",
                                  num_layers=2)
print("to_torchvision_model", type(tv).__name__, flush=True)
"""


def test_every_format_loads_after_import_tensorflow(tmp_path):
  sources, cache = _files(tmp_path)
  e = env()
  e.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=cache)
  p = subprocess.run([PYTHON, "-c", _CHILD, json.dumps(sources)], cwd=REPO,
                     env=e, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, (p.returncode, p.stdout, p.stderr[-3000:])
  lines = p.stdout.splitlines()
  got = [json.loads(l) for l in lines[:-2]]
  assert [k for k, _, _ in got] == list(sources), p.stdout
  for kind, n, first in got:  # ImageNet's names (a training run has its own)
    assert (n, first) == (1000, "class 0" if kind == "orbax workdir" else
                          "tench"), kind
  assert lines[-2:] == ["torchvision:IMAGENET1K_V1 1000",
                        "to_torchvision_model VisionTransformer"]


def test_predict_cli_after_tensorflow(tmp_path):
  """The CLIs load weights after their own TensorFlow import."""
  sources, _ = _files(tmp_path)
  from PIL import Image  # pylint: disable=import-outside-toplevel
  image = tmp_path / "x.png"
  Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(image)
  code = ("import tensorflow, runpy, sys; sys.argv = ['predict', "
          "'--checkpoint', sys.argv[1], sys.argv[2]]; "
          "runpy.run_module('vit_jax.predict', run_name='__main__')")
  for src in (sources["npz"], sources["timm.pth"]):
    p = subprocess.run([PYTHON, "-c", code, src, str(image)], cwd=REPO,
                       env=env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert "x.png" in p.stdout


def test_imagenet_names_are_torchvisions():
  """The copy we ship (looked up without torchvision) is torchvision's."""
  from torchvision.models._meta import _IMAGENET_CATEGORIES  # pylint: disable=import-outside-toplevel
  assert labels.imagenet_categories() == list(_IMAGENET_CATEGORIES)
  with open(labels._GENERATED, encoding="utf-8") as f:  # pylint: disable=protected-access
    assert f.read() == labels._generated_source(_IMAGENET_CATEGORIES)  # pylint: disable=protected-access
  assert os.path.basename(labels._GENERATED) == "_imagenet_categories.py"  # pylint: disable=protected-access
