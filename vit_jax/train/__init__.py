"""The training library's public face: one import for the names users know.

The rooms behind it, in the order data flows:

* :mod:`vit_jax.data.sources`, :mod:`vit_jax.data.batches` -- tfds -> tf.data -> global arrays
  (``start_global``);
* :mod:`vit_jax.train.sharding` -- the mesh and where every array lives;
* :mod:`vit_jax.train.init` -- the config's model and initial weights;
* :mod:`vit_jax.train.optim` -- optimizer and learning-rate schedule;
* :mod:`vit_jax.train.step` -- train state, jitted steps, the eval loop;
* :mod:`vit_jax.train.checkpoint`, :mod:`vit_jax.train.metrics` -- what a run writes;
* :mod:`vit_jax.train.multihost` -- preemption and bounded waits between processes;
* :mod:`vit_jax.train.loop` -- :func:`train_and_evaluate`, top to bottom.

Nothing in those modules imports this one, and importing it imports none
of them: each name is looked up on first use.
"""

import importlib


_NAMES = {
    "sharding": ("batch_sharding", "make_mesh", "put_global",
                 "state_shardings", "with_shardings"),
    "init": ("build_model", "initial_variables", "load_initial_weights",
             "model_kwargs"),
    "loop": ("train_and_evaluate",),
    "step": ("Compiled", "TrainState", "abstract_train_state",
             "compile_steps", "make_eval_step", "make_init_fn",
             "make_train_step", "num_params", "reset_acc", "zero_acc"),
}
_WHERE = {name: module for module, names in _NAMES.items() for name in names}

__all__ = ["TrainState", "make_mesh", "state_shardings", "make_train_step",
           "make_eval_step", "compile_steps", "train_and_evaluate"]


def __getattr__(name):
  if name in _WHERE:
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_WHERE))
