"""vit_jax.visualize: the sown attention probabilities against a NumPy
recomputation, rollout and position-embedding similarity on known inputs,
and the CLI's PNG files (random weights, generated images)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from vit_jax import convert, formats, models
from vit_jax import visualize as vis

SIZE = 48  # 3x3 patches of 16 + the class token: 10 tokens


def random_model(seed=0, **kw):
  model = models.get_model("vit_ti_16", **{"num_classes": 10, "num_layers": 2,
                                           **kw})
  variables = model.init(jax.random.key(seed), jnp.zeros((1, SIZE, SIZE, 3)))
  leaves, tdef = jax.tree_util.tree_flatten(variables)
  rng = np.random.default_rng(seed)
  leaves = [np.asarray(l) + 0.1 * rng.standard_normal(np.shape(l)).astype(
      np.float32) for l in leaves]
  return model, jax.tree_util.tree_unflatten(tdef, leaves)


def images(n=2, seed=0):
  return np.random.default_rng(seed).standard_normal(
      (n, SIZE, SIZE, 3)).astype(np.float32)


def _layer_norm(x, p):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + 1e-6) * p["scale"] + p["bias"]


def numpy_attention(block_params, x):
  """softmax(q k^T / sqrt(d_head)) of one block, in float64 NumPy."""
  a = block_params["MultiHeadDotProductAttention_0"]
  y = _layer_norm(x, block_params["LayerNorm_0"])
  q = np.einsum("bnd,dhk->bnhk", y, a["query"]["kernel"]) + a["query"]["bias"]
  k = np.einsum("bnd,dhk->bnhk", y, a["key"]["kernel"]) + a["key"]["bias"]
  logits = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1])
  logits -= logits.max(-1, keepdims=True)
  e = np.exp(logits)
  return e / e.sum(-1, keepdims=True)


def test_sown_attention_equals_a_numpy_recomputation():
  model, variables = random_model()
  x = images()
  w = vis.attention_weights(model, variables, x)
  assert w.shape == (2, 2, 3, 10, 10)  # (layers, batch, heads, N, N)
  np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
  _, state = model.apply(variables, x, train=False, mutable=["intermediates"])
  inter = state["intermediates"]
  p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64),
                             variables["params"])
  stem = np.asarray(inter["stem"][0], np.float64).reshape(2, 9, 192)
  cls = np.broadcast_to(p["cls"], (2, 1, 192))
  tokens = np.concatenate([cls, stem], 1) + p["Transformer"]["posembed_input"][
      "pos_embedding"]
  inputs = [tokens, np.asarray(inter["block00"][0], np.float64)]
  for i in range(2):
    want = numpy_attention(p["Transformer"][f"encoderblock_{i}"], inputs[i])
    np.testing.assert_allclose(w[i], want, atol=2e-5, err_msg=f"layer {i}")


def test_scanned_model_gives_the_same_attention():
  model, variables = random_model()
  x = images(1)
  scanned = model.clone(scan_layers=True)
  w = vis.attention_weights(model, variables, x)
  ws = vis.attention_weights(scanned, convert.stack_layers(variables), x)
  np.testing.assert_allclose(ws, w, atol=1e-6)


def test_rollout_on_known_attention():
  grid, n = (3, 3), 10
  uniform = np.full((4, 2, n, n), 1.0 / n)  # 4 layers, 2 heads
  r = vis.attention_rollout(uniform, grid, prefix=1)
  np.testing.assert_allclose(r, np.full(grid, r[0, 0]))
  # Every token attends to patch 5 only (row 1, col 2 of the grid).
  focus = np.zeros((3, 2, n, n))
  focus[..., 1 + 5] = 1.0
  r = vis.attention_rollout(focus, grid, prefix=1)
  assert np.unravel_index(np.argmax(r), grid) == (1, 2)
  # One layer: rollout is 0.5 * mean-over-heads + 0.5 * identity.
  rng = np.random.default_rng(0)
  a = rng.random((1, 2, n, n))
  a /= a.sum(-1, keepdims=True)
  want = (0.5 * a[0].mean(0) + 0.5 * np.eye(n))[0, 1:].reshape(grid)
  np.testing.assert_allclose(vis.attention_rollout(a, grid, 1), want)


def test_class_attention_with_and_without_class_token():
  rng = np.random.default_rng(0)
  w = rng.random((3, 10, 10))
  np.testing.assert_array_equal(vis.class_attention(w, (3, 3), 1),
                                w[:, 0, 1:].reshape(3, 3, 3))
  w9 = rng.random((3, 9, 9))  # 'gap': attention received, mean over queries
  np.testing.assert_allclose(vis.class_attention(w9, (3, 3), 0),
                             w9.mean(1).reshape(3, 3, 3))


def test_posemb_similarity():
  _, variables = random_model()
  sim = vis.posemb_similarity(variables, prefix=1)
  assert sim.shape == (3, 3, 3, 3)
  flat = sim.reshape(9, 9)
  np.testing.assert_allclose(np.diag(flat), 1.0, atol=1e-12)
  np.testing.assert_allclose(flat, flat.T, atol=1e-12)
  pe = np.asarray(variables["params"]["Transformer"]["posembed_input"][
      "pos_embedding"], np.float64)[0, 1:]
  cos = pe[2] @ pe[7] / np.linalg.norm(pe[2]) / np.linalg.norm(pe[7])
  assert sim[0, 2, 2, 1] == pytest.approx(cos, abs=1e-12)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("vis")
  rng = np.random.default_rng(0)
  out = {}
  for name, shape in (("a.png", (60, 80, 3)), ("b.jpg", (48, 48, 3))):
    out[name] = str(d / name)
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(out[name])
  out["bad.png"] = str(d / "bad.png")
  open(out["bad.png"], "w").write("no")
  model, variables = random_model()
  out["npz"] = str(d / "random.npz")
  formats.save_npz(variables, out["npz"])
  gap_model, gap_vars = random_model(seed=1, classifier="gap")
  out["gap"] = str(d / "gap.safetensors")
  formats.save_safetensors(gap_vars, out["gap"], model=gap_model)
  out["dir"] = str(d)
  return out


def _is_png(path):
  with Image.open(path) as im:
    return im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100


def test_cli_writes_pngs_and_reports_bad_images(files, tmp_path, capsys):
  out = str(tmp_path / "pics")
  code = vis.main(["--checkpoint", files["npz"], "--out", out, "--layer", "0",
                   files["a.png"], files["bad.png"], files["b.jpg"]])
  assert code == 1
  captured = capsys.readouterr()
  assert "bad.png: not an image" in captured.err
  want = {"posemb_similarity.png", "a_attention_layer0.png", "a_rollout.png",
          "b_attention_layer0.png", "b_rollout.png"}
  assert set(os.listdir(out)) == want
  assert all(_is_png(os.path.join(out, f)) for f in want)
  assert all(os.path.join(out, f) in captured.out for f in want)


def test_gap_model_and_last_layer(files, tmp_path):
  out = str(tmp_path / "gap")
  assert vis.main(["--checkpoint", files["gap"], "--out", out,
                   files["a.png"]]) == 0
  assert {"a_attention_layer1.png", "a_rollout.png",
          "posemb_similarity.png"} == set(os.listdir(out))


def test_cli_errors(files, tmp_path, capsys):
  assert vis.main(["--checkpoint", files["npz"], "--layer", "5",
                   "--out", str(tmp_path)]) == 1
  assert "layer=5: the model has 2 layers" in capsys.readouterr().err
  assert vis.main(["--checkpoint", str(tmp_path / "nothing.npz"),
                   files["a.png"]]) == 1
  assert "no such file" in capsys.readouterr().err


def test_feature_pca_finds_the_known_directions():
  """Features = a * u + b * v + small noise (a, b on a grid): the first two
  components follow a and b (up to sign), fitted jointly over two grids."""
  rng = np.random.default_rng(0)
  u, v = np.linalg.qr(rng.standard_normal((16, 2)))[0].T
  a = np.linspace(-3, 3, 6)[:, None] * np.ones((1, 5))  # varies by row
  b = np.ones((6, 1)) * np.linspace(-1, 1, 5)[None]  # by column
  g1 = a[..., None] * u + b[..., None] * v + 1e-3 * rng.standard_normal(
      (6, 5, 16))
  g2 = g1[::2]  # another grid size (a and b stay uncorrelated)
  r1, r2 = vis.feature_pca([g1, g2])
  assert r1.shape == (6, 5, 3) and r2.shape == (3, 5, 3)
  assert r1.min() >= 0 and r1.max() <= 1
  for comp, truth in ((0, a), (1, b)):
    c = np.corrcoef(r1[..., comp].ravel(), truth.ravel())[0, 1]
    assert abs(c) > 0.999, (comp, c)
  # Joint fit: g2's patches are g1's rows, so they get the same colours.
  np.testing.assert_allclose(r2, r1[::2], rtol=0, atol=1e-9)


def test_pca_picture_at_a_high_non_square_resolution(files, tmp_path, capsys):
  """--pca runs the model (trained at 48 px, 3x3 patches) with
  dynamic_img_size on a 60x80 image at a short side of 96 px: a 6x8 grid."""
  out = str(tmp_path / "pca")
  assert vis.main(["--checkpoint", files["npz"], "--out", out, "--pca",
                   "--pca_size", "96", "--no_posemb", files["a.png"],
                   files["b.jpg"]]) == 0
  assert {"a_feature_pca.png", "b_feature_pca.png", "a_rollout.png",
          "b_rollout.png", "a_attention_layer1.png",
          "b_attention_layer1.png"} == set(os.listdir(out))
  assert _is_png(os.path.join(out, "a_feature_pca.png"))
  loaded = vis.weights.load(files["npz"])
  img = vis.image_files.read_image(files["a.png"])
  x = vis.pca_input(img, loaded.preprocessing, 96, 16)
  assert x.shape == (96, 128, 3)
  grid = vis.make_patch_features_fn(loaded.model, 1)(loaded.variables, x[None])
  assert grid.shape == (1, 6, 8, 192)
  dyn = loaded.model.clone(dynamic_img_size=True)
  want = dyn.apply(loaded.variables, x[None], method=dyn.forward_intermediates,
                   norm=True, intermediates_only=True)[1]
  np.testing.assert_allclose(grid, want, rtol=1e-5, atol=1e-5)


def test_register_model_without_embedded_prefix_is_drawn(tmp_path):
  """A DINOv2-with-registers layout: 1 + 4 prefix tokens, none of them in
  the position embedding."""
  model, variables = random_model(num_registers=4, no_embed_class=True)
  pe = variables["params"]["Transformer"]["posembed_input"]["pos_embedding"]
  assert pe.shape == (1, 9, 192) and vis.num_prefix_tokens(model) == 5
  path = str(tmp_path / "reg.safetensors")
  formats.save_safetensors(variables, path, model=model)
  Image.fromarray(np.zeros((48, 48, 3), np.uint8)).save(tmp_path / "z.png")
  out = str(tmp_path / "out")
  assert vis.main(["--checkpoint", path, "--out", out, "--pca",
                   str(tmp_path / "z.png")]) == 0
  assert "posemb_similarity.png" in os.listdir(out)


def _titles(monkeypatch):
  """The titles visualize gives its pictures, as they are saved."""
  seen = []
  save = vis._save  # pylint: disable=protected-access

  def recording(fig, path, title=None):
    seen.append(title)
    return save(fig, path, title)

  monkeypatch.setattr(vis, "_save", recording)
  return seen


def test_titles_name_a_class_only_for_a_class_head(files, tmp_path,
                                                    monkeypatch):
  """A 10-class head: the titles say what it predicts; the same backbone
  without a head (0 classes): attention, rollout and PCA pictures, and no
  class in any title."""
  titles = _titles(monkeypatch)
  assert vis.main(["--checkpoint", files["npz"], "--out",
                   str(tmp_path / "head"), "--no-posemb", files["a.png"]]) == 0
  assert len(titles) == 2 and all("; predicted 'class " in t for t in titles)
  model, variables = random_model(num_classes=0)
  path = str(tmp_path / "backbone.safetensors")
  formats.save_safetensors(variables, path, model=model)
  del titles[:]
  out = str(tmp_path / "backbone")
  assert vis.main(["--checkpoint", path, "--out", out, "--pca",
                   files["a.png"]]) == 0
  assert {"a_attention_layer1.png", "a_rollout.png", "a_feature_pca.png",
          "posemb_similarity.png"} == set(os.listdir(out))
  assert len(titles) == 4
  assert not any("predicted" in (t or "") or "'class " in (t or "")
                 for t in titles), titles
