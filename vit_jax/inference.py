"""Running a loaded ViT on image files: the public face of loading
(:func:`vit_jax.weights.load`, with the preprocessing its weights expect),
decoding images (:mod:`vit_jax.data.images`) and batched runs
(:mod:`vit_jax.cli`). No logic of its own.
"""

from vit_jax.cli import make_probabilities_fn, run_batches  # noqa: F401
from vit_jax.data.images import (  # noqa: F401
    IMAGE_EXTENSIONS, ImageError, expand_image_paths, read_image)
from vit_jax.data.preprocessing import preprocess_pil  # noqa: F401
from vit_jax.weights import (  # noqa: F401  (the loader, re-exported)
    SUPPORTED, CheckpointError, GuessWarning, Loaded, load)
