"""Validation during training: the loss on validation batches, and exact match and tokens per forward of decoding.

(The command-line evaluation of a finished checkpoint is `python -m refusion_jax.eval`, `refusion_jax.evaluation`.)

Decoding uses the method that matches the objective (`sampler.METHODS`:
ReFusion's plan-and-infill, docs/method.md §2, for "refusion", the AR or MDM
baseline decoder otherwise), with the knobs of `config.eval`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from refusion_jax.data import pipeline
from refusion_jax.data.tasks import is_correct
from refusion_jax.data.tokenizer import Tokenizer, format_prompt
from refusion_jax.decoding.defaults import method_defaults
from refusion_jax.decoding.result import DecodeResult
from refusion_jax.decoding.sampler import METHODS
from refusion_jax.model.transformer import Transformer
from refusion_jax.training.state import Placement

# The metrics of the training objective that the validation loss averages.
LOSS_METRICS = ("loss", "ar_loss", "mdm_loss")
# What the end-of-training summary says about comparing its numbers with another machine's.
REPRODUCIBILITY = (
  "On another machine the same config and seed give the same data and schedule, but the losses, exact match and "
  "tokens per forward may differ: another CPU or accelerator (or XLA version) sums in another floating-point order, "
  "and training amplifies that into another draw from the spread over seeds (the README gives the demo's)."
)
# Decoder keyword -> the `config.eval` field that sets it.
EVAL_KNOBS = dict(
  gen_length="gen_length",
  slot_size="slot_size",
  serial_blocks="serial_blocks",
  slot_threshold="slot_threshold",
  token_threshold="token_threshold",
  block_length="mdm_block_length",
  steps="mdm_steps",
)


def eval_knobs(method: str, eval_config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The keyword arguments of `method`'s decoder: its defaults (`method_defaults`), set from `eval_config`."""
  return {name: eval_config[EVAL_KNOBS[name]] for name in method_defaults(method, eval_config.gen_length)}


def decode_answers(
  model: Transformer,
  prompts: list[list[int]],
  config: ml_collections.ConfigDict,
  batch_size: int | None = None,
  mesh: jax.sharding.Mesh | None = None,
) -> DecodeResult:
  """Decode with the method matching `config.objective.kind` and the knobs of `config.eval`.

  batch_size: rows kept busy by continuous batching over all `prompts`; None decodes them as one batch.
  mesh: decode on this mesh (the training mesh during a run, where the parameters already are); None: one device.
  """
  kind = config.objective.kind
  return METHODS[kind](model, prompts, **eval_knobs(kind, config.eval), batch_size=batch_size, mesh=mesh)


def evaluate_decoding(
  model: Transformer,
  records: Sequence[Mapping[str, Any]],
  tokenizer: Tokenizer,
  config: ml_collections.ConfigDict,
  mesh: jax.sharding.Mesh | None = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
  """Exact match and tokens per forward over the first `config.eval.num_examples` records.

  Prompts are built as the training data builds them (`format_prompt`). A run decodes on its training `mesh`:
  the parameters stay where training put them, and a job of several processes decodes as one.

  Returns:
    ({exact_match, tpf, mean_forwards, exact_match_<task> per built-in task},
     [{task, query, answer, reference, correct}]).
  """
  count = min(config.eval.num_examples, len(records))
  examples = [pipeline.decode_record(records[i]) for i in range(count)]
  prompts = [tokenizer.encode(format_prompt(tokenizer, ex["query"], config.data.chat_template)) for ex in examples]
  samples = []
  if examples:
    # eval.batch_size rows kept busy over every prompt (continuous batching), not batches waiting for their slowest row.
    result = decode_answers(model, prompts, config, batch_size=config.eval.batch_size, mesh=mesh)
    answer_tokens, forwards = sum(len(t) for t in result.tokens), int(np.sum(result.num_forwards))
    for ex, tokens in zip(examples, result.tokens):
      answer = tokenizer.decode(tokens)
      correct = is_correct(ex, answer)
      samples.append(
        dict(task=ex.get("task", ""), query=ex["query"], answer=answer, reference=ex["response"], correct=correct)
      )
  else:
    answer_tokens = forwards = 0
  metrics = dict(
    exact_match=float(np.mean([s["correct"] for s in samples])) if samples else 0.0,
    tpf=answer_tokens / max(forwards, 1),
    mean_forwards=forwards / max(count, 1),
  )
  by_task: dict[str, list[bool]] = {}
  for sample in samples:
    if sample["task"]:
      by_task.setdefault(sample["task"], []).append(sample["correct"])
  metrics.update({f"exact_match_{task}": float(np.mean(correct)) for task, correct in sorted(by_task.items())})
  return metrics, samples


def evaluate_loss(
  eval_fn: Callable[[nnx.State, dict, jax.Array], dict],
  params: nnx.State,
  batches: Iterable[Mapping[str, np.ndarray]],
  *,
  num_batches: int,
  seed: int,
  placement: Placement,
) -> dict[str, float]:
  """Mean training-objective metrics (`LOSS_METRICS`) over the first `num_batches` of `batches`.

  The objective's randomness uses a fixed key per batch, so the number is
  comparable across evaluations.
  """
  totals, count = dict.fromkeys(LOSS_METRICS, 0.0), 0
  key = jax.random.PRNGKey(seed + 2)
  for index, batch in enumerate(batches):
    if index >= num_batches:
      break
    metrics = jax.device_get(eval_fn(params, placement.batch(batch), jax.random.fold_in(key, index)))
    for name in LOSS_METRICS:
      totals[name] += float(metrics[name])
    count += 1
  return {name: value / max(count, 1) for name, value in totals.items()} if count else {}


def format_samples(samples: Sequence[Mapping[str, Any]]) -> str:
  """One line per decoded sample: verdict, query, answer and reference."""
  return "\n".join(
    f"[{'ok' if s['correct'] else 'wrong'}] {s['query']!r} -> {s['answer']!r} (reference {s['reference']!r})"
    for s in samples
  )


def format_report(step: int, metrics: Mapping[str, float], samples: Sequence[Mapping[str, Any]], shown: int) -> str:
  """The end-of-training summary of an evaluation: `shown` samples, exact match (per task) and TPF."""
  by_task = ", ".join(
    f"{key.removeprefix('exact_match_')} {value:.3f}"
    for key, value in metrics.items()
    if key.startswith("exact_match_")
  )
  return "\n".join(
    [
      f"Samples at step {step}:",
      format_samples(samples[:shown]),
      f"Validation exact match {metrics['exact_match']:.3f} over {len(samples)} examples"
      + (f" ({by_task})" if by_task else "")
      + f", tokens per forward {metrics['tpf']:.2f}.",
      REPRODUCIBILITY,
    ]
  )
