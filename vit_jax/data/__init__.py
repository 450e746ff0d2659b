"""The data room: how images must be prepared for a set of weights
(:mod:`~vit_jax.data.preprocessing`), class names
(:mod:`~vit_jax.data.labels`), the tfds -> tf.data -> global arrays
pipeline (:mod:`~vit_jax.data.sources`, :mod:`~vit_jax.data.transforms`,
:mod:`~vit_jax.data.batches`), RandAugment, the bundled digits
dataset, and the console (TensorFlow's native log lines kept off the first
screen). Importing this package imports neither TensorFlow nor torch; the
pipeline modules do.
"""
