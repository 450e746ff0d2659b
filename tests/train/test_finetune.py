"""Fine-tuning with train.py from the ViTs people download: the weights
decide the architecture (registers, LayerScale, MAP head, activation ...),
the config the training options; PyTorch files are converted in a child
process, so torch never enters the training process."""

import subprocess
import sys

import jax
import numpy as np
import pytest
import torch

from compare import apply, assert_close_rel, images, perturb_torch, torch_in
from train_helpers import REPO, env, tiny_config
from vit_jax.weights import orbax
from vit_jax.train import checkpoint, init as train_init, loop as train_loop
from vit_jax import weights

ONE = jax.devices()[:1]
# tiny_config states these sizes; the weights below have them.
TINY = dict(hidden=32, heads=2, mlp=64, layers=1)


def _finetune(init, size, **kw):
  o = dict(init_weights=str(init), image_size=size, optimizer="sgd",
           learning_rate=0.0, total_steps=1, eval_every=1, checkpoint_every=1)
  o.update(kw)
  return tiny_config(**o)


def _timm_dinov2_reg(seed=0):
  import timm  # pylint: disable=import-outside-toplevel
  torch.manual_seed(seed)
  m = timm.create_model("vit_small_patch14_reg4_dinov2", pretrained=False,
                        depth=TINY["layers"], embed_dim=TINY["hidden"],
                        num_heads=TINY["heads"], mlp_ratio=2, img_size=28,
                        num_classes=0)
  return perturb_torch(m, seed, std=0.1).eval()


@pytest.mark.parametrize("fmt", ["safetensors", "pth"])
def test_finetune_from_dinov2_with_registers(tmp_path, fmt):
  m = _timm_dinov2_reg()
  path = tmp_path / f"dinov2_reg.{fmt}"
  sd = {k: v.contiguous() for k, v in m.state_dict().items()}
  if fmt == "pth":
    torch.save(sd, path)
  else:
    from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
    save_file(sd, str(path))
  cfg = _finetune(path, 28, model_name="vit_small_patch14_reg4_dinov2",
                  **{"model.patch_size": 14})
  train_loop.train_and_evaluate(cfg, str(tmp_path / "run"), devices=ONE)

  model, variables, info = orbax.load_for_inference(str(tmp_path / "run"))
  assert model.num_registers == 4 and model.layer_scale_init is not None
  assert model.hidden_size == 32 and model.patch_size == 14
  assert model.num_classes == 10 and info["model_name"] == (
      "vit_small_patch14_reg4_dinov2")
  np.testing.assert_array_equal(variables["params"]["head"]["kernel"],
                                np.zeros((32, 10)))
  # DINOv2's ImageNet statistics, from the weights' family.
  np.testing.assert_allclose(info["mean"], (0.485, 0.456, 0.406), rtol=1e-6)
  # lr 0: the backbone is timm's, number for number.
  x = images(2, 28, seed=3)
  with torch.no_grad():
    ref = m.forward_features(torch_in(x)).numpy()
  assert_close_rel(apply(model, variables, x, method=model.forward_features),
                   ref, what="fine-tuned DINOv2 features")


def test_finetune_from_hf_hub_siglip(tmp_path, monkeypatch):
  import transformers  # pylint: disable=import-outside-toplevel
  import hf_cache  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  m = perturb_torch(transformers.SiglipVisionModel(
      transformers.SiglipVisionConfig(
          image_size=32, patch_size=8, hidden_size=TINY["hidden"],
          num_hidden_layers=TINY["layers"],
          num_attention_heads=TINY["heads"],
          intermediate_size=TINY["mlp"])), 0).eval()
  folder = tmp_path / "siglip"
  m.save_pretrained(folder)
  transformers.SiglipImageProcessor(size={"height": 32, "width": 32}
                                    ).save_pretrained(folder)
  cache = str(tmp_path / "hub")
  hf_cache.put(cache, "google/siglip-tiny-test", str(folder))
  hf_cache.offline(monkeypatch, cache)
  cfg = _finetune("hf-hub:google/siglip-tiny-test", 32,
                  **{"model.scan_layers": True, "model.patch_size": 8})
  train_loop.train_and_evaluate(cfg, str(tmp_path / "run"), devices=ONE)

  model, variables, info = orbax.load_for_inference(str(tmp_path / "run"))
  assert model.classifier == "map" and model.patch_size == 8
  assert tuple(info["mean"]) == (0.5, 0.5, 0.5)
  x = images(2, 32, seed=5)
  with torch.no_grad():
    ref = m(pixel_values=torch_in(x)).last_hidden_state.numpy()
  assert_close_rel(apply(model, variables, x, method=model.forward_features),
                   ref, what="fine-tuned SigLIP features")


def test_torch_stays_out_of_the_training_process(tmp_path):
  """A .pth is converted by a child process; the training process reads the
  torch-free file it wrote."""
  torch.save({k: v.contiguous() for k, v in _timm_dinov2_reg().state_dict().items()},
             tmp_path / "w.pth")
  code = f"""
import sys
from configs import digits
from vit_jax.train import init as train_init
cfg = digits.get_config()
cfg.init_weights, cfg.image_size = {str(tmp_path / 'w.pth')!r}, 28
cfg.model_name = "vit_small_patch14_reg4_dinov2"
init = train_init.load_initial_weights(cfg)
assert init.arch["num_registers"] == 4, init.arch
print("TORCH_IMPORTED", "torch" in sys.modules)
"""
  p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(),
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "TORCH_IMPORTED False" in p.stdout, p.stdout


def test_a_backbone_config_states_other_sizes(tmp_path):
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
  path = tmp_path / "w.safetensors"
  save_file({k: v.contiguous() for k, v in _timm_dinov2_reg().state_dict().items()},
            str(path))
  cfg = _finetune(path, 28, model_name="vit_small_patch14_reg4_dinov2",
                  **{"model.num_heads": 4, "model.patch_size": 14})
  init = train_init.load_initial_weights(tiny_config(
      init_weights=str(path), image_size=28, **{"model.patch_size": 14},
      model_name="vit_small_patch14_reg4_dinov2"))
  with pytest.raises(ValueError, match=r"config.model.num_heads=4 but the "
                     r"initial weights .* have num_heads=2"):
    train_init.model_kwargs(cfg, 10, init)
  assert isinstance(weights.CheckpointError("x"), ValueError)


def test_dinov3_recipe_on_random_stand_in_weights(tmp_path):
  """configs/dinov3.py's smoke run (its docstring) in the test's budget:
  random stand-in weights of timm's DINOv3 S (one block) as safetensors,
  the recipe's optimizer and layer decay at learning rate 0: the trained
  workdir's backbone is timm's, RoPE and registers included."""
  import timm  # pylint: disable=import-outside-toplevel
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
  from configs import dinov3  # pylint: disable=import-outside-toplevel
  from train_helpers import digits_data_dir  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  m = perturb_torch(timm.create_model(
      "vit_small_patch16_dinov3", pretrained=False, depth=1, num_classes=0),
                    0, std=0.1, weights_only=True)
  path = tmp_path / "dinov3_s_random.safetensors"
  save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(path))
  cfg = dinov3.get_config("s,digits,32")
  for key, value in dict(
      init_weights=str(path), data_dir=digits_data_dir(), batch_size=16,
      eval_batch_size=64, total_steps=2, warmup_steps=1, eval_every=2,
      log_every=1, checkpoint_every=2, learning_rate=0.0, shuffle_buffer=256,
      write_plots=False, tensorboard=False).items():
    cfg[key] = value
  cfg.model.dtype = "float32"
  cfg.pp.randaugment_layers = 0
  cfg.lock()
  train_loop.train_and_evaluate(cfg, str(tmp_path / "run"), devices=ONE)
  model, variables, info = orbax.load_for_inference(str(tmp_path / "run"))
  assert (model.rope, model.num_registers, model.abs_pos_embed) == (
      "dinov3", 4, False)
  assert info["model_name"] == "vit_small_patch16_dinov3"
  np.testing.assert_allclose(info["mean"], (0.485, 0.456, 0.406), rtol=1e-6)
  x = images(2, 48, seed=3)  # RoPE: any multiple of 16 runs
  with torch.no_grad():
    ref = m.forward_features(torch_in(x)).numpy()
  assert_close_rel(apply(model, variables, x, method=model.forward_features),
                   ref, what="fine-tuned DINOv3 features")
