"""vit-jax: the Vision Transformer in JAX/Flax, with exact parity with torchvision.

``from vit_jax import models, convert``. Importing this package (or
``vit_jax.models``) does not import torch or TensorFlow.
"""

__version__ = "0.1.0"
