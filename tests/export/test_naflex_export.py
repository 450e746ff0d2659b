"""A NaFlex model as StableHLO (issue 22): the NaFlex dict in, its batch and
sequence length symbolic, one artifact verified at two lengths against
JAX; a fixed length refuses others by name; the formats and options a
NaFlex model has no use for are refused saying why."""

import os

import numpy as np
import pytest

from compare import assert_close_rel, perturb_torch
from vit_jax import export, formats
from vit_jax.data import naflex

timm = pytest.importorskip("timm")
NAME = "naflexvit_base_patch16_siglip"


@pytest.fixture(scope="module")
def servable():
  import torch  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  m = perturb_torch(timm.create_model(NAME, pretrained=False, depth=2,
                                      num_classes=7, embed_dim=192,
                                      num_heads=3), 0, std=0.1)
  model, variables = formats.from_timm(m.state_dict(), NAME)
  return export.servable((model, variables)), m


def _images(shapes, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes]


def test_symbolic_sequence_length_verified_at_two_lengths(servable, tmp_path):
  import torch  # pylint: disable=import-outside-toplevel
  s, m = servable
  out = export.export(s, "stablehlo", str(tmp_path / "naflex.shlo"))
  art = export.load_stablehlo(out)
  assert (art.spec.batch, art.spec.seq_len, art.spec.patch_dim) == (
      None, None, 768)
  v = export.verify(s, "stablehlo", out, seq_lens=(24, 61))
  assert v.max_rel_err < 1e-5 and not v.note
  # Images of any shape through the host pipeline at two lengths: the
  # artifact against timm's own model on the same batches.
  for seq, shapes in ((16, [(30, 90), (70, 20)]), (40, [(64, 64)])):
    batch = naflex.batch_images(_images(shapes), patch_size=16,
                                max_seq_len=seq)
    got = np.asarray(art(batch))
    with torch.no_grad():
      ref = m({k: torch.from_numpy(np.asarray(x)) for k, x in
               batch.items()}).numpy()
    assert_close_rel(got, ref, what=f"artifact at {seq} tokens")


def test_fixed_length_and_refusals(servable, tmp_path):
  s, _ = servable
  out = export.export(s, "stablehlo", str(tmp_path / "n16.shlo"), seq_len=16,
                      batch=2)
  art = export.load_stablehlo(out)
  assert (art.spec.batch, art.spec.seq_len) == (2, 16)
  assert export.verify(s, "stablehlo", out, batch=2).max_rel_err < 1e-5
  batch = naflex.batch_images(_images([(30, 90), (70, 20)]), patch_size=16,
                              max_seq_len=16, seq_len=20)
  with pytest.raises(export.ExportError, match=r"\(2, 16, 768\)"):
    art(batch)
  with pytest.raises(export.ExportError, match="NaFlex dict"):
    art(np.zeros((2, 64, 64, 3), np.float32))
  for fmt in ("onnx", "savedmodel"):
    with pytest.raises(export.ExportError, match="exported as 'stablehlo'"):
      export.export(s, fmt, str(tmp_path / f"x.{fmt}"))
  with pytest.raises(export.ExportError, match="token budget"):
    export.export(s, "stablehlo", str(tmp_path / "p.shlo"),
                  with_preprocessing=True)
  assert not os.path.exists(tmp_path / "p.shlo")
