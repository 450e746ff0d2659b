"""Configs and optimizer pieces: every recipe loads and documents its command,
parameter strings, locked overrides, warmup clamping, schedules, weight decay."""

import importlib

import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import config_flags

import train_helpers  # noqa: F401  (repo on sys.path)
from vit_jax.train import optim

RECIPES = ["digits", "b16", "ti16", "s16", "l16", "h14", "dinov2", "dinov3",
           "r50_b16"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_loads_and_documents_its_command(name):
  mod = importlib.import_module(f"configs.{name}")
  assert mod.__doc__.strip().startswith(
      f"python train.py --config configs/{name}.py"), mod.__doc__[:200]
  assert "xpect" in mod.__doc__  # "Expect ..." / "Expected ...": the result
  c = mod.get_config()
  assert c.total_steps > 0 and c.batch_size > 0
  assert c.model_name.startswith("vit_")


def test_b16_parameter_string():
  from configs import b16
  c = b16.get_config()
  assert (c.dataset, c.image_size, c.init_weights) == ("cifar10", 224,
                                                       "IMAGENET1K_V1")
  assert (c.optimizer, c.momentum, c.grad_clip_norm, c.batch_size) == (
      "sgd", 0.9, 1.0, 512)
  assert c.schedule == "cosine" and c.warmup_steps == 500
  assert c.model.dtype == "bfloat16"
  c = b16.get_config("cifar100,384")
  assert (c.dataset, c.image_size) == ("cifar100", 384)
  c = b16.get_config("imagenet2012")
  assert c.eval_split == "validation" and c.total_steps == 20_000
  c = b16.get_config("cifar10,scratch")
  assert c.init_weights == "" and c.optimizer == "adamw"
  assert c.pp.randaugment_layers == 2 and c.pp.mixup_alpha > 0
  from configs import h14, l16, ti16
  assert ti16.get_config().init_weights == ""  # no torchvision Ti weights
  assert l16.get_config().fsdp == -1 and h14.get_config().model.scan_layers


def test_r50_b16_recipe_fine_tunes_the_hybrid():
  from configs import r50_b16
  c = r50_b16.get_config()
  assert c.model_name == "vit_base_r50_s16_224"
  assert c.init_weights == "vit_base_r50_s16_224.orig_in21k"
  from vit_jax.weights import pretrained  # the name is a record
  assert pretrained.lookup(c.init_weights).hub == (
      "timm/vit_base_r50_s16_224.orig_in21k")
  assert (c.optimizer, c.momentum, c.batch_size) == ("sgd", 0.9, 512)
  c = r50_b16.get_config("cifar100,384")
  assert (c.dataset, c.image_size) == ("cifar100", 384)


def test_dinov2_recipes():
  from configs import dinov2
  c = dinov2.get_config()
  assert c.init_weights == "hf-hub:timm/vit_base_patch14_reg4_dinov2.lvd142m"
  assert c.model_name == "vit_base_patch14_reg4_dinov2"
  assert c.image_size == 224 and c.layer_decay == 0.75 and not c.linear_probe
  c = dinov2.get_config("l,cifar100,probe,448")
  assert c.model_name == "vit_large_patch14_reg4_dinov2"
  assert (c.dataset, c.image_size, c.linear_probe, c.optimizer) == (
      "cifar100", 448, True, "sgd")
  with pytest.raises(ValueError, match="not a multiple of the patch size 14"):
    dinov2.get_config("s,224,digits,100")


def test_dinov3_recipes():
  from configs import dinov3
  c = dinov3.get_config()
  assert c.init_weights == "hf-hub:timm/vit_base_patch16_dinov3.lvd1689m"
  assert c.model_name == "vit_base_patch16_dinov3" and c.layer_decay == 0.75
  c = dinov3.get_config("splus,cifar100,probe,256")
  assert c.model_name == "vit_small_plus_patch16_dinov3"
  assert c.linear_probe and c.image_size == 256 and c.dataset == "cifar100"
  with pytest.raises(ValueError, match="not a multiple of the patch size 16"):
    dinov3.get_config("b,250")


def test_config_file_flag_with_argument_and_locked_overrides():
  from absl import flags

  def parse(*args):
    argv = ["prog", *args]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=fv,
                                    lock_config=True, sys_argv=argv)
    fv(argv)
    return fv.config

  c = parse(f"--config={train_helpers.REPO}/configs/b16.py:cifar100,384",
            "--config.total_steps=20", "--config.pp.flip=False")
  assert (c.dataset, c.image_size, c.total_steps, c.pp.flip) == (
      "cifar100", 384, 20, False)
  with pytest.raises(Exception, match="totl_steps"):
    parse(f"--config={train_helpers.REPO}/configs/digits.py",
          "--config.totl_steps=20")
  with pytest.raises(AttributeError, match="locked"):  # no new fields
    c.new_field = 1


def _parse(*args):
  from absl import flags
  argv = ["prog", *args]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=fv, lock_config=True,
                                  sys_argv=argv)
  fv(argv)
  return fv.config


@pytest.mark.parametrize("impl", ["cudnn", "xla", "matmul"])
def test_attention_impl_from_the_command_line_reaches_the_model(impl):
  from vit_jax.train import init as train_init
  c = _parse(f"--config={train_helpers.REPO}/configs/b16.py",
             f"--config.model.attention_impl={impl}")
  model = train_init.build_model(c.model_name,
                                 train_init.model_kwargs(c, 10))
  assert model.attention_impl == impl and model.num_classes == 10
  default = _parse(f"--config={train_helpers.REPO}/configs/digits.py")
  assert default.model.attention_impl is None  # the backend chooses
  assert train_init.build_model(default.model_name, train_init.model_kwargs(
      default, 10)).attention_impl is None


def test_an_unknown_attention_impl_is_a_clear_error_before_training():
  from vit_jax.train import loop as train_loop
  c = _parse(f"--config={train_helpers.REPO}/configs/digits.py",
             "--config.model.attention_impl=flash")
  with pytest.raises(ValueError, match=r"config.model.attention_impl='flash'"
                     r".*'matmul', 'xla', 'cudnn'"):
    train_loop.validate_config(c, num_devices=1, num_processes=1)
  with pytest.raises(ValueError, match="attention_impl='flash'"):
    train_loop.train_and_evaluate(c, "/nonexistent/never-created")


def test_overriding_total_steps_alone_clamps_warmup():
  from configs import b16
  c = b16.get_config()
  assert optim.warmup_steps(c) == 500
  c.total_steps = 20
  assert optim.warmup_steps(c) == 2
  lrs = np.array([float(optim.make_schedule(c)(s)) for s in range(20)])
  assert lrs[0] == pytest.approx(0.005) and lrs[1] == pytest.approx(0.01)
  assert np.all(np.diff(lrs[1:]) <= 0) and lrs[-1] < 1e-3
  c.total_steps = 3
  assert optim.warmup_steps(c) == 0


@pytest.mark.parametrize("schedule,mid", [("cosine", 0.5), ("linear", 0.5),
                                          ("constant", 1.0)])
def test_schedules(schedule, mid):
  from configs import digits
  c = digits.get_config()
  c.update(dict(schedule=schedule, learning_rate=1.0, warmup_steps=10,
                total_steps=110))
  f = optim.make_schedule(c)
  np.testing.assert_allclose([float(f(s)) for s in (0, 4, 9)], [0.1, 0.5, 1.0],
                             rtol=1e-6)
  assert float(f(60)) == pytest.approx(mid, abs=1e-6)


def test_weight_decay_only_on_kernels():
  params = {"embedding": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)},
            "cls": jnp.ones((1, 1, 2)),
            "Transformer": {"posembed_input": {"pos_embedding": jnp.ones((1, 3, 2))},
                            "encoder_norm": {"scale": jnp.ones(2)}}}
  mask = optim.decay_mask(params)
  assert mask["embedding"] == {"kernel": True, "bias": False}
  assert not mask["cls"] and not mask["Transformer"]["posembed_input"]["pos_embedding"]
  from configs import digits
  c = digits.get_config()
  c.update(dict(optimizer="sgd", weight_decay=0.5, learning_rate=1.0,
                warmup_steps=0, momentum=0.0, grad_clip_norm=0.0))
  tx = optim.make_optimizer(c)
  zeros = {k: v for k, v in params.items()}
  grads = jax_tree_zeros(zeros)
  updates, _ = tx.update(grads, tx.init(params), params)
  assert float(updates["embedding"]["kernel"][0, 0]) == pytest.approx(-0.5)
  assert float(updates["embedding"]["bias"][0]) == 0.0


def jax_tree_zeros(tree):
  import jax
  return jax.tree_util.tree_map(jnp.zeros_like, tree)


def _tiny_vit(scan=False):
  import jax
  from vit_jax import models
  m = models.get_model("vit_ti_16", num_layers=3, hidden_size=8, num_heads=2,
                       mlp_dim=16, num_classes=3, scan_layers=scan)
  return jax.eval_shape(lambda: m.init(jax.random.key(0),
                                       jnp.zeros((1, 32, 32, 3))))["params"]


@pytest.mark.parametrize("scan", [False, True])
def test_layer_decay_scales_each_depth(scan):
  """decay ** (L + 1 - layer): head at the full rate, block i at
  decay ** (L - i), the embeddings at decay ** (L + 1); scanned blocks get
  the same per-layer rates along their stacked axis."""
  import jax
  from configs import digits
  params = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape), _tiny_vit(scan))
  c = digits.get_config()
  c.update(dict(optimizer="sgd", learning_rate=1.0, warmup_steps=0,
                momentum=0.0, grad_clip_norm=0.0, layer_decay=0.5))
  tx = optim.make_optimizer(c)
  grads = jax.tree_util.tree_map(jnp.ones_like, params)
  up, _ = tx.update(grads, tx.init(params), params)
  L = 3
  assert float(up["head"]["kernel"][0, 0]) == -1.0
  assert float(up["Transformer"]["encoder_norm"]["scale"][0]) == -1.0
  assert float(up["embedding"]["kernel"].ravel()[0]) == -(0.5 ** (L + 1))
  assert float(up["Transformer"]["posembed_input"]["pos_embedding"].ravel()[0]) == -(0.5 ** (L + 1))
  for i in range(L):
    if scan:
      got = up["Transformer"]["encoderblock"]["LayerNorm_0"]["scale"][i, 0]
    else:
      got = up["Transformer"][f"encoderblock_{i}"]["LayerNorm_0"]["scale"][0]
    assert float(got) == -(0.5 ** (L - i)), i
  c.layer_decay = 1.5
  with pytest.raises(ValueError, match="layer_decay=1.5"):
    optim.make_optimizer(c)


def test_linear_probe_trains_the_head_only():
  import jax
  from configs import digits
  params = jax.tree_util.tree_map(lambda s: jnp.ones(s.shape), _tiny_vit())
  c = digits.get_config()
  c.update(dict(linear_probe=True, warmup_steps=0))
  tx = optim.make_optimizer(c)
  grads = jax.tree_util.tree_map(jnp.ones_like, params)
  up, _ = tx.update(grads, tx.init(params), params)
  moved = {jax.tree_util.keystr(p): bool(jnp.any(u != 0)) for p, u in
           jax.tree_util.tree_leaves_with_path(up)}
  assert moved["['head']['kernel']"] and moved["['head']['bias']"]
  assert not any(v for k, v in moved.items() if not k.startswith("['head']"))
