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
  """One step from ``init`` at ``size`` px (learning rate 0), evaluated on
  the first 64 test digits: what these tests check is the start, not the
  score (SAM's windows pad a 2x2 grid to 14x14: the whole split was 17 s)."""
  o = dict(init_weights=str(init), image_size=size, optimizer="sgd",
           learning_rate=0.0, total_steps=1, eval_every=1, checkpoint_every=1,
           eval_split="test[:64]")
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
cfg.model_name, cfg.model.num_heads = "vit_small_patch14_reg4_dinov2", 2
init = train_init.load_initial_weights(
    cfg, stated=("model_name", "model.num_heads"))
assert init.arch["num_registers"] == 4, init.arch
print("TORCH_IMPORTED", "torch" in sys.modules)
"""
  p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(),
                     capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "TORCH_IMPORTED False" in p.stdout, p.stdout


def test_a_size_stated_on_the_command_line_is_checked(tmp_path):
  """A size the user states (``stated``: train.py's --config.model.*) that
  the weights contradict is refused naming both values; the recipe's
  (here tiny_config's num_heads=4 in Python) gives way to the weights'
  whenever it does not describe them."""
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
  path = tmp_path / "w.safetensors"
  save_file({k: v.contiguous() for k, v in _timm_dinov2_reg().state_dict().items()},
            str(path))
  cfg = _finetune(path, 28, model_name="vit_small_patch14_reg4_dinov2",
                  **{"model.num_layers": 2, "model.patch_size": 14})
  with pytest.raises(weights.CheckpointError, match=r"The checkpoint has "
                     r"num_layers=1, not 2 as given.*--config.model.<size> on "
                     r"the command line"):
    train_init.load_initial_weights(
        cfg, stated=("model.num_layers", "model.num_heads"))
  # The recipe's sizes are not these weights': its heads are not taken for
  # theirs (width 32 has no usual number), and the error says what to pass.
  with pytest.raises(weights.CheckpointError, match=r"width 32 is not a "
                     r"standard ViT width.*In train.py: "
                     r"--config.model.num_heads=N .*the recipe's "
                     r"'vit_small_patch14_reg4_dinov2' \(.*layers 2.*\) does "
                     r"not describe these weights"):
    train_init.load_initial_weights(cfg)
  init = train_init.load_initial_weights(cfg, stated=("model.num_heads",))
  assert (init.arch["num_layers"], init.arch["num_heads"]) == (1, 2)
  assert init.model_name == "vit_small_patch14_reg4_dinov2"  # its name fits
  assert "the recipe's model (layers 2) is not used" in init.note, init.note
  assert "as given: heads 2" in init.note, init.note
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
  # The workdir exports (no position embedding: the run's image size, or
  # the size asked), each artifact verified in its runtime.
  from vit_jax import export  # pylint: disable=import-outside-toplevel
  assert export.servable(str(tmp_path / "run")).image_size == 32
  for fmt, size in (("stablehlo", 64), ("onnx", 48)):
    s = export.servable(str(tmp_path / "run"), image_size=size)
    assert s.image_size == size and s.preprocessing.crop_size == size
    out = export.export(s, fmt, str(tmp_path / f"run.{fmt}"))
    assert float(export.verify(s, fmt, out)) < 1e-5, fmt


# ---------------------------------------------------------------------------
# A recipe written for another model, fine-tuned from files of other sizes:
# the weights decide the architecture (what the user asks on the command
# line is applied: a patch size resampled; what contradicts them stops the
# run at once, naming the difference).
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vit_ti_file(tmp_path_factory):
  """timm's ViT-Ti/16 (3 heads) at depth 2, perturbed, as safetensors."""
  import timm  # pylint: disable=import-outside-toplevel
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  m = perturb_torch(timm.create_model("vit_tiny_patch16_224", depth=2,
                                      pretrained=False), 0)
  path = tmp_path_factory.mktemp("vit_ti") / "vit_tiny.safetensors"
  sd = {k: v.contiguous() for k, v in m.state_dict().items()}
  save_file(sd, str(path))
  return path, {k: v.numpy() for k, v in sd.items()}


def _recipe(config, **kw):
  """A recipe's config (its model fields untouched) as a one-step run on
  the digits at learning rate 0."""
  from train_helpers import apply_overrides, tiny_overrides  # pylint: disable=import-outside-toplevel
  o = {k: v for k, v in tiny_overrides().items()
       if not k.startswith("model") and k != "image_size"}
  o.update(total_steps=1, eval_every=1, checkpoint_every=1, log_every=1,
           optimizer="sgd", learning_rate=0.0, warmup_steps=0)
  o.update(kw)
  return apply_overrides(config, o)


def _start_note(workdir):
  from train_helpers import start_rows  # pylint: disable=import-outside-toplevel
  return start_rows(workdir)[-1]["model_source"]


@pytest.mark.parametrize("patch", [None, 8])
def test_digits_recipe_from_a_vit_ti_file_trains_vit_ti(tmp_path, vit_ti_file,
                                                        patch):
  """configs/digits.py (width 96, 4 heads, patch 4) with timm's ViT-Ti/16:
  the trained model is ViT-Ti (3 heads, width 192, the file's patch kernel
  as it is), or at the patch size asked on the command line (resampled)."""
  from configs import digits  # pylint: disable=import-outside-toplevel
  path, sd = vit_ti_file
  kw = {} if patch is None else {"model.patch_size": patch}
  cfg = _recipe(digits.get_config(), init_weights=str(path), **kw)
  train_loop.train_and_evaluate(cfg, str(tmp_path), devices=ONE,
                                stated=tuple(kw))
  model, variables, info = orbax.load_for_inference(str(tmp_path))
  assert (model.num_heads, model.hidden_size, model.num_layers,
          model.mlp_dim) == (3, 192, 2, 768)
  kernel = variables["params"]["embedding"]["kernel"]
  note = _start_note(tmp_path)
  assert ("the recipe's model (model_name 'vit_digits_4'; "
          + ("patch 4, " if patch is None else "") +
          "width 96, layers 4, heads 4, MLP 192) is not used") in note, note
  assert info["model_name"] == "vit"  # not the recipe's name
  if patch is None:
    assert model.patch_size == 16
    np.testing.assert_array_equal(  # the file's kernel, not resampled
        kernel, sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0))
    assert "a 1x1 grid of 16 px patches" in note, note
  else:
    assert model.patch_size == 8 and kernel.shape == (8, 8, 3, 192)
    assert "as given: patch 8 (the patch-embedding kernel resampled" in note


def test_b16_recipe_at_a_tiny_size_from_a_vit_ti_file(tmp_path, vit_ti_file):
  """configs/b16.py names vit_b_16: with a ViT-Ti file that name is not
  used, and the trained model is ViT-Ti/16."""
  from configs import b16  # pylint: disable=import-outside-toplevel
  path, _ = vit_ti_file
  cfg = _recipe(b16.get_config("digits,32"), init_weights=str(path),
                **{"model.dtype": "float32", "pp.crop": "resize",
                   "pp.flip": False})
  train_loop.train_and_evaluate(cfg, str(tmp_path), devices=ONE)
  model, _, _ = orbax.load_for_inference(str(tmp_path))
  assert (model.num_heads, model.patch_size, model.hidden_size) == (3, 16, 192)
  assert "the recipe's model (model_name 'vit_b_16') is not used" in (
      _start_note(tmp_path))


def test_a_contradicting_command_line_size_stops_train_py_at_once(
    tmp_path, vit_ti_file):
  """train.py tells the fields set on its command line: a size the weights
  contradict stops the run before any step, naming both values; a model
  name of another architecture too, naming the difference."""
  from train_helpers import digits_data_dir, run, train_cmd  # pylint: disable=import-outside-toplevel
  path, _ = vit_ti_file
  p = run(train_cmd(str(tmp_path / "run"), {
      "init_weights": str(path), "data_dir": digits_data_dir(),
      "model.hidden_size": 96}), check=False, timeout=300)
  assert p.returncode == 1, p.stderr[-3000:]
  assert "The checkpoint has hidden_size=192, not 96 as given" in p.stderr
  assert not (tmp_path / "run" / "checkpoints").exists() or not list(
      (tmp_path / "run" / "checkpoints").iterdir())
  from configs import digits  # pylint: disable=import-outside-toplevel
  cfg = _recipe(digits.get_config(), init_weights=str(path),
                model_name="vit_small_patch16_dinov3")
  with pytest.raises(weights.CheckpointError, match=r"not a "
                     r"vit_small_patch16_dinov3: they have 0 registers \(the "
                     r"name: 4 registers\).*--config.model_name="
                     r"vit_small_patch16_dinov3 is not these weights' name"):
    train_init.load_initial_weights(cfg, stated=("model_name",))


def test_digits_recipe_from_a_transformers_vit_of_another_size(tmp_path):
  """A transformers ViT directory (64 wide, 2 heads, patch 8: its
  config.json says) under configs/digits.py: its architecture is kept."""
  import transformers  # pylint: disable=import-outside-toplevel
  from configs import digits  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  m = perturb_torch(transformers.ViTModel(transformers.ViTConfig(
      image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=1,
      num_attention_heads=2, intermediate_size=128), add_pooling_layer=False),
                    0).eval()
  m.save_pretrained(tmp_path / "hf_vit")
  cfg = _recipe(digits.get_config(), init_weights=str(tmp_path / "hf_vit"))
  train_loop.train_and_evaluate(cfg, str(tmp_path / "run"), devices=ONE)
  model, _, _ = orbax.load_for_inference(str(tmp_path / "run"))
  assert (model.num_heads, model.patch_size, model.hidden_size,
          model.num_layers, model.mlp_dim) == (2, 8, 64, 1, 128)
  assert "'vit_digits_4'" in _start_note(tmp_path / "run")


def test_digits_recipe_from_a_torchvision_vit_of_another_size(tmp_path):
  """A torchvision state dict (converted in a child process) 64 wide: its
  heads are not stored and 64 has no usual number, so the recipe's 4 (of
  another model) are not taken for them: the run stops naming what to
  pass; with --config.model.num_heads=2 the model is the file's."""
  import torchvision  # pylint: disable=import-outside-toplevel
  from configs import digits  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  tv = torchvision.models.VisionTransformer(
      image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=64,
      mlp_dim=128, num_classes=3)
  torch.save(tv.state_dict(), tmp_path / "tv.pth")
  cfg = _recipe(digits.get_config(), init_weights=str(tmp_path / "tv.pth"))
  with pytest.raises(weights.CheckpointError, match=r"width 64 is not a "
                     r"standard ViT width.*In train.py: "
                     r"--config.model.num_heads=N"):
    train_init.load_initial_weights(cfg)
  cfg = _recipe(digits.get_config(), init_weights=str(tmp_path / "tv.pth"),
                **{"model.num_heads": 2})
  init = train_init.load_initial_weights(cfg, stated=("model.num_heads",))
  model = train_init.build_model(init.model_name,
                                 train_init.model_kwargs(cfg, 10, init))
  assert (model.num_heads, model.patch_size, model.hidden_size,
          model.num_classes) == (2, 8, 64, 10)
  assert "as given: heads 2" in init.note, init.note


def test_digits_recipe_from_a_dinov3_file_says_what_to_pass(tmp_path):
  """An Eva file (DINOv3) whose rotary embedding only a name gives: the
  run stops with the train.py flag to pass; given, it loads."""
  import timm  # pylint: disable=import-outside-toplevel
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
  from configs import digits  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  m = timm.create_model("vit_small_patch16_dinov3", pretrained=False, depth=1,
                        num_classes=0)
  save_file({k: v.contiguous() for k, v in m.state_dict().items()},
            str(tmp_path / "d3.safetensors"))
  cfg = _recipe(digits.get_config(), init_weights=str(tmp_path /
                                                       "d3.safetensors"))
  with pytest.raises(weights.CheckpointError, match=r"rotary position "
                     r"embedding is not stored.*In train.py: "
                     r"--config.model_name=<their timm name>"):
    train_init.load_initial_weights(cfg)
  cfg = _recipe(digits.get_config(), init_weights=str(tmp_path /
                                                       "d3.safetensors"),
                model_name="vit_small_patch16_dinov3")
  init = train_init.load_initial_weights(cfg, stated=("model_name",))
  assert (init.arch["rope"], init.arch["num_heads"]) == ("dinov3", 6)
  assert init.model_name == "vit_small_patch16_dinov3"


# ---------------------------------------------------------------------------
# The timm-only families: a file of timm's weights fine-tunes as any other.
# ---------------------------------------------------------------------------

# timm name -> its constructor's options: the name's widths and heads, one
# block (the depth is the weights'), 32 px images (a 2x2 grid of patches;
# SAM's first block attends within its name's 14x14 windows, padded).
TIMM_FAMILY_FILES = {
    "beit": ("beit_base_patch16_224", {}),
    "cait": ("cait_xxs24_224", {}),
    "relpos": ("vit_relpos_small_patch16_224", {}),
    "sam": ("samvit_base_patch16", dict(num_classes=0)),
}


@pytest.mark.parametrize("family", sorted(TIMM_FAMILY_FILES))
def test_finetune_from_a_timm_family_file(tmp_path, family):
  """BEiT (relative position tables), CaiT (class attention, talking
  heads), timm's relpos ViT (a position MLP) and SAM's encoder (windows,
  decomposed positions, the neck; no head in the file): a safetensors file
  of timm's weights with its name fine-tunes through train.py's loop (a new
  10-class head, learning rate 0), and the trained workdir's features are
  timm's."""
  import timm  # pylint: disable=import-outside-toplevel
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
  name, kw = TIMM_FAMILY_FILES[family]
  torch.manual_seed(0)
  m = perturb_torch(timm.create_model(
      name, pretrained=False, img_size=32, depth=1, **kw), 0, std=0.1,
                    weights_only=True)
  path = tmp_path / f"{family}.safetensors"
  save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(path))
  cfg = _finetune(path, 32, model_name=name)
  train_loop.train_and_evaluate(cfg, str(tmp_path / "run"), devices=ONE,
                                stated=("model_name",))
  model, variables, info = orbax.load_for_inference(str(tmp_path / "run"))
  assert model.num_classes == 10 and info["model_name"] == name
  x = images(2, 32, seed=3)
  with torch.no_grad():
    ref = m.forward_features(torch_in(x)).numpy()
  if family == "sam":  # timm's NCHW neck map; ours NHWC
    ref = ref.transpose(0, 2, 3, 1)
  assert_close_rel(apply(model, variables, x, method=model.forward_features),
                   ref, what=f"fine-tuned {family} features")
