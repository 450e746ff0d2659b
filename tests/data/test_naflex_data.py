"""NaFlex batches on the host (issue 22): images of any shapes -> the dict,
bit for bit as timm's NaFlex pipeline makes it (``create_transform(
naflex=True)`` on PIL images + ``NaFlexCollator``), the token-budget search
as timm's and transformers', the Siglip2 input conversion both ways."""

import numpy as np
import pytest

from vit_jax.data import naflex, preprocessing as pp

timm = pytest.importorskip("timm")

# Shapes of every kind: tall, wide, square, tiny, large.
SHAPES = [(100, 37), (64, 200), (33, 33), (480, 640), (7, 300)]


def _images(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SHAPES]


@pytest.mark.parametrize("seq, interpolation", [(64, "bicubic"),
                                                (144, "bilinear")])
def test_batch_equals_timms_naflex_pipeline(seq, interpolation):
  from PIL import Image  # pylint: disable=import-outside-toplevel
  from timm.data import create_transform  # pylint: disable=import-outside-toplevel
  from timm.data.naflex_dataset import NaFlexCollator  # pylint: disable=import-outside-toplevel

  imgs = _images()
  t = create_transform(input_size=(3, 224, 224), is_training=False,
                       naflex=True, patch_size=16, max_seq_len=seq,
                       interpolation=interpolation, mean=pp.OPENAI_CLIP_MEAN,
                       std=pp.OPENAI_CLIP_STD, patchify=True)
  ref, _ = NaFlexCollator(max_seq_len=seq)(
      [(t(Image.fromarray(im)), 0) for im in imgs])
  ours = naflex.batch_images(imgs, patch_size=16, max_seq_len=seq,
                             mean=pp.OPENAI_CLIP_MEAN, std=pp.OPENAI_CLIP_STD,
                             interpolation=interpolation)
  assert sorted(ours) == sorted(naflex.KEYS)
  for k in naflex.KEYS:
    np.testing.assert_allclose(ours[k], ref[k].numpy(), rtol=0, atol=1e-6,
                               err_msg=k)
  counts = ours["patch_valid"].sum(axis=1)
  assert counts.max() <= seq and counts.min() >= 1


def test_the_budget_search_is_timms_and_transformers():
  from timm.data.naflex_transforms import get_image_size_for_seq  # pylint: disable=import-outside-toplevel
  transformers = pytest.importorskip("transformers")
  from transformers.models.siglip2 import image_processing_siglip2 as hf  # pylint: disable=import-outside-toplevel
  for hw in SHAPES + [(1, 1000), (5000, 3), (16, 16)]:
    for seq in (16, 256, 576, 1024):
      ours = naflex.image_size_for_seq(hw, 16, seq)
      assert ours == get_image_size_for_seq(hw, 16, seq), (hw, seq)
      assert ours[1] == tuple(hf.get_image_size_for_max_num_patches(
          hw[0], hw[1], 16, seq)), (hw, seq)
  del transformers


def test_patchify_collate_and_siglip2_inputs():
  x = np.arange(2 * 16 * 3 * 16 * 3, dtype=np.float32).reshape(32, 48, 3)
  patches, coord, valid = naflex.patchify(x, 16)
  assert patches.shape == (6, 768) and valid.all()
  np.testing.assert_array_equal(coord[4], [1, 1])
  # Patch (1, 1): rows 16..31, columns 16..31, (y, x, channel) order.
  np.testing.assert_array_equal(patches[4], x[16:32, 16:32].reshape(-1))
  b = naflex.collate([dict(zip(naflex.KEYS, naflex.patchify(x, 16))),
                      dict(zip(naflex.KEYS, naflex.patchify(x[:16], 16)))], 8)
  assert b["patches"].shape == (2, 8, 768)
  np.testing.assert_array_equal(b["patch_valid"].sum(1), [6, 3])
  assert not b["patches"][1, 3:].any() and not b["patch_coord"][1, 3:].any()
  pv, mask, shapes = naflex.to_siglip2(b)
  np.testing.assert_array_equal(shapes, [[2, 3], [1, 3]])
  back = naflex.from_siglip2(pv, mask, shapes)
  for k in naflex.KEYS:
    np.testing.assert_array_equal(back[k], b[k])
  shuffled = {k: v[:, ::-1] for k, v in b.items()}
  with pytest.raises(ValueError, match="sequence index"):
    naflex.to_siglip2(shuffled)
