"""The training library's public face: one import for the names users know.

The rooms behind it, in the order data flows:

* :mod:`vit_jax.input_pipeline` -- tfds -> tf.data -> global arrays
  (``start_global``);
* :mod:`vit_jax.sharding` -- the mesh and where every array lives;
* :mod:`vit_jax.train_init` -- the config's model and initial weights;
* :mod:`vit_jax.optim` -- optimizer and learning-rate schedule;
* :mod:`vit_jax.train_step` -- train state, jitted steps, the eval loop;
* :mod:`vit_jax.checkpoint`, :mod:`vit_jax.metrics` -- what a run writes;
* :mod:`vit_jax.multihost` -- preemption and bounded waits between processes;
* :mod:`vit_jax.train_loop` -- :func:`train_and_evaluate`, top to bottom.

Nothing in those modules imports this one.
"""

# pylint: disable=unused-import
from vit_jax.sharding import (batch_sharding, make_mesh, put_global,  # noqa: F401
                              state_shardings, with_shardings)
from vit_jax.train_init import (build_model, initial_variables,  # noqa: F401
                                load_initial_weights, model_kwargs)
from vit_jax.train_loop import train_and_evaluate  # noqa: F401
from vit_jax.train_step import (Compiled, TrainState, abstract_train_state,  # noqa: F401
                                compile_steps, make_eval_step, make_init_fn,
                                make_train_step, num_params, reset_acc,
                                zero_acc)

__all__ = ["TrainState", "make_mesh", "state_shardings", "make_train_step",
           "make_eval_step", "compile_steps", "train_and_evaluate"]
