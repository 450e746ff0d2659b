"""TFDS builders that ship with vit_jax; importing this package registers them
(``tfds.builder("digits")`` then works like any catalogue dataset)."""

from vit_jax.datasets import digits  # noqa: F401  (registers 'digits')
