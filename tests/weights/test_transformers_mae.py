"""transformers' MAE encoder (``ViTMAEModel``, a ``ViTMAEForPreTraining``'s
encoder) and I-JEPA (``IJepaModel``, ``IJepaForImageClassification``)
against transformers itself: 2 blocks of width 32 in 2 heads, 32 px images
in 8 px patches (a 3x4 grid for the non-square I-JEPA), every float weight
perturbed (the MAE's sin-cos position table, its zero class-token row, the
zero classifier all matter); outputs within 1e-5 relative in float32 at
the highest matmul precision; ``to_transformers`` loads strictly, bit for
bit, in transformers' key order; ``save_pretrained`` directories and
``hf-hub:`` names from a local Hub cache load the same.

transformers' MAE masks at random in every forward: with ``mask_ratio=0``
it keeps every patch but still shuffles them by random noise (the order
``ids_restore`` undoes; a sorted ``noise`` keeps it). Ours is the encoder
on every patch in order, whatever ``mask_ratio`` the config says.
"""

import warnings

import jax
import numpy as np
import pytest
import torch

import hf_cache
from compare import (apply_with_features, assert_close_rel, images,
                     perturb_torch, torch_in)
from vit_jax import formats, weights

transformers = pytest.importorskip("transformers")

REL = 1e-5
SIZE, PATCH = 32, 8
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, patch_size=PATCH)
DECODER = "ViTMAEForPreTraining's decoder"


def _mae(seed=0, mask_ratio=0.0, **kw):
  """A ViTMAEForPreTraining (its encoder is ``.vit``), perturbed."""
  torch.manual_seed(seed)
  config = transformers.ViTMAEConfig(
      image_size=SIZE, decoder_hidden_size=16, decoder_num_hidden_layers=1,
      decoder_num_attention_heads=2, decoder_intermediate_size=32,
      mask_ratio=mask_ratio, **{**TINY, **kw})
  return perturb_torch(transformers.ViTMAEForPreTraining(config), seed)


def _in_order(n):
  """MAE's ``noise`` that keeps the patches in order (2 images)."""
  return torch.arange(float(n)).expand(2, n)


def _mae_reference(encoder, x):
  """transformers' ViTMAEModel on every patch, in order."""
  assert encoder.config.mask_ratio == 0.0
  n = (SIZE // PATCH) ** 2
  with torch.no_grad():
    out = encoder(pixel_values=torch_in(x), noise=_in_order(n))
  assert out.ids_restore.tolist() == [list(range(n))] * 2
  return out.last_hidden_state.numpy()


def _features(model, variables, x):
  with jax.default_matmul_precision("highest"):
    out, feats = apply_with_features(model, variables, x)
  return feats, out


def test_vit_mae_model_matches_transformers_both_ways(record_property):
  encoder = _mae(hidden_act="gelu_new", layer_norm_eps=1e-6).vit
  x = images(2, SIZE)
  model, variables = formats.from_transformers(encoder)  # its config
  assert (model.act, model.layer_norm_eps) == ("gelu_tanh", 1e-6)
  assert model.classifier == "token" and not model.num_classes
  ref = _mae_reference(encoder, x)
  feats, pooled = _features(model, variables, x)
  rel = assert_close_rel(feats, ref, REL, what="last_hidden_state")
  # No pooler: apply gives the class token of the final norm's tokens.
  assert_close_rel(pooled, ref[:, 0], REL, what="class token")
  record_property("rel_err", rel.rel)
  print(f"\nPARITY transformers ViTMAEModel: last_hidden_state rel "
        f"{rel.rel:.2g}")
  # mask_ratio=0 without noise: every patch, shuffled; ids_restore undoes it.
  with torch.no_grad():
    out = encoder(pixel_values=torch_in(x))
  shuffled = out.last_hidden_state.numpy()
  assert out.ids_restore.tolist() != [list(range(16))] * 2
  order = out.ids_restore.numpy()
  unshuffled = np.stack([np.concatenate([s[:1], s[1:][o]])
                         for s, o in zip(shuffled, order)])
  assert_close_rel(feats, unshuffled, REL, what="unshuffled")

  # Back: ViTModel's names without a pooler, which are ViTMAEModel's.
  for layout in (None, "transformers_vit_mae"):
    back = formats.to_transformers(variables, layout)
    assert list(back) == list(encoder.state_dict())
    for k, v in encoder.state_dict().items():
      assert torch.equal(back[k], v), k
  fresh = transformers.ViTMAEModel(encoder.config)  # its own sin-cos table
  pos = "embeddings.position_embeddings"
  assert not fresh.embeddings.position_embeddings.requires_grad
  assert not torch.equal(fresh.state_dict()[pos], back[pos])
  fresh.load_state_dict(back, strict=True)  # the table written back is used
  np.testing.assert_array_equal(_mae_reference(fresh.eval(), x), ref)


def test_vit_mae_pretraining_directory_loads_its_encoder(tmp_path):
  """A ViTMAEForPreTraining saved as the Hub's are (mask_ratio 0.75, the
  decoder, v4 names): the encoder loads, the decoder is named in one
  warning and left out."""
  m = _mae(seed=1, mask_ratio=0.75)
  m.save_pretrained(tmp_path)
  x = images(2, SIZE, seed=2)
  with pytest.warns(UserWarning, match=DECODER) as caught:
    model, variables = formats.from_transformers(str(tmp_path))
  assert len(caught) == 1 and "24 keys" in str(caught[0].message)
  m.config.mask_ratio = 0.0  # transformers on every patch, for reference
  feats, _ = _features(model, variables, x)
  assert_close_rel(feats, _mae_reference(m.vit, x), REL,
                   what="last_hidden_state")
  # The state dict of the whole model, without a config: the decoder's
  # keys tell the layout.
  with pytest.warns(UserWarning, match=DECODER):
    _, again = formats.from_transformers(m.state_dict(), num_heads=2)
  np.testing.assert_array_equal(
      again["params"]["Transformer"]["posembed_input"]["pos_embedding"],
      variables["params"]["Transformer"]["posembed_input"]["pos_embedding"])


def _ijepa_config(**kw):
  return transformers.IJepaConfig(**{**TINY, "image_size": SIZE, **kw})


def _ijepa(cls, seed=0, **kw):
  torch.manual_seed(seed)
  return perturb_torch(getattr(transformers, cls)(_ijepa_config(**kw)), seed)


def test_ijepa_model_matches_transformers_both_ways(record_property):
  m = _ijepa("IJepaModel")
  x = images(2, SIZE, seed=3)
  model, variables = formats.from_transformers(m)
  assert model.classifier == "gap" and not model.has_class_token
  with torch.no_grad():
    ref = m(pixel_values=torch_in(x)).last_hidden_state.numpy()
  feats, pooled = _features(model, variables, x)
  rel = assert_close_rel(feats, ref, REL, what="last_hidden_state")
  # transformers' classifier pools by the mean of these tokens: so do we.
  assert_close_rel(pooled, ref.mean(1), REL, what="mean")
  record_property("rel_err", rel.rel)
  print(f"\nPARITY transformers IJepaModel: last_hidden_state rel "
        f"{rel.rel:.2g}")
  back = formats.to_transformers(variables)
  assert list(back) == list(m.state_dict())
  transformers.IJepaModel(m.config).load_state_dict(back, strict=True)
  for k, v in m.state_dict().items():
    assert torch.equal(back[k], v), k
  # The keys alone (ViT's names without a class token), with a mask token
  # (masked-image pretraining only), which is not kept.
  sd = dict(m.state_dict(), **{"embeddings.mask_token": torch.ones(1, 1, 32)})
  model2, again = formats.from_transformers(sd, num_heads=2)
  assert model2.classifier == "gap"
  np.testing.assert_array_equal(_features(model2, again, x)[0], feats)


def test_ijepa_classifier_non_square_both_ways(tmp_path, record_property):
  """IJepaForImageClassification at 24x32 px (a 3x4 grid), from its
  save_pretrained directory (v4 names, config.json, labels)."""
  m = _ijepa("IJepaForImageClassification", seed=4, image_size=[24, 32],
             num_labels=3, id2label={i: f"kind {i}" for i in range(3)},
             label2id={f"kind {i}": i for i in range(3)})
  m.save_pretrained(tmp_path)
  x = images(2, 32, seed=5, height=24)
  with torch.no_grad():
    ref = m(pixel_values=torch_in(x)).logits.numpy()
    hidden = m.ijepa(pixel_values=torch_in(x)).last_hidden_state.numpy()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", weights.GuessWarning)  # no processor
    loaded = weights.load(str(tmp_path))
  assert loaded.kind == "transformers" and loaded.label_names[2] == "kind 2"
  feats, logits = _features(loaded.model, loaded.variables, x)
  rel = assert_close_rel(logits, ref, REL)
  assert_close_rel(feats, hidden, REL, what="last_hidden_state")
  record_property("rel_err", rel.rel)
  print(f"\nPARITY transformers IJepaForImageClassification (3x4 grid): "
        f"logits rel {rel.rel:.2g}")
  back = formats.to_transformers(loaded.variables)
  assert list(back) == list(m.state_dict())
  fresh = _ijepa("IJepaForImageClassification", seed=6, image_size=[24, 32],
                 num_labels=3)
  fresh.load_state_dict(back, strict=True)
  for k, v in m.state_dict().items():
    assert torch.equal(back[k], v), k


def test_what_ijepa_loading_refuses():
  torch.manual_seed(0)
  pooled = transformers.IJepaModel(_ijepa_config(), add_pooling_layer=True)
  with pytest.raises(ValueError, match=r"pooler\.dense\..*first patch token"):
    formats.from_transformers(pooled)
  # A ViTModel's state dict that lost its class token is no I-JEPA.
  vit = transformers.ViTModel(transformers.ViTConfig(image_size=SIZE, **TINY),
                              add_pooling_layer=False)
  sd = {k: v for k, v in vit.state_dict().items() if "cls_token" not in k}
  with pytest.raises(ValueError, match=r"\(1, 17, 32\).*missing its class "
                     r"token"):
    formats.from_transformers(sd, num_heads=2)


def test_hf_hub_names_load_offline_from_the_local_cache(tmp_path,
                                                       monkeypatch):
  cache = str(tmp_path / "hub")
  mae = _mae(seed=7, mask_ratio=0.75)
  mae.save_pretrained(tmp_path / "mae")
  transformers.ViTImageProcessor(
      size={"height": SIZE, "width": SIZE}).save_pretrained(tmp_path / "mae")
  hf_cache.put(cache, "facebook/vit-mae-base", str(tmp_path / "mae"))
  ijepa = _ijepa("IJepaModel", seed=8)
  ijepa.save_pretrained(tmp_path / "ijepa")
  hf_cache.put(cache, "facebook/ijepa_vith14_1k", str(tmp_path / "ijepa"))
  hf_cache.offline(monkeypatch, cache)
  x = images(2, SIZE, seed=9)

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loaded = weights.load("hf-hub:facebook/vit-mae-base")
  assert [str(w.message) for w in caught if DECODER in str(w.message)]
  assert loaded.kind == "transformers" and loaded.preprocessing.crop_size == SIZE
  mae.config.mask_ratio = 0.0
  feats, _ = _features(loaded.model, loaded.variables, x)
  assert_close_rel(feats, _mae_reference(mae.vit, x), REL,
                   what="last_hidden_state")

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", weights.GuessWarning)  # no processor
    loaded = weights.load("hf-hub:facebook/ijepa_vith14_1k")
  with torch.no_grad():
    ref = ijepa(pixel_values=torch_in(x)).last_hidden_state.numpy()
  feats, pooled = _features(loaded.model, loaded.variables, x)
  assert_close_rel(feats, ref, REL, what="last_hidden_state")
  assert_close_rel(pooled, ref.mean(1), REL, what="mean")
