"""scikit-learn's bundled handwritten digits as a TFDS dataset (offline).

1,797 real 8x8 grey-scale images of the digits 0-9 (UCI "Optical Recognition
of Handwritten Digits", the copy that ships inside scikit-learn, so nothing is
downloaded). Pixels are 0..16 in the source and stored here as uint8 0..255.

Splits are fixed: a stratified 80/20 split drawn with
``numpy.random.RandomState(0)`` (a generator whose stream NumPy guarantees
stable), giving 1,438 ``train`` and 359 ``test`` examples.

It is an ordinary ``tfds`` builder, so it goes through the same
``tfds -> tf.data`` path as CIFAR or ImageNet::

    import vit_jax.data.digits  # registers 'digits'
    ds = tfds.load("digits", split="train")
"""

from __future__ import annotations

import numpy as np
import tensorflow_datasets as tfds

TEST_FRACTION = 0.2
SPLIT_SEED = 0


def split_indices(labels: np.ndarray, test_fraction: float = TEST_FRACTION,
                  seed: int = SPLIT_SEED):
  """Stratified, reproducible (train_indices, test_indices), both sorted."""
  rs = np.random.RandomState(seed)
  test = []
  for c in np.unique(labels):
    idx = np.flatnonzero(labels == c)
    perm = rs.permutation(idx)
    test.extend(perm[:int(round(test_fraction * len(idx)))].tolist())
  test = np.sort(np.asarray(test, np.int64))
  train = np.setdiff1d(np.arange(len(labels)), test)
  return train, test


class Digits(tfds.core.GeneratorBasedBuilder):
  """scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Stratified 80/20 split with RandomState(0)."}

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        description=__doc__,
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(8, 8, 1)),
            "label": tfds.features.ClassLabel(
                names=[str(i) for i in range(10)]),
        }),
        supervised_keys=("image", "label"),
        homepage=("https://scikit-learn.org/stable/modules/generated/"
                  "sklearn.datasets.load_digits.html"),
        citation=("Alpaydin, E. and Kaynak, C. (1998). Optical Recognition of "
                  "Handwritten Digits. UCI Machine Learning Repository."),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download: the data ships with scikit-learn.
    from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    labels = digits.target.astype(np.int64)
    train, test = split_indices(labels)
    return {
        "train": self._generate_examples(images, labels, train),
        "test": self._generate_examples(images, labels, test),
    }

  def _generate_examples(self, images, labels, indices):
    for i in indices:
      yield int(i), {"image": images[i][..., None], "label": int(labels[i])}
