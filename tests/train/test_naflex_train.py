"""NaFlex batches for ``train.py`` (issue 22): the tf.data path (each step
one of ``config.naflex_seq_lens``, drawn from (seed, step); each crop at
its own aspect ratio within it), its budget search equal to timm's, resume
reading the same batches, and a seconds-long CPU training run whose
workdir loads back as a NaFlex model that predicts images of any shape."""

import jax
import numpy as np
import pytest
import tensorflow as tf

from train_helpers import tiny_config
from vit_jax import predict, train as train_lib, weights
from vit_jax.data import batches, naflex, sources, transforms

LENS = (6, 12, 20)


def test_tf_budget_search_equals_numpy_and_timm():
  rng = np.random.default_rng(0)
  for _ in range(60):
    hw = tuple(int(x) for x in rng.integers(1, 3000, 2))
    seq, p = int(rng.integers(1, 1100)), int(rng.choice([4, 14, 16]))
    want = naflex.image_size_for_seq(hw, p, seq)[1]
    got = tuple(transforms.image_size_for_seq(tf.constant(hw), p,
                                              seq).numpy())
    assert got == want, (hw, p, seq)


def test_naflex_train_and_eval_batches():
  cfg = tiny_config(naflex_seq_lens=LENS, **{"pp.crop": "inception"})
  src = sources.get_source(cfg)
  kw = dict(local_batch=8, process_index=0, process_count=1,
            naflex=(4, LENS))
  it = batches.as_numpy(batches.train_dataset(cfg, src, start_step=0, **kw))
  seen, grids = [], set()
  for step in range(6):
    b = next(it)
    n = b["patches"].shape[1]
    assert n == int(batches.naflex_seq_len(LENS, cfg.seed, step))
    assert b["patches"].shape == (8, n, 48) and b["patches"].dtype == np.uint8
    valid = b["patch_valid"]
    assert valid.any(axis=1).all() and (valid.sum(1) <= n).all()
    g = np.where(valid[..., None], b["patch_coord"], 0).max(1) + 1
    assert (g.prod(1) == valid.sum(1)).all()  # whole grids, valid first
    assert not b["patches"][~valid].any()
    grids.update(map(tuple, g))
    seen.append(b)
  assert len({b["patches"].shape[1] for b in seen}) >= 2
  assert len({h / w for h, w in grids}) >= 3  # aspect ratios kept
  # Resume: from step 2 the same batches.
  resumed = next(batches.as_numpy(batches.train_dataset(
      cfg, src, start_step=2, **kw)))
  for k in resumed:
    np.testing.assert_array_equal(resumed[k], seen[2][k])
  ds, num = batches.eval_dataset(cfg, src, local_batch=100, process_index=0,
                                 process_count=1, naflex=(4, 20))
  eb = list(batches.as_numpy(ds))
  assert num == 4 and eb[0]["patches"].shape == (100, 20, 48)
  assert eb[-1]["mask"].sum() == 59 and not eb[-1]["patch_valid"][59:].any()


def test_naflex_training_smoke_and_inference(tmp_path):
  """6 steps from scratch (a NaFlex model built with SigLIP 2's grid resize,
  the grid of config.image_size), lengths (6, 12); the workdir loads as a
  NaFlex model whose recipe is the evaluation length."""
  cfg = tiny_config(naflex_seq_lens=(6, 12), **{"pp.crop": "inception"})
  out = train_lib.train_and_evaluate(cfg, str(tmp_path),
                                     devices=jax.devices()[:1])
  assert out["step"] == 6 and np.isfinite(out["train_loss"])
  assert 0.0 <= out["eval_accuracy"] <= 1.0
  loaded = weights.load(str(tmp_path))
  assert loaded.naflex and loaded.preprocessing.max_seq_len == 12
  assert tuple(loaded.model.naflex_grid) == (2, 2)
  rng = np.random.default_rng(0)
  imgs = [rng.integers(0, 256, s, dtype=np.uint8)
          for s in ((13, 29, 3), (40, 9, 3))]
  r = predict.predict(loaded, imgs, top_k=2)
  assert all(p.error is None and len(p.top) == 2 for p in r)


def test_naflex_config_errors(tmp_path):
  with pytest.raises(ValueError, match="mixup"):
    train_lib.train_and_evaluate(
        tiny_config(naflex_seq_lens=(6,), **{"pp.mixup_alpha": 0.2}),
        str(tmp_path), devices=jax.devices()[:1])
  with pytest.raises(ValueError, match="positive sequence lengths"):
    train_lib.train_and_evaluate(tiny_config(naflex_seq_lens=(0, 4)),
                                 str(tmp_path), devices=jax.devices()[:1])
