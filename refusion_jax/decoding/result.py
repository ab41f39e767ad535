"""What a decode call returns (`DecodeResult`), and the codes its trace and its width counters use.

Every decoder reports per prompt the answer, its forwards and steps, and per
answer position the iteration and the *phase* that committed it. ReFusion
also counts its forwards by *stage* (what a row's next forward is,
docs/method.md §3.2). Both sets of codes live here, the one place the jitted
loops, the eager reference and the trace plots read them from.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# How each answer position was committed (`DecodeResult.commit_phase`).
PHASE_NONE = -1
PHASE_VERIFY = 0  # committed as a whole slot by the global verification (docs/method.md §2 step 2)
PHASE_INFILL = 1  # committed after parallel infill (step 3)
PHASE_STEP = 2  # baselines: committed by an AR step or an MDM unmasking step
PHASE_NAMES = {PHASE_VERIFY: "verify", PHASE_INFILL: "infill", PHASE_STEP: "step"}

# ReFusion's stages: what a row's next forward is (docs/method.md §3.2). `DecodeResult.widths` names them.
STAGE_PLAN, STAGE_VERIFY, STAGE_DRAFT, STAGE_CHECK = 0, 1, 2, 3
STAGE_NAMES = ("plan", "verify", "draft", "check")


@dataclasses.dataclass
class Rollout:
  """Every token a decode committed, by answer position, the answer's end not applied: what an answer's exact
  probability is a sum over (a slot after the first EOS may have been committed before it, and the plans after it
  saw it; docs/method.md §6). All [B, G].

  Attributes:
    tokens: int32 committed ids, -1 where nothing was committed.
    iteration: int32 the iteration that committed each (`DecodeResult.commit_iteration`), -1 where none.
    phase: int32 `PHASE_*`.
    logprobs: float32 each token's log-probability under the distribution it was drawn from, NaN where none.
  """

  tokens: np.ndarray
  iteration: np.ndarray
  phase: np.ndarray
  logprobs: np.ndarray


@dataclasses.dataclass
class DecodeResult:
  """The output of a decode call over a batch of B prompts.

  Attributes:
    tokens: per row, the generated answer read back by true position, up to and
      including the first EOS (the whole generation when there is none).
    num_forwards: [B] model forwards each row took part in before it finished.
    steps: [B] decode iterations per row (ReFusion: plan steps; AR: tokens;
      MDM: unmasking steps).
    commit_iteration: [B, G] the iteration (0-based) that committed each
      answer position, -1 where nothing was committed.
    commit_phase: [B, G] how each position was committed (`PHASE_*`).
    seconds: wall-clock time of the call, compilation included when it happened.
    loop_calls: calls of the compiled loop the host made (`chunk_iterations`, refills).
    host_seconds: the host's work around those calls (refilling the queue, placing the loop's state, reading
      back), the calls themselves not included.
    widths: name -> {query width: count}. "forward" counts the batched loop
      forwards (prefills not included) by their query width (tokens per row);
      ReFusion adds one entry per stage (`STAGE_NAMES`) counting each row's
      forwards in that stage by the width they ran at.
    logprobs: [B, G] float32 each answer token's log-probability under the distribution it was drawn from
      (docs/sampling.md, "Log-probabilities"), NaN past each answer; None unless asked for (`logprobs=True`).
    rollout: every committed token, past the answers' ends too (`Rollout`); None unless asked for.
  """

  tokens: list[list[int]]
  num_forwards: np.ndarray
  steps: np.ndarray
  commit_iteration: np.ndarray
  commit_phase: np.ndarray
  seconds: float = 0.0
  loop_calls: int = 0
  host_seconds: float = 0.0
  widths: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)
  logprobs: np.ndarray | None = None
  rollout: Rollout | None = None

  @property
  def tpf(self) -> np.ndarray:
    """[B] answer tokens ÷ model forwards, per row."""
    lengths = np.array([len(t) for t in self.tokens], np.float64)
    return lengths / np.maximum(self.num_forwards, 1)

  @property
  def overall_tpf(self) -> float:
    """All rows' answer tokens ÷ all rows' forwards."""
    return float(sum(len(t) for t in self.tokens) / max(int(np.sum(self.num_forwards)), 1))

  @property
  def batched_forwards(self) -> int:
    """The forwards the decode ran as batches: the loop's ("forward" widths) and one prefill per prompt."""
    return sum(self.widths.get("forward", {}).values()) + len(self.tokens)

  def trace(self, row: int = 0) -> list[tuple[int, int, int, str]]:
    """(position, token, iteration, phase name) of every answer token of `row`."""
    return [
      (pos, tok, int(self.commit_iteration[row, pos]), PHASE_NAMES.get(int(self.commit_phase[row, pos]), "none"))
      for pos, tok in enumerate(self.tokens[row])
    ]
