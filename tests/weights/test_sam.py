"""Segment Anything's image encoder (timm's ``VisionTransformerSAM``,
``samvit_*``) loaded both ways, against timm.

One reduced timm model stands for the family: 2 blocks (block 0 windowed,
block 1 global), width 192 (3 heads), 128 px images, i.e. an 8x8 patch grid
in windows of 6 patches (padded to 12: four windows, a third of their
tokens padding), decomposed relative positions in both blocks, a neck of
32 channels and a 5-class head; every float of its state dict perturbed
(0.02 * randn: the rel-pos tables start at zero, the head too).
``formats.from_timm(state_dict, 'samvit_base_patch16')`` reads the window
and the global block from the weights' rel-pos tables (the name's window
of 14 and global blocks 2, 5, 8, 11 stand where the tables cannot show
them) and must give timm's neck map (``forward_features``, NCHW there,
NHWC here) and logits within 1e-5 (float32, highest matmul precision);
``formats.to_timm`` loads back into timm strictly, bit for bit.
transformers' ``SamVisionModel`` of that shape, from a ``save_pretrained``
directory, the same both ways. The
released names (1024 px, 12-32 blocks) are checked by
``tests/weights/test_registry.py`` (``-k samvit``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compare import assert_close_rel, images, perturb_torch, torch_in
from vit_jax import formats, models
from vit_jax.weights import layouts, twins
from vit_jax.weights.check import expected

timm = pytest.importorskip("timm")
torch = pytest.importorskip("torch")

TOL = 1e-5
NAME = "samvit_base_patch16"
SIZE = 128
KWARGS = dict(depth=2, embed_dim=192, num_heads=3, img_size=SIZE,
              window_size=6, global_attn_indexes=(1,), neck_chans=32,
              num_classes=5)


@pytest.fixture(autouse=True)
def _highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(scope="module")
def sam():
  """(timm model, its state dict, images, timm's neck map, timm's logits)."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    torch.manual_seed(0)
    m = perturb_torch(timm.create_model(NAME, pretrained=False, **KWARGS),
                      std=0.02)
    x = images(2, SIZE)
    with torch.no_grad():
      feats = m.forward_features(torch_in(x)).numpy()
      logits = m.forward_head(torch.from_numpy(feats)).numpy()
  finally:
    torch.set_num_threads(threads)
  sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
  return m, sd, x, feats, logits


@pytest.fixture(scope="module")
def loaded(sam):
  return formats.from_timm(sam[1], NAME)


def _features(model, variables, x):
  return np.asarray(jax.jit(lambda v, x: model.apply(
      v, x, method=model.forward_features))(variables, x))


def _run(model, variables, x):
  feats = _features(model, variables, x)
  logits = jax.jit(lambda v, f: model.apply(
      v, f, method=model.forward_head))(variables, feats)
  return feats, np.asarray(logits)


def test_from_timm_equals_timm(sam, loaded):
  _, _, x, feats, logits = sam
  model, variables = loaded
  # What the tables show (window 6, block 1 global), not the name's 14.
  assert (model.window_size, model.global_attn_indexes) == (6, (1,))
  assert model.rel_pos and model.neck_chans == 32
  assert model.layer_norm_eps == 1e-5 and model.num_prefix_tokens == 0
  got_feats, got_logits = _run(model, variables, x)
  neck = assert_close_rel(got_feats, feats.transpose(0, 2, 3, 1), TOL,
                          "neck map")
  head = assert_close_rel(got_logits, logits, TOL)
  print(f"neck map rel {neck.rel:.2e}, logits rel {head.rel:.2e}")
  whole = jax.jit(lambda v, x: model.apply(v, x))(variables, x)
  np.testing.assert_allclose(whole, got_logits, rtol=0,
                             atol=TOL * head.scale)


def test_queries_in_chunks_equal_timm_and_all_at_once(sam, loaded,
                                                      monkeypatch):
  """Long sequences (SAM's global blocks at 1024 px: 4096 tokens) take the
  queries in chunks, without the (B, H, N, N) bias and weights. Chunks of
  16 here (the global block's 64 tokens in 4, each padded window's 144 in
  9) give timm's neck map and logits, and the gradients of the whole
  sequence at once."""
  from vit_jax.models import sam as sam_lib  # pylint: disable=import-outside-toplevel
  _, _, x, feats, logits = sam
  model, variables = loaded
  monkeypatch.setattr(sam_lib, "QUERY_CHUNK", 16)
  assert sam_lib.query_chunks(64) == 4 and sam_lib.query_chunks(144) == 9
  got_feats, got_logits = _run(model, variables, x)
  assert_close_rel(got_feats, feats.transpose(0, 2, 3, 1), TOL, "neck map")
  assert_close_rel(got_logits, logits, TOL)

  def grads():  # train=True, no dropout: the chunked path takes gradients
    loss = lambda p: jnp.sum(model.apply(  # noqa: E731
        {**variables, "params": p}, x, train=True) ** 2)
    return jax.jit(jax.grad(loss))(variables["params"])

  chunked = grads()
  monkeypatch.setattr(sam_lib, "QUERY_CHUNK", 10 ** 9)
  assert sam_lib.query_chunks(64) == 1
  whole = grads()
  top = max(float(np.abs(b).max()) for b in jax.tree_util.tree_leaves(whole))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(chunked),
                          jax.tree_util.tree_leaves(whole)):
    a, b, key = np.asarray(a), np.asarray(b), jax.tree_util.keystr(path)
    if "['key']['bias']" in key:  # zero but for rounding: the softmax
      assert np.abs(a).max() < 1e-6 * top, key  # cancels q . b_k
    else:
      assert_close_rel(a, b, TOL, key)


@pytest.mark.parametrize("norm", [False, True])
def test_intermediates_are_timms(sam, loaded, norm):
  """forward_intermediates as timm's (NCHW; with ``norm`` each block's
  output through the neck, as timm's SAM does)."""
  m, _, x, feats, _ = sam
  model, variables = loaded
  with torch.no_grad():
    want_final, want = m.forward_intermediates(torch_in(x), norm=norm)
  final, got = jax.jit(lambda v, x: model.apply(
      v, x, method=model.forward_intermediates, norm=norm,
      output_fmt="NCHW"))(variables, x)
  assert_close_rel(final, want_final.numpy().transpose(0, 2, 3, 1), TOL)
  assert len(got) == len(want) == 2
  for g, w in zip(got, want):
    assert_close_rel(g, w.numpy(), TOL, "intermediate")


def test_to_timm_round_trip_is_strict_and_exact(sam, loaded):
  m, sd, _, _, _ = sam
  back = formats.to_timm(loaded[1])
  assert list(back) == list(sd)  # timm's own order
  for k, v in sd.items():
    assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
  fresh = timm.create_model(NAME, pretrained=False, **KWARGS)
  fresh.load_state_dict(back, strict=True)


def test_timm_twin(sam, loaded):
  """The PyTorch twin (ONNX export, to_torch) is timm's SAM class, loaded
  strictly: timm's logits."""
  _, _, x, _, logits = sam
  net = twins.timm_model(*loaded)
  assert type(net).__name__ == "VisionTransformerSAM"
  with torch.no_grad():
    got = net(torch_in(x)).numpy()
  assert_close_rel(got, logits, 1e-6)


def test_windows_positions_and_neck_matter(sam, loaded):
  """The check is not vacuous: global attention in every block, or no
  relative positions, or another window, give other numbers."""
  _, _, x, feats, _ = sam
  model, variables = loaded
  want = feats.transpose(0, 2, 3, 1)
  scale = np.abs(want).max()
  flat = jax.tree_util.tree_map(np.asarray, variables)
  no_rel = jax.tree_util.tree_map_with_path(
      lambda p, v: np.zeros_like(v) if "rel_pos" in jax.tree_util.keystr(p)
      else v, flat)
  for other, v in ((model.clone(window_size=0), variables),
                   (model.clone(window_size=4), variables),
                   (model, no_rel)):
    got = _features(other, v, x)
    assert np.abs(got - want).max() > 1e-3 * scale


def test_other_sizes_resize_as_timm(sam, loaded):
  """At another input size (96 px: a 6x6 grid, one window, no padding)
  timm resamples the position grid (antialiased bicubic) and the global
  block's rel-pos tables (linear): so does a dynamic_img_size model."""
  m, _, _, _, _ = sam
  model, variables = loaded
  x = images(1, 96, seed=1)
  with torch.no_grad():
    want = m.forward_features(torch_in(x)).numpy().transpose(0, 2, 3, 1)
  dyn = model.clone(dynamic_img_size=True, image_size=SIZE)
  got = _features(dyn, variables, x)
  assert_close_rel(got, want, TOL, "neck map at 96 px")


def test_sam_checkpoint_names_load(sam, loaded):
  """SAM's own checkpoints (image_encoder.*, mlp.lin1 / lin2, beside the
  prompt encoder and mask decoder) load as timm's filter renames them."""
  sd = sam[1]
  theirs = {("image_encoder." + k).replace(".mlp.fc", ".mlp.lin"): v
            for k, v in sd.items()}
  theirs["prompt_encoder.point_embeddings.0.weight"] = torch.zeros(1, 256)
  theirs["mask_decoder.iou_token.weight"] = torch.zeros(1, 256)
  _, variables = formats.from_timm(theirs, NAME)
  same = jax.tree_util.tree_map(lambda a, b: np.array_equal(a, b),
                                variables, loaded[1])
  assert all(jax.tree_util.tree_leaves(same))


@pytest.fixture(scope="module")
def hf_sam(tmp_path_factory):
  """transformers' SamVisionModel of the same shape (its config's window
  and global block), perturbed, saved with ``save_pretrained``:
  (model, directory, images, its neck map (NCHW))."""
  transformers = pytest.importorskip("transformers")
  config = transformers.SamVisionConfig(
      hidden_size=192, num_hidden_layers=2, num_attention_heads=3,
      image_size=SIZE, window_size=6, global_attn_indexes=(1,),
      output_channels=32)
  torch.manual_seed(0)
  net = perturb_torch(transformers.SamVisionModel(config), std=0.02)
  path = tmp_path_factory.mktemp("sam_hf")
  net.save_pretrained(path)
  x = images(2, SIZE, seed=2)
  with torch.no_grad():
    want = net(pixel_values=torch_in(x)).last_hidden_state.numpy()
  return net, str(path), x, want


def test_transformers_sam_vision_model_both_ways(hf_sam):
  """A save_pretrained directory loads by its config (epsilon 1e-6 in the
  blocks, as transformers' SAM), gives its last_hidden_state (the neck
  map), and goes back into SamVisionModel strictly, bit for bit."""
  net, path, x, want = hf_sam
  model, variables = formats.from_transformers(path)
  assert (model.window_size, model.global_attn_indexes) == (6, (1,))
  assert model.layer_norm_eps == 1e-6 and model.neck_chans == 32
  got = _features(model, variables, x)
  neck = assert_close_rel(got, want.transpose(0, 2, 3, 1), TOL, "neck map")
  print(f"transformers neck map rel {neck.rel:.2e}")
  back = formats.to_transformers(variables)
  sd = net.state_dict()
  assert list(back) == list(sd)
  for k, v in sd.items():
    assert torch.equal(back[k], v), k
  fresh = type(net)(net.config)
  fresh.load_state_dict(back, strict=True)


def test_refusals(sam, loaded):
  model, variables = loaded
  x = sam[2]
  with pytest.raises(ValueError, match="cuDNN"):
    model.clone(attention_impl="cudnn").apply(variables, x)
  with pytest.raises(ValueError, match="scan_layers"):
    model.clone(scan_layers=True).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="prefix tokens"):
    model.clone(class_token=True).init(jax.random.key(0), x)
  with pytest.raises(layouts.Undecided, match="samvit_base_patch16"):
    formats.from_timm(sam[1])  # no name: the window is not in the weights
  with pytest.raises(ValueError, match="without its conv neck"):
    formats.from_timm(sam[1], "samvit_base_patch16_224")


def test_listed_names_are_timms_architectures():
  """The released names' records: timm's windows, global blocks, neck and
  exact parameter count (timm's model on the meta device)."""
  from vit_jax.weights.verify import meta_device  # pylint: disable=import-outside-toplevel
  listed = set(models.VARIANTS) | set(
      n for n in __import__("vit_jax").list_models("samvit*"))
  assert {"samvit_base_patch16", "samvit_large_patch16",
          "samvit_huge_patch16"} <= listed
  assert "samvit_base_patch16_224" not in listed
  model = models.get_model(NAME)
  assert (model.window_size, model.global_attn_indexes) == (14, (2, 5, 8, 11))
  assert model.rel_pos and model.neck_chans == 256 and model.dynamic_img_size
  with meta_device():
    m = timm.create_model(NAME, pretrained=False)
  ours = sum(int(np.prod(s)) for k, s in expected(model).items()
             if k.startswith("params/"))
  assert ours == sum(p.numel() for p in m.parameters())
