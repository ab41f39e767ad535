"""Training and evaluation data: built-in tasks, tfds array_record builders, the grain pipeline.

- `tasks`: locally generated verifiable tasks and their answer checker.
- `builders`: tfds builders writing raw text to array_record (no TensorFlow).
- `pipeline`: grain pipeline from records to fixed-shape token batches.

Names are imported lazily, so using the tasks or the pipeline does not import
tensorflow-datasets.
"""

import importlib

_EXPORTS = {
  "TASKS": "refusion_jax.data.tasks",
  "check_answer": "refusion_jax.data.tasks",
  "generate_examples": "refusion_jax.data.tasks",
  "build_refusion_tasks": "refusion_jax.data.builders",
  "build_query_response_json": "refusion_jax.data.builders",
  "make_dataset": "refusion_jax.data.pipeline",
  "batch_prompts_and_answers": "refusion_jax.data.pipeline",
  "pad_fraction": "refusion_jax.data.pipeline",
  "decode_record": "refusion_jax.data.pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'refusion_jax.data' has no attribute {name!r}")
