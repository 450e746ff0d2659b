"""What only a GPU can check: cuDNN's fused attention through our padding,
and the model choosing it by itself. Skipped where JAX has no GPU (CI);
run on one with ``pytest tests/models/test_gpu.py``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import models
from vit_jax.models import kernels

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="needs a GPU")


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("n", [197, 256, 50])
def test_cudnn_attention_and_gradients_match_float32(n):
  """bfloat16 cuDNN attention (ViT-B/16's odd 197 tokens padded) against
  float32 XLA attention: the output and the q/k/v gradients each within
  bfloat16 rounding (max error / max value), as XLA's own bfloat16
  attention is."""
  r = np.random.RandomState(n)
  q, k, v, w = (jnp.asarray(r.normal(size=(4, n, 12, 64)), jnp.float32)
                for _ in range(4))

  def run(fn, dtype):
    def f(q, k, v):
      return fn(q.astype(dtype), k.astype(dtype),
                v.astype(dtype)).astype(jnp.float32)

    def out_and_grads(q, k, v, w):
      out, vjp = jax.vjp(f, q, k, v)
      return (out,) + vjp(w)
    return jax.jit(out_and_grads)(q, k, v, w)

  def xla(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="xla")
  with jax.default_matmul_precision("highest"):
    ref = run(xla, jnp.float32)
  cudnn = run(kernels.padded_attention, jnp.bfloat16)
  xla = run(xla, jnp.bfloat16)
  for name, c, x, r_ in zip(("out", "dq", "dk", "dv"), cudnn, xla, ref):
    err_c, err_x = _rel(c, r_), _rel(x, r_)
    print(f"n={n} {name}: cudnn {err_c:.2e}  xla bf16 {err_x:.2e}")
    assert err_c < 2e-2, (name, err_c, err_x)


def test_vit_b16_bfloat16_trains_with_the_chosen_attention():
  """The default (attention_impl=None) on a GPU in bfloat16 is cuDNN; its
  train-mode gradient traces, compiles and matches XLA attention's."""
  assert kernels.choose_attention("gpu", jnp.bfloat16, 64) == "cudnn"
  x = jnp.asarray(np.random.RandomState(0).normal(size=(2, 224, 224, 3)),
                  jnp.float32)
  out, hlo = {}, {}
  for impl in (None, "xla"):
    model = models.get_model("vit_b_16", num_classes=10, dtype=jnp.bfloat16,
                             attention_impl=impl)
    params = model.init(jax.random.key(0), x[:1], train=False)["params"]
    params = jax.tree_util.tree_map(
        lambda p: p + 0.02 * jax.random.normal(jax.random.key(1), p.shape),
        params)

    def loss(p):
      logits = model.apply({"params": p}, x, train=True,
                           rngs={"dropout": jax.random.key(2)})
      return jnp.mean(logits.astype(jnp.float32) ** 2)
    step = jax.jit(jax.value_and_grad(loss))
    hlo[impl] = step.lower(params).as_text()
    out[impl] = step(params)
  _cudnn_ran_and_matches_xla(hlo, out)


def _cudnn_ran_and_matches_xla(hlo, out):
  """cuDNN's fused kernels ran (forward and backward), not the fallback, and
  the loss and gradients match XLA attention's (``hlo`` / ``out`` keyed by
  attention_impl None and 'xla')."""
  calls = set(re.findall(r"__cudnn\$fmha\w*", hlo[None]))
  assert any("Backward" not in c for c in calls), calls
  assert any("Backward" in c for c in calls), calls
  assert not re.findall(r"__cudnn\$fmha\w*", hlo["xla"])
  (l_c, g_c), (l_x, g_x) = out[None], out["xla"]
  assert _rel(l_c, l_x) < 3e-2
  g_c, g_x = (jnp.concatenate([t.astype(jnp.float32).ravel() for t in
                               jax.tree_util.tree_leaves(g)])
              for g in (g_c, g_x))
  assert _rel(g_c, g_x) < 5e-2


def test_naflex_bfloat16_trains_with_cudnn_sequence_lengths():
  """A NaFlex batch (odd length: 1 + 36 tokens, padding last) on a GPU in
  bfloat16 runs cuDNN with the key counts as sequence lengths, forward and
  backward, and matches XLA's masked attention."""
  from vit_jax.data import naflex as data_naflex  # pylint: disable=import-outside-toplevel
  rng = np.random.RandomState(0)
  imgs = [rng.normal(size=(h * 16, w * 16, 3)).astype(np.float32)
          for h, w in ((3, 5), (6, 6), (2, 9))]
  batch = data_naflex.collate(
      [dict(zip(data_naflex.KEYS, data_naflex.patchify(x, 16))) for x in imgs],
      36)
  batch = jax.tree_util.tree_map(jnp.asarray, batch)
  out, hlo = {}, {}
  for impl in (None, "xla"):
    model = models.get_model(dict(
        hidden_size=256, num_layers=2, num_heads=4, mlp_dim=512,
        patch_size=16, num_classes=10, classifier="token",
        naflex="bilinear_aa", naflex_grid=(8, 8)), dtype=jnp.bfloat16,
        attention_impl=impl)
    params = model.init(jax.random.key(0), batch, train=False)["params"]
    params = jax.tree_util.tree_map(
        lambda p: p + 0.02 * jax.random.normal(jax.random.key(1), p.shape),
        params)

    def loss(p, model=model):
      logits = model.apply({"params": p}, batch, train=True)
      return jnp.mean(logits.astype(jnp.float32) ** 2)
    step = jax.jit(jax.value_and_grad(loss))
    hlo[impl] = step.lower(params).as_text()
    out[impl] = step(params)
  _cudnn_ran_and_matches_xla(hlo, out)
