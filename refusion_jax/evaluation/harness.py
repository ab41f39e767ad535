"""Our model as an lm-evaluation-harness `LM`: the paper's benchmark table, batched, on a sharded model.

`ReFusionLM` answers lm-eval's `generate_until` requests with the package's
decoders (`rj.ReFusion` and the baselines, through `rj.Sampler`), and is
registered as `refusion_jax` by `refusion_jax.harness` (the command line) or
`register()` (Python, then `lm_eval.simple_evaluate(model=ReFusionLM(...))`).

How requests are decoded (docs/method.md §3.4 for continuous batching):
  * per task, requests are grouped by answer length G (the task's
    `max_gen_toks` rounded up to the slot grid S × NB, capped by `gen_length`)
    and by prompt bucket (`refusion_jax.decoding.prompts.PROMPT_BUCKETS`), and
    the groups run in sorted order, each as one continuous-batching queue of
    `batch_size` rows. A group's compiled program depends only on
    (G, bucket, rows), so a later group or task with the same pair reuses it,
    and a short prompt is never padded to a long one's bucket;
  * a request's text is what `rj.Sampler(...).generate` returns for its
    prompt (continuous batching decodes every prompt as it would be decoded
    alone), then post-processed as the official `Qwen3EvalHarness` does:
    the answer is spelled with its special tokens, cut at each `until` string,
    stripped of special tokens, and — with `python_fence=true`, the default,
    which reproduces the official numbers — replaced by the body of its first
    ```python fenced block when it holds one.

Statistics per task (`TaskStats`): the official `final_stats.json` fields, with
its TPF (per answer, the mean over plan-and-infill cycles of S·slots ÷ the
cycle's forwards, docs/method.md §4; `official_tpf`) named `TPF`, next to ours:
answer tokens ÷ forwards (`tokens_per_forward`), forwards, tokens per second and
latency per sample of the decode, with compilation timed apart (`compile_seconds`,
the first call of each group's program on one prompt).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from tqdm import tqdm

from refusion_jax.checkpoints.load import load
from refusion_jax.data.chat import render_messages
from refusion_jax.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from refusion_jax.decoding.mdm import MDM_BLOCK_LENGTH
from refusion_jax.decoding.methods import METHODS, method_value
from refusion_jax.decoding.paper import PAPER_TASKS
from refusion_jax.decoding.prompts import bucket_length
from refusion_jax.decoding.refusion import ReFusion
from refusion_jax.decoding.result import PHASE_VERIFY, DecodeResult
from refusion_jax.decoding.sampler import Sampler
from refusion_jax.model.config import PRESETS
from refusion_jax.model.transformer import Transformer
from refusion_jax.parallel.mesh_spec import parse_mesh_spec
from refusion_jax.parallel.sharding import make_mesh

# The official harness's code extraction: the body of the first ```python fenced block.
PYTHON_FENCE = re.compile(r"```python\n(.*?)\n```", re.DOTALL)

# ReFusion's fields a paper task sets, and the --model_args that set them.
REFUSION_FIELDS = ("slot_size", "serial_blocks", "slot_threshold", "token_threshold")


# What --model_args may set (the constructor's arguments a command line can spell).
MODEL_ARGS = (
  "checkpoint",
  "tokenizer",
  "dtype",
  "quantize",
  "method",
  "paper_task",
  "gen_length",
  "slot_size",
  "serial_blocks",
  "slot_threshold",
  "token_threshold",
  "temperature",
  "seed",
  "batch_size",
  "mesh",
  "python_fence",
  "stats_dir",
  "sample_stats",
)


class HarnessArgumentError(ValueError):
  """A `--model_args` value that cannot work; the command line prints it and exits with status 2."""


def check_model_args(args: Mapping[str, Any]) -> None:
  """Refuse what cannot work before anything is loaded: unknown keys, an unknown method or paper task, a mesh
  that does not fit the devices, a local checkpoint path that does not exist (the command line checks this
  before lm-eval indexes its tasks)."""
  unknown = sorted(set(args) - set(MODEL_ARGS) - {"model"})
  if unknown:
    raise HarnessArgumentError(
      f"Unknown --model_args key(s) {', '.join(unknown)}; the keys are: {', '.join(MODEL_ARGS)}."
    )
  method, paper_task = args.get("method", "refusion"), args.get("paper_task")
  if method not in METHODS:
    raise HarnessArgumentError(f"method={method!r}: choose one of {', '.join(METHODS)}.")  # the method classes
  if paper_task is not None and paper_task not in PAPER_TASKS:
    raise HarnessArgumentError(f"paper_task={paper_task!r} is not one of the paper's tasks: {', '.join(PAPER_TASKS)}.")
  if isinstance(args.get("mesh"), str):
    build_mesh(args["mesh"])
  checkpoint = args.get("checkpoint")
  if checkpoint is not None and "://" not in str(checkpoint) and not os.path.exists(str(checkpoint)):
    if str(checkpoint) not in PRESETS:
      raise HarnessArgumentError(
        f"checkpoint={checkpoint!r} does not exist: give a training workdir, a Hugging Face, tunix or MaxText"
        f" checkpoint directory, or a preset name for a random model ({', '.join(PRESETS)})."
      )


def build_mesh(mesh: str | jax.sharding.Mesh | None) -> jax.sharding.Mesh | None:
  """The decode mesh of the `mesh` argument: a `Mesh` as given, a spec for `parse_mesh_spec` over every device of
  every process, or (None) all devices on the data axis when there are several, else no mesh."""
  if isinstance(mesh, jax.sharding.Mesh):
    return mesh
  if mesh is None:
    return make_mesh({"data": -1}) if jax.device_count() > 1 else None
  try:
    shape = parse_mesh_spec(str(mesh))
  except ValueError as error:  # it names the spec and shows the syntax
    raise HarnessArgumentError(str(error)) from error
  try:
    return make_mesh(shape)
  except ValueError as error:  # the mesh does not fit the devices: make_mesh says how
    raise HarnessArgumentError(f"mesh={mesh!r}: {error}") from error


def answer_grid(method: str, settings: Mapping[str, Any]) -> int:
  """The multiple every answer length of `method` must be: S × NB for ReFusion, MDM's block, 1 for AR."""
  if method == "refusion":
    return settings["slot_size"] * settings["serial_blocks"]
  if method == "mdm":
    return min(MDM_BLOCK_LENGTH, settings["gen_length"])  # MDM's block when it follows G
  return 1


def answer_length(max_gen_toks: int | None, gen_length: int, grid: int) -> int:
  """G of a request: its `max_gen_toks` rounded up to the grid, at most `gen_length` (all of it when unset)."""
  if max_gen_toks is None:
    return gen_length
  return min(gen_length, grid * math.ceil(int(max_gen_toks) / grid))


def fitted_serial_blocks(slots: int, serial_blocks: int) -> int:
  """The most serial blocks, at most `serial_blocks`, that split `slots` slots evenly: a paper task's NB for a
  shorter answer (gsm8k_cot's NB = 4 at G = 64, S = 32 is 2). Explicit serial_blocks are never changed."""
  return max(n for n in range(1, min(slots, serial_blocks) + 1) if slots % n == 0)


def official_tpf(result: DecodeResult, row: int, slot_size: int) -> float:
  """The official harness's TPF of one answer: the mean over its plan-and-infill cycles of S·slots ÷ the cycle's
  forwards.

  A cycle is a plan and a global verification, plus a draft and a check per
  infill iteration when the verification commits nothing: S·slots / 2 or
  S·slots / (2 + 2n) after n infill iterations (the `sum_TPF` terms of the
  official generate.py, whose mean over cycles its harness reports as TPF). The
  decode result gives each cycle's slots and phase, and each answer's infill
  iterations only in all: they are spread evenly over its infill cycles, which
  is exact when an answer has at most one infill cycle or all take as many.
  """
  length = len(result.tokens[row])
  cycles = result.commit_iteration[row, :length]
  phases = result.commit_phase[row, :length]
  committed = np.unique(cycles[cycles >= 0])
  if len(committed) == 0:
    return 0.0
  # Forwards: the prefill, a plan and a verification per cycle, a draft and a check per infill iteration.
  infill_iterations = (int(result.num_forwards[row]) - 1 - 2 * int(result.steps[row])) / 2
  infill = {int(c) for c in committed if phases[cycles == c][0] != PHASE_VERIFY}
  per_infill_cycle = infill_iterations / max(len(infill), 1)
  total = 0.0
  for cycle in committed:
    slots = len(np.unique(np.flatnonzero(cycles == cycle) // slot_size))
    total += slot_size * slots / (2 + 2 * (per_infill_cycle if int(cycle) in infill else 0))
  return total / len(committed)


@dataclasses.dataclass
class TaskStats:
  """What one task's decode cost, summed over its groups (see the module docstring for each figure)."""

  samples: int = 0
  tokens: int = 0
  forwards: int = 0
  decode_seconds: float = 0.0
  compile_seconds: float = 0.0
  official_tpf_sum: float = 0.0
  groups: list[dict[str, Any]] = dataclasses.field(default_factory=list)

  def summary(self, rows: int) -> dict[str, Any]:
    """The official `final_stats.json` fields (official names and TPF definition) followed by ours."""
    n, seconds = max(self.samples, 1), self.decode_seconds
    return {
      "processed_samples": self.samples,
      "total_samples": self.samples,
      "total_tokens": self.tokens,
      "total_time": seconds,
      "total_TPF": self.official_tpf_sum,
      "tokens_per_second": self.tokens / seconds if seconds > 0 else 0.0,
      "latency": seconds / n,
      "TPF": self.official_tpf_sum / n,
      # Ours.
      "tokens_per_forward": self.tokens / max(self.forwards, 1),
      "forwards": self.forwards,
      "decode_seconds": seconds,
      "latency_per_sample": seconds / n,
      "compile_seconds": self.compile_seconds,
      "rows": rows,
      "groups": self.groups,
    }


class ReFusionLM(LM):
  """lm-evaluation-harness's model `refusion_jax`: generative tasks decoded by ReFusion or a baseline.

  Every argument but `model` can be given in `--model_args` (key=value, comma-separated; `MODEL_ARGS`).
  """

  def __init__(
    self,
    checkpoint: str | None = None,
    *,
    model: Transformer | None = None,
    tokenizer: str | Tokenizer | None = None,
    dtype: str | None = None,
    quantize: str | None = None,
    method: str = "refusion",
    paper_task: str | None = None,
    gen_length: int | None = None,
    slot_size: int | None = None,
    serial_blocks: int | None = None,
    slot_threshold: float | None = None,
    token_threshold: float | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int | str | None = None,
    mesh: str | jax.sharding.Mesh | None = None,
    python_fence: bool = True,
    stats_dir: str | None = None,
    sample_stats: bool = False,
    max_batch_size: int | None = None,
    device: str | None = None,
  ):
    """
    Args:
      checkpoint: any source `rj.load` reads (a run's workdir, a HF / tunix / MaxText directory, a preset).
      model: a loaded model instead of `checkpoint` (Python use; `tokenizer` then names or is its tokenizer).
      tokenizer: "bytes", a tokenizer directory (replacing the checkpoint's own), or a `Tokenizer`.
      dtype: compute dtype to load the model in (e.g. "bfloat16").
      quantize: "int8" or "int4" projection kernels, quantized while loading (refusion_jax.model.quant).
      method: "refusion", or the baselines "ar" and "mdm".
      paper_task: take the paper's settings for this task (`PAPER_TASKS`, G = 512); explicit fields override.
      gen_length: the longest answer G; a task's `max_gen_toks` shortens it, rounded up to the slot grid.
      slot_size, serial_blocks, slot_threshold, token_threshold: ReFusion's fields (docs/method.md §2).
      temperature, seed: sampling of the plan step (0: greedy).
      batch_size: rows kept busy by continuous batching (default: lm-eval's --batch_size, 1 if unset).
      mesh: "axis:size" pairs joined by "+" (e.g. "data:-1", "fsdp:4+tensor:2") or a `Mesh`: the model is
        sharded over it and rows split over its batch axes; default: every device on the data axis.
      python_fence: replace an answer holding a ```python fenced block by the block's body (the official
        harness does, for every task; keep it on to reproduce its numbers).
      stats_dir: write each task's statistics to stats_dir/TASK/final_stats.json (process 0 only).
      sample_stats: also write stats_dir/TASK/sample_stats.jsonl, one line per request.
      max_batch_size, device: given by lm-eval's command line; ignored (the mesh places the model).
    """
    super().__init__()
    del max_batch_size, device
    check_model_args(dict(method=method, paper_task=paper_task))
    fields = dict(slot_size=slot_size, serial_blocks=serial_blocks)
    fields.update(slot_threshold=slot_threshold, token_threshold=token_threshold)
    if method != "refusion" and any(v is not None for v in fields.values()):
      raise HarnessArgumentError(
        f"{', '.join(k for k, v in fields.items() if v is not None)} apply to method=refusion only."
      )
    if (model is None) == (checkpoint is None):
      raise HarnessArgumentError("Give exactly one of checkpoint=PATH (any format rj.load reads) and model=.")
    self.method = method
    self.settings = self._settings(method, paper_task, gen_length, fields)
    self.grid = answer_grid(method, self.settings)
    if self.settings["gen_length"] % self.grid:
      raise HarnessArgumentError(
        f"gen_length={self.settings['gen_length']} is not a multiple of slot_size × serial_blocks = {self.grid}."
      )
    self.rows = _positive_int("batch_size", 1 if batch_size is None else batch_size)
    self.mesh = build_mesh(mesh)
    if model is None:
      self.model, self.tokenizer = self._load(checkpoint, tokenizer, dtype, quantize)
    else:
      self.model = model
      self.tokenizer = load_tokenizer(tokenizer or "bytes") if isinstance(tokenizer, (str, type(None))) else tokenizer
    self.python_fence = bool(python_fence)
    self.stats_dir, self.sample_stats = stats_dir, bool(sample_stats)
    self.temperature, self.seed = float(temperature), int(seed)
    self.name = str(checkpoint or "model")
    self._samplers: dict[int, Sampler] = {}
    self._compiled: set[tuple[int, int]] = set()  # (G, prompt bucket) programs already compiled
    self.stats: dict[str, TaskStats] = {}

  @classmethod
  def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> ReFusionLM:
    """From `--model_args`: unknown keys are refused, `batch_size` there wins over lm-eval's `--batch_size`."""
    from lm_eval.utils import simple_parse_args_string

    return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

  @classmethod
  def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> ReFusionLM:
    check_model_args(arg_dict)
    extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
    return cls(**arg_dict, **extra)

  @staticmethod
  def _settings(method: str, paper_task: str | None, gen_length: int | None, fields: dict) -> dict[str, Any]:
    """The decode settings: the method's defaults, then the paper task's, then the explicit ones."""
    task = dataclasses.asdict(PAPER_TASKS[paper_task]) if paper_task else {}
    length = _positive_int("gen_length", gen_length or task.get("gen_length", METHODS[method]().gen_length))
    settings = dict(gen_length=length)
    if method == "refusion":
      default = ReFusion()
      settings.update({k: task.get(k, getattr(default, k)) for k in REFUSION_FIELDS})
      settings.update({k: v for k, v in fields.items() if v is not None})
      for name in ("slot_size", "serial_blocks"):
        settings[name] = _positive_int(name, settings[name])
      if fields["serial_blocks"] is None and length % settings["slot_size"] == 0:
        settings["serial_blocks"] = fitted_serial_blocks(length // settings["slot_size"], settings["serial_blocks"])
    return settings

  def _load(
    self, checkpoint: str, tokenizer: str | None, dtype: str | None, quantize: str | None
  ) -> tuple[Transformer, Tokenizer]:
    try:
      return load(str(checkpoint), tokenizer=tokenizer, dtype=dtype, mesh=self.mesh, quantize=quantize)
    except (FileNotFoundError, ValueError) as error:
      raise HarnessArgumentError(f"checkpoint={checkpoint!r} could not be loaded: {error}") from error

  # --- lm-eval's interface -------------------------------------------------------------------------------

  @property
  def tokenizer_name(self) -> str:
    return type(self.tokenizer).__name__ + "_" + re.sub(r"[^A-Za-z0-9_.-]", "__", self.name)

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    return getattr(self.tokenizer, "chat_template", None) or ""

  def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The chat as the model's template renders it, with thinking on; without `add_generation_prompt` the final
    (assistant) message is continued, as the official harness does for tasks with a `gen_prefix`
    (`refusion_jax.data.chat.render_messages`)."""
    return render_messages(self.tokenizer, chat_history, add_generation_prompt)

  def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
    raise NotImplementedError(_GENERATIVE_ONLY)

  def loglikelihood_rolling(self, requests: list[Instance]) -> list[float]:
    raise NotImplementedError(_GENERATIVE_ONLY)

  def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
    """Every request's answer text, in request order; each task's requests go through its own queues."""
    answers: list[str | None] = [None] * len(requests)
    by_task: dict[str, list[int]] = {}
    for index, request in enumerate(requests):
      by_task.setdefault(request.task_name or "generate_until", []).append(index)
    for task, indices in by_task.items():
      texts, samples = self.decode_task(task, [requests[i] for i in indices], disable_tqdm)
      for i, text in zip(indices, texts):
        answers[i] = text
      if self.stats_dir is not None and jax.process_index() == 0:
        self._write_stats(task, samples)
    return answers

  # --- decoding ------------------------------------------------------------------------------------------

  def sampler(self, gen_length: int) -> Sampler:
    """The `rj.Sampler` that decodes answers of `gen_length` tokens with this model's settings (MDM's block and
    steps follow G)."""
    if gen_length not in self._samplers:
      method = method_value(self.method, dict(self.settings, gen_length=gen_length, temperature=self.temperature))
      self._samplers[gen_length] = Sampler(
        self.model, self.tokenizer, method, batch_size=self.rows, seed=self.seed, mesh=self.mesh
      )
    return self._samplers[gen_length]

  def decode_task(
    self, task: str, requests: Sequence[Instance], disable_tqdm: bool = False
  ) -> tuple[list[str], list[dict[str, Any]]]:
    """One task's answer texts (request order) and per-request statistics; updates `self.stats[task]`."""
    contexts = [request.args[0] for request in requests]
    options = [request.args[1] if len(request.args) > 1 else {} for request in requests]
    until = [_stop_strings(o.get("until")) for o in options]
    lengths = [answer_length(o.get("max_gen_toks"), self.settings["gen_length"], self.grid) for o in options]
    prompt_ids = [self.sampler(g).encode(c) for g, c in zip(lengths, contexts)]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (g, ids) in enumerate(zip(lengths, prompt_ids)):
      groups.setdefault((g, bucket_length(len(ids))), []).append(i)
    stats = self.stats.setdefault(task, TaskStats())
    texts: list[str] = [""] * len(requests)
    samples: list[dict[str, Any]] = [{} for _ in requests]
    bar = tqdm(total=len(requests), desc=f"{task}", disable=disable_tqdm or jax.process_index() != 0)
    for (gen_length, bucket), members in sorted(groups.items()):
      sampler = self.sampler(gen_length)
      ids = [prompt_ids[i] for i in members]
      if (gen_length, bucket) not in self._compiled:  # compile apart: the first call on one prompt
        stats.compile_seconds += sampler.decode_ids(ids[:1]).seconds
        self._compiled.add((gen_length, bucket))
      result = sampler.decode_ids(ids)
      stats.decode_seconds += result.seconds
      stats.samples += len(members)
      stats.forwards += int(np.sum(result.num_forwards))
      group = dict(gen_length=gen_length, prompt_bucket=bucket, requests=len(members), seconds=result.seconds)
      stats.groups.append(group)
      for row, i in enumerate(members):
        texts[i] = self.answer_text(result.tokens[row], until[i])
        tpf = official_tpf(result, row, self.settings["slot_size"]) if self.method == "refusion" else float("nan")
        stats.tokens += len(result.tokens[row])
        stats.official_tpf_sum += 0.0 if math.isnan(tpf) else tpf
        samples[i] = dict(
          doc_id=requests[i].doc_id,
          prompt_tokens=len(prompt_ids[i]),
          gen_length=gen_length,
          tokens=len(result.tokens[row]),
          forwards=int(result.num_forwards[row]),
          tokens_per_forward=float(result.tpf[row]),
          TPF=tpf,
        )
      bar.update(len(members))
      bar.set_postfix(tokens_per_forward=f"{stats.tokens / max(stats.forwards, 1):.2f}")
    bar.close()
    return texts, samples

  def answer_text(self, tokens: Sequence[int], until: Sequence[str]) -> str:
    """The official post-processing of one answer: spelled with its special tokens, cut at each stop string in
    turn, stripped of special tokens, then (with `python_fence`) the body of its ```python block if it has one."""
    text = self._spell(tokens, skip_special_tokens=False)
    for stop in until:
      text = text.split(stop)[0]
    text = self._spell(self.tokenizer.encode(text), skip_special_tokens=True)
    match = PYTHON_FENCE.search(text) if self.python_fence else None
    return match.group(1) if match else text

  def _spell(self, tokens: Sequence[int], skip_special_tokens: bool) -> str:
    if isinstance(self.tokenizer, HFTokenizer):
      return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)
    return self.tokenizer.decode(tokens)  # the byte tokenizer's special ids have no spelling

  def _write_stats(self, task: str, samples: list[dict[str, Any]]) -> None:
    directory = os.path.join(self.stats_dir, task)
    os.makedirs(directory, exist_ok=True)
    summary = dict(self.stats[task].summary(self.rows), method=self.method, settings=self.settings)
    with open(os.path.join(directory, "final_stats.json"), "w", encoding="utf-8") as f:
      json.dump(summary, f, indent=2)
    if self.sample_stats:
      with open(os.path.join(directory, "sample_stats.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(sample) + "\n" for sample in samples)


_GENERATIVE_ONLY = (
  "refusion_jax scores generative tasks only (the paper's table is generative): log-likelihood tasks such as"
  " arc_challenge, mmlu or gpqa_main_n_shot have generative variants to use instead — arc_challenge_chat,"
  " mmlu_pro, gpqa_main_generative_n_shot (and gsm8k_cot, minerva_math, humaneval_instruct_noprefix, mbpp)."
)


def _positive_int(name: str, value: Any) -> int:
  if isinstance(value, bool) or not re.fullmatch(r"\d+", str(value)) or int(value) < 1:
    raise HarnessArgumentError(f"{name}={value!r}: give a positive integer.")
  return int(value)


def _stop_strings(until: str | Sequence[str] | None) -> list[str]:
  if until is None:
    return []
  return [until] if isinstance(until, str) else list(until)


def register() -> type[ReFusionLM]:
  """Register `ReFusionLM` as lm-eval's model "refusion_jax" (lm-eval's own models stay available)."""
  import lm_eval.models  # noqa: F401  (an external registration hides the built-in models until this import)
  from lm_eval.api.registry import register_model

  return register_model("refusion_jax")(ReFusionLM)  # registering the same class again is a no-op
