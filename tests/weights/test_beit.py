"""BEiT (timm's ``Beit``: BEiT, BEiT v2; transformers' ``BeitModel`` and
``Data2VecVisionModel``) against the libraries' own models: the
relative position bias (``rel_pos_bias``: a table per block, or one shared
table), q/v biases without a key bias, LayerScale, mean pooling with
``fc_norm`` or the class token, an optional learned position embedding.

timm's models with 2 blocks on small non-square grids, every float weight
perturbed (``+ 0.02 * randn``: LayerScale's 1e-5, the zero tables and the
head all matter), against ours through ``formats.from_timm``: logits and
``forward_features`` within 1e-5 relative (float32, highest precision);
``formats.to_timm`` loads strictly, bit for bit, in timm's key order; the
twin rebuilt from our fields is timm's ``Beit``. A table made for one grid
runs at another as timm's BEiT does (``resize_rel_pos_bias_table``: at
load with ``image_size``, in the forward pass with ``dynamic_img_size``).
transformers' models load from ``save_pretrained`` directories and go
back strictly, bit for bit.
"""

import re

import jax
import numpy as np
import pytest
import torch

from compare import apply, assert_close_rel, images, perturb_torch, torch_in
from vit_jax import formats, models
from vit_jax.models import relpos

timm = pytest.importorskip("timm")
from timm.models import beit as timm_beit  # noqa: E402

REL = 1e-5
NARROW = dict(embed_dim=192, num_heads=3)  # the head width of base / large


def timm_beit_model(name, grid, seed=0, **kw):
  torch.manual_seed(seed)
  m = timm.create_model(name, pretrained=False, depth=2,
                        img_size=(16 * grid[0], 16 * grid[1]), num_classes=7,
                        **{**NARROW, **kw})
  return perturb_torch(m, seed, std=0.02)


def _x(grid, seed=0):
  return images(2, 16 * grid[1], seed=seed, height=16 * grid[0])


# (timm name or None (the keys alone), timm options, grid in patches).
CASES = [
    ("beit_base_patch16_224", {}, (4, 3)),  # a table per block, avg + fc_norm
    ("beitv2_large_patch16_224", {}, (3, 4)),  # LayerScale 1e-5
    # What no released name has, from the keys alone: one shared table with
    # a learned position embedding; class-token pooling with a final norm.
    (None, dict(use_rel_pos_bias=False, use_shared_rel_pos_bias=True,
                use_abs_pos_emb=True), (3, 4)),
    (None, dict(global_pool="token"), (4, 3)),
]
IDS = ["beit", "beitv2", "shared+abs", "token"]


@pytest.mark.parametrize("name, kw, grid", CASES, ids=IDS)
def test_beit_matches_timm_both_ways(name, kw, grid, record_property):
  from vit_jax.weights import twins  # pylint: disable=import-outside-toplevel
  m = timm_beit_model(name or "beit_base_patch16_224", grid, **kw)
  model, variables = formats.from_timm(m.state_dict(), name, num_heads=3)
  want = ("shared" if kw.get("use_shared_rel_pos_bias") else "block")
  assert (model.rel_pos_bias, model.key_bias) == (want, False)
  assert model.classifier == ("token" if kw.get("global_pool") else "gap")
  x = _x(grid)
  with torch.no_grad():
    ref = m(torch_in(x)).numpy()
    ref_feats = m.forward_features(torch_in(x)).numpy()
  with jax.default_matmul_precision("highest"):
    feats = apply(model, variables, x, method=model.forward_features)
    got = apply(model, variables, feats, method=model.forward_head)
  rel = assert_close_rel(got, ref, REL)
  frel = assert_close_rel(feats, ref_feats, REL, what="forward_features")
  record_property("rel_err", rel.rel)
  print(f"\nPARITY {name or 'Beit ' + str(kw)} {grid}: logits rel "
        f"{rel.rel:.2g}, forward_features rel {frel.rel:.2g}")
  back = formats.to_timm(variables)
  assert list(back) == list(m.state_dict())  # timm's own order
  timm_beit_model(name or "beit_base_patch16_224", grid, seed=1,
                  **kw).load_state_dict(back, strict=True)
  for k, v in m.state_dict().items():
    assert torch.equal(back[k], v), k
  twin = twins.timm_model(model, variables, (16 * grid[0], 16 * grid[1]))
  assert type(twin) is timm_beit.Beit
  with torch.no_grad():
    np.testing.assert_array_equal(twin(torch_in(x)).numpy(), ref)


def test_scanned_blocks_and_xla_attention_give_the_same_logits():
  """The tables scan with the blocks; the bias goes through XLA's
  attention as through the materialised probabilities."""
  grid = (3, 4)
  m = timm_beit_model("beit_base_patch16_224", grid)
  x = _x(grid)
  with torch.no_grad():
    ref = m(torch_in(x)).numpy()
  for kw in (dict(scan_layers=True), dict(attention_impl="xla")):
    model, variables = formats.from_timm(m.state_dict(),
                                         "beit_base_patch16_224",
                                         num_heads=3, **kw)
    with jax.default_matmul_precision("highest"):
      assert_close_rel(apply(model, variables, x), ref, REL, what=str(kw))


@pytest.mark.parametrize("size", [(6, 6), (5, 7), (3, 3)],
                         ids=["up", "non-square", "down"])
def test_another_grid_as_timms_beit(size):
  """Weights made for a 4x4 grid at another size: timm builds its model
  there and resizes the tables on load (checkpoint_filter_fn); ours does
  the same with image_size=, and in the forward pass with
  dynamic_img_size."""
  m = timm_beit_model("beit_base_patch16_224", (4, 4))
  sd = m.state_dict()
  big = timm.create_model("beit_base_patch16_224", depth=2, num_classes=7,
                          img_size=(16 * size[0], 16 * size[1]),
                          **NARROW).eval()
  big.load_state_dict(timm_beit.checkpoint_filter_fn(dict(sd), big),
                      strict=True)
  x = _x(size, seed=1)
  with torch.no_grad():
    ref = big(torch_in(x)).numpy()
  loaded = formats.from_timm(sd, "beit_base_patch16_224", num_heads=3,
                             image_size=(16 * size[0], 16 * size[1]))
  dynamic = formats.from_timm(sd, "beit_base_patch16_224", num_heads=3,
                              dynamic_img_size=True)
  for what, (model, variables) in (("image_size", loaded),
                                   ("dynamic", dynamic)):
    with jax.default_matmul_precision("highest"):
      assert_close_rel(apply(model, variables, x), ref, REL, what=what)


def test_index_and_resize_are_timms():
  from timm.layers import resize_rel_pos_bias_table  # pylint: disable=import-outside-toplevel
  for grid in ((4, 4), (3, 5), (1, 2)):
    np.testing.assert_array_equal(
        relpos.position_index(grid),
        timm_beit.gen_relative_position_index(grid).numpy())
  table = torch.randn(relpos.table_rows((4, 4)), 3)
  for new in ((7, 7), (6, 9), (2, 2)):
    ref = resize_rel_pos_bias_table(
        table, new_window_size=new,
        new_bias_shape=(relpos.table_rows(new), 3)).numpy()
    np.testing.assert_allclose(relpos.resize_table(table.numpy(), new), ref,
                               rtol=0, atol=2e-6)


def test_what_the_bias_cannot_do_is_refused():
  grid = (4, 4)
  m = timm_beit_model("beit_base_patch16_224", grid)
  model, variables = formats.from_timm(m.state_dict(), num_heads=3)
  with pytest.raises(ValueError, match="relative position bias: its table "
                     "is made for a 4x4 patch grid, the input gives 3x4.*"
                     "image_size="):
    model.apply(variables, _x((3, 4)))
  with pytest.raises(ValueError, match="cuDNN path does not take"):
    model.clone(attention_impl="cudnn").apply(variables, _x(grid))
  with pytest.raises(ValueError, match="one class token"):
    models.get_model("vit_ti_16", rel_pos_bias="block", num_registers=4).init(
        jax.random.key(0), np.zeros((1, 32, 32, 3), np.float32))
  # A shared table is not the name's structure (a table per block).
  shared = timm_beit_model("beit_base_patch16_224", grid,
                           use_rel_pos_bias=False,
                           use_shared_rel_pos_bias=True)
  with pytest.raises(ValueError, match=re.escape(
      "relative position bias 'shared' (the name: relative position bias "
      "'block')")):
    formats.from_timm(shared.state_dict(), "beit_base_patch16_224",
                      num_heads=3)


def test_classic_tree_has_no_table():
  """The option adds parameters only when on."""
  model = models.get_model("vit_ti_16", num_classes=3)
  shapes = jax.eval_shape(model.init, jax.random.key(0),
                          np.zeros((1, 32, 32, 3), np.float32))
  assert not any("rel_pos_bias" in "/".join(str(p) for p in path)
                 for path, _ in jax.tree_util.tree_leaves_with_path(shapes))
  beit = models.get_model("beit_base_patch16_224", num_layers=1,
                          image_size=32)
  flat = jax.eval_shape(beit.init, jax.random.key(0),
                        np.zeros((1, 32, 32, 3), np.float32))["params"]
  table = flat["Transformer"]["encoderblock_0"][
      "MultiHeadDotProductAttention_0"]["rel_pos_bias"]["table"]
  assert table.shape == (relpos.table_rows((2, 2)), 12)


# transformers' BEiT and Data2Vec-Vision: (model class, config class,
# config options), each from a save_pretrained directory (the files' v4
# names) and from its state_dict (v5 names), exported back strictly.
HF_CASES = [
    ("BeitForImageClassification", "BeitConfig", {}),
    ("BeitModel", "BeitConfig", dict(use_mean_pooling=False)),
    ("BeitModel", "BeitConfig", dict(
        use_relative_position_bias=False,
        use_shared_relative_position_bias=True,
        use_absolute_position_embeddings=True)),
    ("Data2VecVisionForImageClassification", "Data2VecVisionConfig", {}),
]


@pytest.mark.parametrize("cls, config, kw", HF_CASES,
                         ids=["beit-cls", "beit-token", "beit-shared",
                              "data2vec-cls"])
def test_transformers_beit_both_ways(cls, config, kw, tmp_path,
                                     record_property):
  transformers = pytest.importorskip("transformers")
  cls, config = getattr(transformers, cls), getattr(transformers, config)
  c = dict(hidden_size=192, num_hidden_layers=2, num_attention_heads=3,
           intermediate_size=768, image_size=64, patch_size=16,
           use_relative_position_bias=True, layer_scale_init_value=0.1,
           num_labels=5)
  c.update(kw)
  torch.manual_seed(0)
  m = perturb_torch(cls(config(**c)), 0, std=0.02)
  m.save_pretrained(tmp_path)
  x = _x((4, 4))
  with torch.no_grad():
    out = m(pixel_values=torch_in(x))
  ref = out.logits if hasattr(out, "logits") else out.pooler_output
  model, variables = formats.from_transformers(str(tmp_path))
  assert model.rel_pos_bias == ("shared" if kw.get(
      "use_shared_relative_position_bias") else "block")
  assert model.layer_norm_eps == 1e-12
  with jax.default_matmul_precision("highest"):
    rel = assert_close_rel(apply(model, variables, x), ref.numpy(), REL)
    with torch.no_grad():
      hidden = m.base_model(pixel_values=torch_in(x)).last_hidden_state
    assert_close_rel(apply(model, variables, x,
                           method=model.forward_features),
                     hidden.numpy(), REL, what="last_hidden_state")
  record_property("rel_err", rel.rel)
  print(f"\nPARITY transformers {cls.__name__} {kw}: rel {rel.rel:.2g}")
  layout = ("transformers_data2vec_vision" if "Data2Vec" in cls.__name__
            else None)
  back = formats.to_transformers(variables, layout)
  assert list(back) == list(m.state_dict())
  cls(config(**c)).load_state_dict(back, strict=True)
  for k, v in m.state_dict().items():
    assert torch.equal(back[k], v), k
