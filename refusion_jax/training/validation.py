"""Validation during training: the loss on validation batches, and exact match and tokens per forward of decoding.

(The command-line evaluation of a finished checkpoint is `python -m refusion_jax.eval`, `refusion_jax.evaluation`.)

Decoding uses the method that matches the objective (`methods.METHODS`:
ReFusion's plan-and-infill, docs/method.md §2, for "refusion", the AR or MDM
baseline otherwise), its fields set from `config.eval` (`methods.config_method`),
through a `Sampler`: the tokenizer's special ids, then the config's, as every
other caller resolves them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from refusion_jax.data import pipeline
from refusion_jax.data.tasks import is_correct
from refusion_jax.data.tokenizer import Tokenizer
from refusion_jax.decoding.contract import Method
from refusion_jax.decoding.methods import config_method
from refusion_jax.decoding.result import DecodeResult
from refusion_jax.decoding.sampler import Sampler
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


def eval_method(config: ml_collections.ConfigDict) -> Method:
  """The method value validation decodes with: the objective's method, its fields from `config.eval`."""
  return config_method(config.objective.kind, config.eval)


@dataclasses.dataclass
class Answer:
  """One decoded example: what was asked, what came back, whether it is right and what it cost."""

  task: str
  query: str
  reference: str
  answer: str
  correct: bool
  num_tokens: int  # answer tokens, EOS included
  num_forwards: int  # forwards this row took part in


def check_answers(examples: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, result: DecodeResult) -> list[Answer]:
  """The one scorer of a test split (validation and `python -m refusion_jax.eval`): each example's
  ({query, response[, task]}) decoded answer, judged as the training evaluation does (`tasks.is_correct`:
  built-in tasks by re-solving the query, other records by exact match after whitespace normalisation)."""
  answers = []
  for row, example in enumerate(examples):
    text = tokenizer.decode(result.tokens[row])
    answers.append(
      Answer(
        task=example.get("task", ""),
        query=example["query"],
        reference=example["response"],
        answer=text,
        correct=is_correct(example, text),
        num_tokens=len(result.tokens[row]),
        num_forwards=int(result.num_forwards[row]),
      )
    )
  return answers


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
  # eval.batch_size rows kept busy over every prompt (continuous batching), not batches waiting for their slowest row.
  sampler = Sampler(
    model,
    tokenizer,
    eval_method(config),
    rows=config.eval.batch_size,
    chat_template=config.data.chat_template,
    mesh=mesh,
  )
  answers = []
  if examples:
    result = sampler.decode_ids([sampler.encode(ex["query"]) for ex in examples])
    answers = check_answers(examples, tokenizer, result)
  samples = [
    dict(task=a.task, query=a.query, answer=a.answer, reference=a.reference, correct=a.correct) for a in answers
  ]
  answer_tokens, forwards = sum(a.num_tokens for a in answers), sum(a.num_forwards for a in answers)
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
