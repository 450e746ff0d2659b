"""timm's classic ViT layout (the TIMM table): both directions on random
weights, names, clear errors. The families (DeiT-III, DINOv2, CLIP, SigLIP)
are in test_families.py."""

import numpy as np
import pytest
import torch

from compare import (apply, assert_close_rel, images, random_ours, random_timm,
                     timm_logits)

timm = pytest.importorskip("timm")

from vit_jax import formats  # noqa: E402

SIZE = 64  # 4x4 patch grid for /16: small, and the grid is not trivial




@pytest.mark.parametrize("scan", [False, True])
def test_timm_state_dict_logits_match_timm(scan, record_property):
  m = random_timm(depth=12)  # the full vit_tiny_patch16_224
  x = images()
  model, variables = formats.from_timm(m.state_dict(), scan_layers=scan)
  assert model.num_heads == 3 and model.num_classes == 10
  rel = assert_close_rel(apply(model, variables, x), timm_logits(m, x))
  record_property("rel_err", rel.rel)


def test_timm_name_gives_heads_and_is_checked():
  sd = random_timm(depth=12).state_dict()
  model, _ = formats.from_timm(sd, "vit_tiny_patch16_224.augreg_in21k")
  assert model.num_heads == 3
  with pytest.raises(ValueError, match=r"not a vit_b_16.*hidden_size 192 "
                     r"\(expected 768\).*vit_ti_16"):
    formats.from_timm(sd, "vit_b_16")


def test_ours_to_timm_loads_strict_and_matches():
  model, variables = random_ours()
  m = random_timm(seed=1)
  m.load_state_dict(formats.to_timm(variables), strict=True)
  x = images()
  assert_close_rel(apply(model, variables, x), timm_logits(m, x))


def test_gap_tree_to_timm_avg_pool_without_fc_norm():
  model, variables = random_ours(classifier="gap")
  m = random_timm(class_token=False, global_pool="avg", fc_norm=False)
  m.load_state_dict(formats.to_timm(variables), strict=True)
  x = images()
  assert_close_rel(apply(model, variables, x), timm_logits(m, x))
  back_model, back = formats.from_timm(m.state_dict())
  assert back_model.classifier == "gap"
  assert_close_rel(apply(back_model, back, x), timm_logits(m, x))


def test_timm_no_embed_class_is_a_model_option():
  m = random_timm(no_embed_class=True)  # DeiT-3 style
  assert m.pos_embed.shape[1] == (SIZE // 16) ** 2
  x = images()
  model, variables = formats.from_timm(m.state_dict())
  assert model.no_embed_class
  pe = variables["params"]["Transformer"]["posembed_input"]["pos_embedding"]
  np.testing.assert_array_equal(pe, m.pos_embed.detach().numpy())
  assert_close_rel(apply(model, variables, x), timm_logits(m, x))
  back = formats.to_timm(variables)
  assert all(torch.equal(back[k], v) for k, v in m.state_dict().items())


@pytest.mark.parametrize("key, what", [
    ("blocks.0.attn.gate.weight", "gated attention"),
    ("attn_pool.pos_embed", "a position embedding in the attention pool"),
])
def test_timm_features_we_lack_are_named(key, what):
  # (qk_norm and DeiT's distillation token are supported since issue 21:
  # tests/weights/test_families_2026.py compares them with timm;
  # differential attention too: tests/weights/test_timm_blocks.py.)
  sd = random_timm().state_dict()
  sd[key] = torch.zeros(4, 4)
  with pytest.raises(ValueError, match=what):
    formats.from_timm(sd)


def test_timm_model_of_another_architecture_is_named_as_such():
  sd = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False,
                         depths=(1, 1, 1, 1)).state_dict()
  with pytest.raises(ValueError, match=r"Not a timm VisionTransformer.*"
                     r"layers\.0\.blocks\.0.*another architecture"):
    formats.from_timm(sd)


def test_timm_missing_and_misshaped_keys_are_listed():
  sd = random_timm().state_dict()
  del sd["blocks.1.mlp.fc2.bias"]
  sd["blocks.2.norm1.weight"] = torch.zeros(7)
  with pytest.raises(ValueError) as e:
    formats.from_timm(sd)
  msg = str(e.value)
  assert "missing keys (1)" in msg and "blocks.1.mlp.fc2.bias" in msg
  assert "blocks.2.norm1.weight: expected (192,), got (7,)" in msg
