"""Decode a test set by continuous batching, check every answer, and time the decoding with compilation set apart.

Examples are grouped by task before decoding (a call never mixes tasks), so
each task's tokens per second is measured on that task alone, as a benchmark
is run on its own. Each decode call keeps `batch_size` rows busy over up to
`PROMPTS_PER_ROW` × `batch_size` prompts (a finished row takes the next
prompt, `refusion_jax.decoding.batching`). The first call of every new program
shape (rows × prompt bucket) compiles: that call is timed as
compilation and decoded again for the measurement, so compilation never
enters tokens per second or latency.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import numpy as np
import tqdm

from refusion_jax.benchmarks.timer import time_rounds
from refusion_jax.data.tokenizer import Tokenizer
from refusion_jax.decoding.contract import Method
from refusion_jax.decoding.options import DecodeOptions
from refusion_jax.decoding.result import DecodeResult
from refusion_jax.decoding.sampler import Sampler
from refusion_jax.model.transformer import Transformer
from refusion_jax.training.validation import Answer, check_answers

# A decode call's prompts per row kept busy: enough to keep the rows full between calls.
PROMPTS_PER_ROW = 4


@dataclasses.dataclass
class BatchTiming:
  """Wall-clock of one decode call (compilation excluded) and of its compilation, if it had one.

  rows: prompts the call decoded; forwards: batched forwards it ran (loop
  iterations and one prefill per prompt).
  """

  task: str
  rows: int
  seconds: float
  forwards: int
  compile_seconds: float = 0.0


@dataclasses.dataclass
class EvalRun:
  """Everything a pass over a test set measured."""

  answers: list[Answer]
  batches: list[BatchTiming]


def task_batches(examples: Sequence[dict], batch_size: int) -> list[list[int]]:
  """Indices of `examples` grouped by task (in order of first appearance), cut into batches of `batch_size`.

  A batch never mixes tasks; each task's last batch may be shorter.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size={batch_size} must be at least 1.")
  by_task: dict[str, list[int]] = {}
  for index, example in enumerate(examples):
    by_task.setdefault(example.get("task", ""), []).append(index)
  return [rows[i : i + batch_size] for rows in by_task.values() for i in range(0, len(rows), batch_size)]


def timed_decode(call: Callable[[], DecodeResult], repeats: int = 1) -> tuple[DecodeResult, float, float]:
  """(result, run seconds, compile seconds) of a deterministic decode `call()`, timed as every benchmark times
  (`benchmarks.timer`): the median of `repeats` runs. A first call that compiled is the warm-up, timed as
  compilation (less one run); one that compiled nothing (a program shape an earlier batch compiled) is the first
  run, so that a pass over a test set decodes each batch once unless it compiles or `repeats` > 1.
  """
  results, timings = time_rounds({"decode": call}, repeats, warm_up="if_compiled", progress=False)
  return results["decode"], timings["decode"].median, timings["decode"].compile_seconds


def run(
  model: Transformer,
  tokenizer: Tokenizer,
  examples: Sequence[dict],
  *,
  method: Method,
  options: DecodeOptions,
  chat_template: bool = False,
  repeats: int = 1,
  progress: bool = True,
) -> EvalRun:
  """Decode every example ({query, response[, task]}) with `method` and check its answer.

  Args:
    method: the method value (`rj.ReFusion(...)`, `rj.AR(...)`, `rj.MDM(...)`, or any registered one).
    options: how to decode (`rj.DecodeOptions`; its `rows`, K, required: continuous batching over each call's
      prompts).
    chat_template: wrap queries in the tokenizer's chat template, as training did.
    repeats: time each batch this many times and report the median (see `timed_decode`).
    progress: show a progress bar.
  """
  if not examples:
    raise ValueError("The test set is empty; give a split with examples or a JSON file with records.")
  answers: list[Answer | None] = [None] * len(examples)
  timings = []
  bar = tqdm.tqdm(total=len(examples), unit="answer", disable=not progress, dynamic_ncols=True)
  done = correct = 0
  if options.rows is None:
    raise ValueError("The evaluation decodes in rows: give DecodeOptions(rows=K).")
  sampler = Sampler(model, tokenizer, method, options, chat_template=chat_template)
  for rows in task_batches(examples, options.rows * PROMPTS_PER_ROW):
    prompts = [sampler.encode(examples[i]["query"]) for i in rows]
    call = functools.partial(sampler.decode_ids, prompts)
    result, seconds, compile_seconds = timed_decode(call, repeats)
    task = examples[rows[0]].get("task", "")
    timings.append(
      BatchTiming(
        task=task,
        rows=len(rows),
        seconds=seconds,
        forwards=result.batched_forwards,
        compile_seconds=compile_seconds,
      )
    )
    for index, answer in zip(rows, check_answers([examples[i] for i in rows], tokenizer, result)):
      answers[index] = answer
      correct += answer.correct
    done += len(rows)
    bar.update(len(rows))
    bar.set_postfix(accuracy=f"{correct / done:.3f}", refresh=False)
  bar.close()
  return EvalRun(answers=answers, batches=timings)


def _group_metrics(answers: Sequence[Answer], batches: Sequence[BatchTiming]) -> dict[str, float]:
  tokens = sum(a.num_tokens for a in answers)
  forwards = sum(a.num_forwards for a in answers)
  seconds = sum(b.seconds for b in batches)
  return dict(
    count=len(answers),
    accuracy=float(np.mean([a.correct for a in answers])),
    mean_forwards=forwards / len(answers),
    mean_tokens=tokens / len(answers),
    tpf=tokens / max(forwards, 1),
    tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
    latency_s=seconds / len(batches),
    seconds_per_answer=seconds / len(answers),
    seconds_per_forward=seconds / max(sum(b.forwards for b in batches), 1),
  )


def summarize(run_: EvalRun) -> dict:
  """Metrics overall and per task.

  accuracy: share of answers judged correct; mean_forwards: forwards per
  answer; tpf: answer tokens ÷ forwards; tokens_per_s: answer tokens ÷ decode
  seconds (compilation excluded); latency_s: mean wall-clock of a decode call,
  i.e. how long the last of its answers waited; seconds_per_answer: decode
  seconds ÷ answers; seconds_per_forward: decode seconds ÷ the batched forwards
  the calls ran (what one forward costs at this batch size);
  compile_s: seconds spent compiling (reported apart).
  """
  metrics = _group_metrics(run_.answers, run_.batches)
  metrics["compile_s"] = sum(b.compile_seconds for b in run_.batches)
  tasks = sorted({a.task for a in run_.answers if a.task})
  metrics["by_task"] = {
    task: _group_metrics([a for a in run_.answers if a.task == task], [b for b in run_.batches if b.task == task])
    for task in tasks
  }
  return metrics
