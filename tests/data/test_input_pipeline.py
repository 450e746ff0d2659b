"""Input pipeline: the digits builder, deterministic and per-process streams,
exactly-once evaluation, image folders, mock_data datasets, and its errors."""

import hashlib
import os
import time

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from train_helpers import digits_data_dir, tiny_config
from vit_jax.data import batches, sources, transforms
from vit_jax.data import randaugment
from vit_jax.data import digits

MEAN = STD = (0.5, 0.5, 0.5)


@pytest.fixture(scope="module")
def src():
  return sources.get_source(tiny_config())


def _batches(ds, n):
  it = batches.as_numpy(ds)
  return [next(it) for _ in range(n)]


def _digest(image) -> str:
  return hashlib.sha1(np.ascontiguousarray(image).tobytes()).hexdigest()


def test_digits_builder_splits():
  b = tfds.builder("digits", data_dir=digits_data_dir())
  assert b.info.splits["train"].num_examples == 1438
  assert b.info.splits["test"].num_examples == 359
  assert b.info.features["label"].names == [str(i) for i in range(10)]
  from sklearn.datasets import load_digits
  labels = load_digits().target
  train, test = digits.split_indices(labels)
  assert len(np.intersect1d(train, test)) == 0
  assert len(train) + len(test) == 1797
  # Stratified: every class has ~20% of its examples in test.
  for c in range(10):
    frac = np.mean(labels[test] == c) / np.mean(labels == c) * len(test) / 1797
    assert 0.18 < frac < 0.22
  # Real digits, stored 0..255: every test image is scikit-learn's, pixel
  # for pixel (the PNG encoding is lossless), with its label.
  ex = list(tfds.as_numpy(b.as_dataset(split="test")))
  assert ex[0]["image"].shape == (8, 8, 1) and ex[0]["image"].dtype == np.uint8
  images = np.round(load_digits().images * (255.0 / 16.0)).astype(np.uint8)
  want = sorted((_digest(images[i][..., None]), int(labels[i])) for i in test)
  got = sorted((_digest(e["image"]), int(e["label"])) for e in ex)
  assert got == want
  assert max(e["image"].max() for e in ex) == 255


def test_train_stream_is_a_function_of_step(src):
  cfg = tiny_config()
  kw = dict(local_batch=16, process_index=0, process_count=1, mean=MEAN,
            std=STD)
  full = _batches(batches.train_dataset(cfg, src, start_step=0, **kw), 100)
  # Resuming at step 93 (crosses an epoch boundary: 1438 / 16 ~ 89.9).
  resumed = _batches(batches.train_dataset(cfg, src, start_step=93, **kw), 7)
  for a, b in zip(full[93:], resumed):
    np.testing.assert_array_equal(a["image"], b["image"])
    np.testing.assert_array_equal(a["label"], b["label"])
  assert full[0]["image"].shape == (16, 8, 8, 3)
  assert full[0]["image"].dtype == np.float32 and full[0]["label"].dtype == np.int32
  # Epochs are reshuffled, and augmentation differs between batches.
  assert not np.array_equal(full[0]["label"], full[90]["label"])
  # Another seed gives another stream.
  other = _batches(batches.train_dataset(tiny_config(seed=1), src, start_step=0,
                                    **kw), 1)
  assert not np.array_equal(other[0]["image"], full[0]["image"])


def test_pipelines_run_without_tf_data_autotuning(src):
  """Deleting an iterator waits for tf.data's autotuning thread, which can
  first sleep out its optimisation period (seconds: a run that ends that much
  after its last step). Train and eval pipelines run without one, with their
  maps as wide as the cores."""
  cfg = tiny_config()
  train = batches.train_dataset(cfg, src, local_batch=16, start_step=0,
                                process_index=0, process_count=1)
  ev, _ = batches.eval_dataset(cfg, src, local_batch=16, process_index=0,
                               process_count=1)
  for ds in (train, ev):
    assert ds.options().autotune.enabled is False
    assert ds.options().deterministic is True
  assert batches.parallel_calls() == len(os.sched_getaffinity(0))


def test_processes_read_disjoint_train_slices(src):
  cfg = tiny_config(**{"pp.crop": "resize"})  # no augmentation: comparable
  seen = []
  for p in range(2):
    ds = batches.train_dataset(cfg, src, local_batch=719, start_step=0,
                          process_index=p, process_count=2, mean=MEAN, std=STD)
    batch = _batches(ds, 1)[0]  # one whole epoch of this process's slice
    seen.append({_digest(x) for x in batch["image"]})
  assert len(seen[0] & seen[1]) < 5  # (a few digits are pixel-identical)
  assert len(seen[0] | seen[1]) > 1400


@pytest.mark.parametrize("process_count,local_batch", [(1, 64), (3, 32)])
def test_eval_counts_every_example_once(src, process_count, local_batch):
  cfg = tiny_config()
  total, digests, nbatches = 0, [], set()
  for p in range(process_count):
    ds, n = batches.eval_dataset(cfg, src, local_batch=local_batch,
                                 process_index=p, process_count=process_count,
                                 mean=MEAN, std=STD)
    got = list(batches.as_numpy(ds))
    assert len(got) == n
    nbatches.add(n)
    for b in got:
      m = b["mask"] > 0
      total += int(m.sum())
      digests += [_digest(x) + str(y) for x, y in zip(b["image"][m], b["label"][m])]
      assert np.all(b["image"][~m] == 0)
  assert len(nbatches) == 1  # every process runs the same number of batches
  assert total == 359
  ref, _ = batches.eval_dataset(cfg, src, local_batch=359, process_index=0,
                           process_count=1, mean=MEAN, std=STD)
  ref = next(batches.as_numpy(ref))
  assert sorted(digests) == sorted(_digest(x) + str(y)
                                   for x, y in zip(ref["image"], ref["label"]))


def test_eval_preprocessing_resizes_and_normalises(src):
  cfg = tiny_config(image_size=16)
  ds, _ = batches.eval_dataset(cfg, src, local_batch=8, process_index=0,
                          process_count=1, mean=MEAN, std=STD)
  b = next(batches.as_numpy(ds))
  assert b["image"].shape == (8, 16, 16, 3)
  assert -1.0 <= b["image"].min() and b["image"].max() <= 1.0
  np.testing.assert_array_equal(b["image"][..., 0], b["image"][..., 2])  # grey


def test_image_folder_dataset(tmp_path):
  rng = np.random.RandomState(0)
  for split, n in (("train", 6), ("test", 3)):
    for label in ("cat", "dog"):
      d = tmp_path / split / label
      d.mkdir(parents=True)
      for i in range(n):
        Image.fromarray(rng.randint(0, 255, (20 + i, 24, 3), np.uint8)).save(
            d / f"{i}.png")
  cfg = tiny_config(dataset=f"folder:{tmp_path}")
  s = sources.get_source(cfg)
  assert s.label_names == ["cat", "dog"] and s.num_classes == 2
  assert (s.num_train, s.num_eval) == (12, 6)
  ds = batches.train_dataset(cfg, s, local_batch=4, start_step=0, process_index=1,
                        process_count=2, mean=MEAN, std=STD)
  assert _batches(ds, 2)[1]["image"].shape == (4, 8, 8, 3)
  ds, n = batches.eval_dataset(cfg, s, local_batch=4, process_index=0,
                          process_count=2, mean=MEAN, std=STD)
  assert n == 1 and sum(b["mask"].sum() for b in batches.as_numpy(ds)) == 3


def _images(root, names, seed=0):
  rng = np.random.RandomState(seed)
  for i, name in enumerate(names):
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.randint(0, 255, (12 + i, 20, 3), np.uint8)).save(path)


def test_a_folder_of_images_is_read_whole(tmp_path):
  """Flat or nested at mixed depths: every image once, sorted by path,
  the one split 'all', unlabelled (-1); the eval batches carry each
  example's path (padding: b'')."""
  flat = tmp_path / "flat"
  _images(flat, ["b.jpg", "a.png", "x/c.webp", "x/y/d.bmp", "e.gif"])
  (flat / "notes.txt").write_text("not an image")
  (flat / ".hidden.png").write_bytes(b"")
  b = sources.get_builder(f"folder:{flat}")
  assert isinstance(b, sources.ImageFiles) and b.label_names is None
  assert [os.path.relpath(p, flat) for p in b.paths] == [
      "a.png", "b.jpg", "e.gif", "x/c.webp", "x/y/d.bmp"]
  cfg = tiny_config(dataset=f"folder:{flat}", train_split="all",
                    eval_split="all")
  s = sources.get_source(cfg)
  assert (s.num_classes, s.label_names, s.num_eval) == (0, None, 5)
  ds, n = batches.eval_dataset(cfg, s, local_batch=4, process_index=0,
                               process_count=1, mean=MEAN, std=STD,
                               with_paths=True)
  rows = list(batches.as_numpy(ds))
  assert n == 2 and rows[0]["image"].shape == (4, 8, 8, 3)
  paths = [p.decode() for r in rows for p in r["path"]]
  assert paths == b.paths + ["", "", ""]
  assert [int(x) for r in rows for x in r["label"]][:5] == [-1] * 5
  with pytest.raises(ValueError, match=r"config.train_split='train'.*"
                     r"without a <split>/<label>/ tree.*leave the split out"):
    sources.get_source(tiny_config(dataset=f"folder:{flat}"))


def test_a_folder_of_label_folders_is_labelled(tmp_path):
  """DIR/<label>/*: labels from the subdirectories (sorted); a split tree
  with a stray image is read whole and the error says why it is not one."""
  _images(tmp_path / "pets", ["dog/1.png", "cat/2.jpg", "cat/1.png"])
  b = sources.get_builder(f"folder:{tmp_path / 'pets'}")
  assert b.label_names == ["cat", "dog"]
  assert [(os.path.basename(p), int(y)) for p, y in zip(b.paths, b.labels)
          ] == [("1.png", 0), ("2.jpg", 0), ("1.png", 1)]
  _images(tmp_path / "tree", ["train/cat/1.png", "test/dog/2.png",
                              "stray.png"])
  with pytest.raises(ValueError, match=r"1 image\(s\) are not two levels "
                     r"down.*stray.png"):
    sources.get_source(tiny_config(dataset=f"folder:{tmp_path / 'tree'}"))


def test_folders_the_pipeline_cannot_read_are_refused(tmp_path):
  _images(tmp_path / "tif", ["a.png", "b.tif"])
  with pytest.raises(ValueError, match=r"cannot decode.*b.tif"):
    sources.get_builder(f"folder:{tmp_path / 'tif'}")
  (tmp_path / "empty" / "sub").mkdir(parents=True)
  with pytest.raises(ValueError, match="has no images"):
    sources.get_builder(f"folder:{tmp_path / 'empty'}")
  _images(tmp_path / "tree", ["train/cat/1.png", "train/cat/2.webp"])
  with pytest.raises(ValueError, match=r"ImageFolder.*2.webp"):
    sources.get_builder(f"folder:{tmp_path / 'tree'}")


def test_mock_tfds_catalogue_dataset():
  """A catalogue dataset (CIFAR-10) through the same path, with mock data."""
  cfg = tiny_config(dataset="cifar10", data_dir=None, image_size=16,
                    **{"pp.crop": "inception", "pp.flip": True,
                       "pp.randaugment_layers": 2})
  with tfds.testing.mock_data(num_examples=40):
    s = sources.get_source(cfg)
    assert s.num_classes == 10 and len(s.label_names) == 10
    ds = batches.train_dataset(cfg, s, local_batch=8, start_step=3, process_index=0,
                          process_count=1, mean=MEAN, std=STD)
    b = _batches(ds, 1)[0]
    ds, n = batches.eval_dataset(cfg, s, local_batch=16, process_index=0,
                            process_count=1, mean=MEAN, std=STD)
    assert sum(e["mask"].sum() for e in batches.as_numpy(ds)) == 40 and n == 3
  assert b["image"].shape == (8, 16, 16, 3) and b["label"].max() < 10


def test_missing_dataset_offline_fails_fast(tmp_path, monkeypatch):
  monkeypatch.setattr(sources, "_online", lambda *a, **k: False)
  t0 = time.perf_counter()
  with pytest.raises(sources.DatasetNotPreparedError) as e:
    sources.get_builder("cifar10", data_dir=str(tmp_path), download=True)
  assert time.perf_counter() - t0 < 30
  msg = str(e.value)
  assert "'cifar10'" in msg and str(tmp_path) in msg and "tfds build cifar10" in msg
  assert "offline" in msg
  with pytest.raises(sources.DatasetNotPreparedError, match="download is False"):
    sources.get_builder("cifar10", data_dir=str(tmp_path), download=False)


def test_online_probe_is_quick():
  t0 = time.perf_counter()
  sources._online(timeout=2.0)
  assert time.perf_counter() - t0 < 10


def test_bad_dataset_names_and_splits(tmp_path):
  with pytest.raises(ValueError, match="Unknown dataset 'no_such_dataset_xyz'"):
    sources.get_builder("no_such_dataset_xyz", data_dir=str(tmp_path))
  with pytest.raises(FileNotFoundError, match="does not exist"):
    sources.get_builder(f"folder:{tmp_path}/missing")
  with pytest.raises(ValueError, match=r"config.eval_split='validation'.*"
                     r"\['train', 'test'\]|config.eval_split='validation'.*"
                     r"\['test', 'train'\]"):
    sources.get_source(tiny_config(eval_split="validation"))


def test_bad_normalisation():
  with pytest.raises(ValueError, match=r"config.pp.mean=\(0.5, 128.0, 0.5\)"):
    batches.normalization(tiny_config(**{"pp.mean": (0.5, 128.0, 0.5)}))
  assert batches.normalization(tiny_config(**{"pp.mean": None, "pp.std": None})) == (
      (0.5,) * 3, (0.5,) * 3)


def test_bad_crop_mode(src):
  cfg = tiny_config(**{"pp.crop": "zoom"})
  with pytest.raises(ValueError, match="config.pp.crop='zoom'"):
    batches.train_dataset(cfg, src, local_batch=4, start_step=0, process_index=0,
                     process_count=1, mean=MEAN, std=STD)


def test_randaugment_ops_and_determinism():
  import tensorflow as tf
  img = tf.constant(np.random.RandomState(0).randint(0, 256, (12, 10, 3)),
                    tf.uint8)
  for i, name in enumerate(randaugment.OPS):
    out = randaugment._ops(img, tf.constant(0.5), tf.constant(-1.0))[i]()
    assert out.dtype == tf.uint8 and tuple(out.shape) == (12, 10, 3), name
  seed = tf.constant([4, 2], tf.int64)
  a = randaugment.randaugment(img, num_layers=3, magnitude=9, seed=seed)
  b = randaugment.randaugment(img, num_layers=3, magnitude=9, seed=seed)
  np.testing.assert_array_equal(a.numpy(), b.numpy())
  assert os.path.basename(randaugment.__file__) == "randaugment.py"


# --------------------------------------------------------------------------- #
# What keeps an accelerator fed: uint8 to the device, decode-and-crop, the
# epoch seam, double-buffering.
# --------------------------------------------------------------------------- #


def test_uint8_batches_normalised_on_the_device_are_the_host_numbers(src):
  import jax
  import jax.numpy as jnp
  from vit_jax import models
  from vit_jax.train import step as train_step
  mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
  cfg = tiny_config(image_size=12, **{"pp.randaugment_layers": 2})
  kw = dict(local_batch=16, start_step=5, process_index=0, process_count=1)
  u8 = _batches(batches.train_dataset(cfg, src, **kw), 2)
  host = _batches(batches.train_dataset(cfg, src, mean=mean, std=std, **kw), 2)
  norm = jax.jit(lambda x: train_step.normalize_images(x, mean, std))
  for a, b in zip(u8, host):
    assert a["image"].dtype == np.uint8 and a["image"].shape == (16, 12, 12, 3)
    np.testing.assert_array_equal(a["label"], b["label"])
    np.testing.assert_allclose(np.asarray(norm(a["image"])), b["image"],
                               rtol=0, atol=1e-6)
  # Eval: the jitted eval step on uint8 batches, on host-normalised ones.
  ev = batches.eval_dataset(cfg, src, local_batch=64, process_index=0,
                       process_count=1)[0]
  ev_host = batches.eval_dataset(cfg, src, local_batch=64, process_index=0,
                            process_count=1, mean=mean, std=std)[0]
  model = models.get_model("vit_ti_4", hidden_size=32, num_layers=1,
                           num_heads=2, mlp_dim=64, num_classes=10)
  v = model.init(jax.random.key(0), jnp.zeros((1, 12, 12, 3)), train=False)
  on_device = jax.jit(train_step.make_eval_step(model, 10, mean=mean, std=std))
  on_host = jax.jit(train_step.make_eval_step(model, 10))
  a, b = next(batches.as_numpy(ev)), next(batches.as_numpy(ev_host))
  assert a["image"].dtype == np.uint8 and b["image"].dtype == np.float32
  got, want = on_device(v["params"], {}, a), on_host(v["params"], {}, b)
  for k in train_step.EVAL_SUMS:
    np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-5)
  with pytest.raises(ValueError, match="uint8 images need"):
    on_host(v["params"], {}, a)


def _jpeg_bytes(rng, h, w, quality=90):
  import io
  y, x = np.mgrid[0:h, 0:w]
  img = np.stack([(x * 255 // max(1, w - 1)), (y * 255 // max(1, h - 1)),
                  ((x + y) * 3) % 256], -1) + rng.randint(0, 40, (h, w, 3))
  buf = io.BytesIO()
  Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(
      buf, format="JPEG", quality=quality)
  return buf.getvalue()


def test_decode_and_crop_jpeg_gives_todays_crops():
  """The Inception crop of JPEG bytes (decode_and_crop_jpeg) equals the crop
  of the fully decoded image (today's path) for the same seeds."""
  import tensorflow as tf
  rng = np.random.RandomState(0)
  cfg = tiny_config(image_size=24, **{"pp.crop": "inception",
                                      "pp.flip": True})
  for h, w in ((61, 80), (97, 53), (64, 64)):
    data = tf.constant(_jpeg_bytes(rng, h, w))
    assert tuple(transforms._shape(data).numpy()) == (h, w, 3)
    pixels = tf.io.decode_jpeg(data, channels=3)
    for s in range(6):
      seed = tf.constant([s, 7 * s + 1], tf.int64)
      a = transforms.preprocess_train(data, seed, pp=cfg.pp, image_size=24)
      b = transforms.preprocess_train(pixels, seed, pp=cfg.pp, image_size=24)
      assert a.dtype == tf.uint8
      np.testing.assert_array_equal(a.numpy(), b.numpy())
    # Windows at odd offsets (chroma blocks split), directly.
    windows = [(1, 3, 17, 29), (0, 0, h, w), (h - 9, w - 5, 9, 5)]
    for _ in range(12):
      hh, ww = rng.randint(1, h + 1), rng.randint(1, w + 1)
      windows.append((rng.randint(0, h - hh + 1), rng.randint(0, w - ww + 1),
                      hh, ww))
    for y0, x0, hh, ww in windows:
      got = transforms._decode_crop(data, tf.constant([y0, x0, 0]),
                            tf.constant([hh, ww, -1]))
      np.testing.assert_array_equal(got.numpy(),
                                    pixels[y0:y0 + hh, x0:x0 + ww].numpy())
  # A PNG takes the decode-then-slice path, with the same window.
  png = tf.io.encode_png(pixels)
  a = transforms._decode_crop(png, tf.constant([2, 4, 0]), tf.constant([10, 12, -1]))
  np.testing.assert_array_equal(a.numpy(), pixels[2:12, 4:16].numpy())


def test_the_next_epoch_is_read_ahead_in_the_same_order():
  import tensorflow as tf
  raw = tf.data.Dataset.range(37)

  def epoch(e):
    return raw.shuffle(37, seed=11 + e * 7919, reshuffle_each_iteration=False)

  want = list(tf.data.Dataset.range(2, 7).flat_map(epoch).as_numpy_iterator())
  got = list(tf.data.Dataset.range(2, 7).apply(
      batches._epochs_in_sequence(epoch)).as_numpy_iterator())
  assert got == want and len(got) == 5 * 37
  assert got[:37] != got[37:74]  # epochs are reshuffled


@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_start_global_copies_ahead_in_order(ahead):
  import jax
  import tensorflow as tf
  from vit_jax.train import sharding
  pulled = []

  def gen():
    for i in range(6):
      pulled.append(i)
      yield {"image": np.full((4, 2, 2, 3), i, np.uint8)}

  ds = tf.data.Dataset.from_generator(gen, output_signature={
      "image": tf.TensorSpec((4, 2, 2, 3), tf.uint8)})
  mesh = sharding.make_mesh(jax.devices()[:1], 1)
  seen = []
  for k, b in enumerate(batches.start_global(ds, sharding.batch_sharding(mesh),
                                        ahead=ahead)):
    assert isinstance(b["image"], jax.Array) and b["image"].dtype == np.uint8
    seen.append(int(b["image"][0, 0, 0, 0]))
    # When batch k is handed out, the copies of the next `ahead` started.
    assert len(pulled) >= min(6, k + 1 + ahead)
  assert seen == list(range(6))


_STOP_EARLY = r"""
import gc, sys
sys.path[:0] = ["tests", "."]
from train_helpers import tiny_config
from vit_jax.data import batches, sources
cfg = tiny_config(cache={cache})
src = sources.get_source(cfg)
ds = batches.train_dataset(cfg, src, local_batch=16, start_step=0,
                          process_index=0, process_count=1)
it = batches.as_numpy(ds)
for _ in range(2):  # far less than an epoch, as a short run reads
  next(it)
ev, n = batches.eval_dataset(cfg, src, local_batch=64, process_index=0,
                            process_count=1)
assert len(list(batches.as_numpy(ev))) == n
del it, ds, ev
gc.collect()
print("read", file=sys.stderr)
"""


@pytest.mark.parametrize("cache", [False, True])
def test_a_run_shorter_than_an_epoch_leaves_no_partial_cache(cache):
  """tfds auto-cached the small digits splits; a run stopped inside the
  first epoch then made TensorFlow warn at exit that it discarded the
  partly filled cache ("The calling iterator did not fully read the dataset
  being cached"). A cache is ours to make, filled whole."""
  import subprocess  # pylint: disable=import-outside-toplevel
  from train_helpers import PYTHON, REPO, env  # pylint: disable=import-outside-toplevel
  e = env()
  e.pop("TF_CPP_MIN_LOG_LEVEL")  # TensorFlow's warnings on, as a user has
  p = subprocess.run([PYTHON, "-c", _STOP_EARLY.format(cache=cache)],
                     cwd=REPO, env=e, capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  assert "read" in p.stderr
  assert "cache_dataset_ops" not in p.stderr, p.stderr[-3000:]
  assert "did not fully read" not in p.stderr
