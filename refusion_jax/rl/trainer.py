"""GRPO's training step inside the training loop: roll out, score, update (docs/rl.md §5).

    python -m refusion_jax.train --config configs/grpo_demo.py --workdir /tmp/grpo_demo

A config with a `grpo` section trains by GRPO (`train_grpo`): the loop of `refusion_jax.training.loop` runs it
with every guarantee of supervised training (the run lock, orbax checkpoints with exact resume, SIGTERM, pod
faults, the progress bar, TensorBoard, LoRA / QLoRA, the mesh, the periodic validation), and `GRPOSteps` says
what a step is:

1. **Rollout.** The step's `config.batch_size` prompts, each `num_generations` times, are decoded by the jitted
   engine with the current weights, on the run's mesh (the parameters are the train state's arrays: nothing is
   copied), with log-probabilities: ReFusion with speculative acceptance (the policy whose probabilities are
   exact, docs/rl.md §1) or AR, at `config.grpo.temperature`. One compiled decode program serves every step.
   Every process of a multi-process run reads and decodes the whole global batch, in the one-process order, and
   scores it the same way; the update gets it as global arrays (docs/rl.md §5, "Several processes").
2. **Rewards.** The reward functions `config.grpo.rewards` names score the decoded answers; their sum's
   group-relative advantages (`objective.group_advantages`) weigh each answer.
3. **Reference.** With `beta` > 0, each recorded token's log-probability under the reference policy: the
   starting checkpoint, frozen (a LoRA run: its base with the adapters off, no second copy of the weights).
4. **Update.** `num_iterations` optimizer updates on GRPO's loss (`objective.grpo_loss`), the old policy's
   log-probabilities being the rollout's own (tunix's `use_rollout_logps`; or, for AR with it off, recomputed
   before the first update).

Logged per step besides the loss: reward_mean, reward_std, accuracy (exact match of the answers), kl,
clip_fraction, rollout_tpf (answer tokens per forward), rollout_forwards (per answer), rollout_seconds,
update_seconds.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from refusion_jax.data.tokenizer import Tokenizer, format_prompt
from refusion_jax.decoding.contract import Method
from refusion_jax.decoding.engine import Engine
from refusion_jax.decoding.methods import config_method
from refusion_jax.decoding.options import DecodeOptions
from refusion_jax.decoding.prompts import bucket_length
from refusion_jax.model import lora
from refusion_jax.model.adapter import is_adapter
from refusion_jax.parallel import hosts, sharding
from refusion_jax.rl import prompts, rewards
from refusion_jax.rl.logprobs import RolloutBatch, policy_logprobs
from refusion_jax.rl.objective import GRPOConfig, group_advantages, grpo_loss
from refusion_jax.training import run_config, start
from refusion_jax.training.loop import StepParts, Steps, TrainResult, train_and_evaluate
from refusion_jax.training.state import Placement, TrainState, make_update_step

# The GRPOConfig fields a config's `grpo` section sets (the rest of the section configures the trainer).
_GRPO_FIELDS = tuple(f.name for f in dataclasses.fields(GRPOConfig))
# The trainer's own fields of the `grpo` section.
_TRAINER_FIELDS = ("temperature", "rewards", "max_prompt_length", "rollout_rows", "use_rollout_logps")
# The methods whose answers have a probability GRPO can differentiate.
_POLICY_KINDS = ("refusion", "ar")
# The update's batch (`RolloutBatch`'s fields): each one's width after the row axis ("prompt": the prompt bucket,
# "answer": gen_length, None: one value per row) and dtype. The row axis is split over the batch-parallel devices.
_BATCH_FIELDS = dict(
  prompt=("prompt", np.int32),
  prompt_len=(None, np.int32),
  tokens=("answer", np.int32),
  iteration=("answer", np.int32),
  old_logprobs=("answer", np.float32),
  mask=("answer", np.float32),
  advantages=(None, np.float32),
  ref_logprobs=("answer", np.float32),
)


def grpo_config_from(config: ml_collections.ConfigDict) -> GRPOConfig:
  """The `GRPOConfig` of `config.grpo` (unknown fields refused by name)."""
  section = dict(config.grpo)
  unknown = sorted(set(section) - set(_GRPO_FIELDS) - set(_TRAINER_FIELDS))
  if unknown:
    raise ValueError(f"config.grpo has unknown fields {unknown}; it takes {sorted(_GRPO_FIELDS + _TRAINER_FIELDS)}.")
  fields = {name: section[name] for name in _GRPO_FIELDS if name in section}
  if not fields.get("max_response_length"):
    fields["max_response_length"] = config.eval.gen_length
  return GRPOConfig(**fields)


def rollout_method(config: ml_collections.ConfigDict) -> Method:
  """The policy the rollouts sample: `config.eval`'s method of the objective's kind at `config.grpo.temperature`,
  ReFusion with speculative acceptance (the mode whose answers have exact probabilities, docs/rl.md §1)."""
  kind = config.objective.kind
  method = dataclasses.replace(config_method(kind, config.eval), temperature=float(config.grpo.temperature))
  return dataclasses.replace(method, acceptance="speculative") if kind == "refusion" else method


class GRPOSteps(Steps):
  """GRPO's step for `train_and_evaluate`: rollout, rewards, reference, `num_iterations` updates (module docstring).

  Its batches are lists of `config.batch_size` prompt records, the global batch in every process of a multi-process
  run; the update's rows are their batch_size x num_generations answers.
  """

  def __init__(self, config: ml_collections.ConfigDict):
    if config.objective.kind not in _POLICY_KINDS:
      raise ValueError(
        f"config.objective.kind={config.objective.kind!r}: GRPO trains the policy of {_POLICY_KINDS} (an MDM "
        "answer has no tractable probability)."
      )
    self.grpo = grpo_config_from(config)
    self.updates_per_step = self.grpo.num_iterations
    if not config.grpo.rewards:
      raise ValueError("config.grpo.rewards names no reward function; e.g. ('refusion_jax.rl.rewards.exact_match',).")
    self.rewards = [rewards.load_reward(path) for path in config.grpo.rewards]
    self.temperature = float(config.grpo.temperature)
    if self.temperature <= 0:
      raise ValueError(
        f"config.grpo.temperature={self.temperature}: GRPO learns from sampled answers, give a temperature > 0."
      )
    # Old-policy log-probabilities: the rollout's own (tunix's default), or recomputed by the replay before the
    # first update.
    self.use_rollout_logps = bool(config.grpo.get("use_rollout_logps", True))
    self.method = rollout_method(config)
    self.max_prompt_length = int(config.grpo.max_prompt_length)
    # The rollout's prompt bucket: every prompt of a step, left-padded to it.
    self.prompt_width = bucket_length(self.max_prompt_length)

  def open_splits(self, config: ml_collections.ConfigDict, workdir: str) -> dict[str, Sequence[Any]]:
    return prompts.open_prompt_splits(config, workdir)

  def rows(self, config: ml_collections.ConfigDict) -> int:
    return config.batch_size * self.grpo.num_generations

  def batches(
    self, source: Sequence[Any], tokenizer: Tokenizer, config: ml_collections.ConfigDict
  ) -> grain.IterDataset:
    prompts.check_prompt_lengths(
      source, tokenizer, self.max_prompt_length, config.data.chat_template, "the training prompts"
    )
    # The global batch in every process (`prompts.prompt_batches` says why).
    return prompts.prompt_batches(source, config.batch_size, config.seed)

  def build(self, parts: StepParts) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
    return _GRPOStep(self, parts)


def rollout_options(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> DecodeOptions:
  """The rollouts' decode options on the run's `mesh`, with log-probabilities (the replay reads the recorded
  trajectories); the step sets the rows and its seed, the trainer the tokenizer's special ids."""
  return DecodeOptions(seed=config.seed, mesh=mesh, logprobs=True)


def rollout_rows(config: ml_collections.ConfigDict, steps: GRPOSteps) -> int:
  """K, the rows the rollout's decode loop keeps busy: `config.grpo.rollout_rows`, else every answer of a step at
  once (the global batch, which every process decodes)."""
  return int(config.grpo.get("rollout_rows") or steps.rows(config))


def rollout_engine(model: nnx.Module, steps: GRPOSteps, options: DecodeOptions, rules: Any) -> Engine:
  """The engine a step's rollout decodes with: `steps.method` on `model` (the train state's arrays, nothing
  copied), at `options`' rows and seed on its mesh, prompts in the bucket `steps.prompt_width`."""
  return Engine(model, steps.method, options, prompt_width=steps.prompt_width, rules=rules)


def rollout_batch_shapes(rows: int, prompt_length: int, gen_length: int) -> dict[str, jax.ShapeDtypeStruct]:
  """The update's inputs (`RolloutBatch`'s fields, as the step builds them) for `rows` answers of `gen_length`
  tokens to prompts left-padded to `prompt_length`: {name: [rows, ...] shape and dtype}."""
  widths = {"prompt": (prompt_length,), "answer": (gen_length,), None: ()}
  return {key: jax.ShapeDtypeStruct((rows, *widths[width]), dtype) for key, (width, dtype) in _BATCH_FIELDS.items()}


@dataclasses.dataclass(frozen=True)
class UpdatePrograms:
  """The jitted programs of GRPO's update, on the run's placement (what `python -m refusion_jax.aot` compiles too).

  update:   (state, batch) -> (state, metrics): `num_iterations` optimizer updates on GRPO's loss (the trainable
            part only: the LoRA adapters when the model has them), the state donated. batch: `rollout_batch_shapes`.
  logprobs: (params, batch) -> [rows, G] float32 each recorded token's log-probability (the reference policy's
            when given its parameters, e.g. a LoRA model's with the adapters off; the old policy's for AR
            without `use_rollout_logps`).
  """

  update: Callable
  logprobs: Callable


def update_programs(
  steps: GRPOSteps,
  config: ml_collections.ConfigDict,
  graphdef: nnx.GraphDef,
  placement: Placement,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  loss_chunk: int,
  options: DecodeOptions,
) -> UpdatePrograms:
  """The update's jitted programs (`UpdatePrograms`), replaying answers decoded with `options`' mask and EOS ids."""
  method, temperature, grpo = steps.method, steps.temperature, steps.grpo
  special = dict(mask_id=options.mask_id, eos_id=options.eos_id)

  def logprobs_of_model(model: nnx.Module, rollout: RolloutBatch, dropout_key: jax.Array | None) -> jax.Array:
    return policy_logprobs(
      model, rollout, method, temperature=temperature, chunk=loss_chunk, dropout_key=dropout_key, **special
    )

  def loss_of_model(model: nnx.Module, batch: dict, key: jax.Array) -> tuple[jax.Array, dict]:
    rollout = RolloutBatch(**batch)
    logps = logprobs_of_model(model, rollout, lora.dropout_key(model, key))
    reference = rollout.ref_logprobs if grpo.beta else None
    return grpo_loss(logps, rollout.old_logprobs, rollout.advantages, rollout.mask, grpo, reference)

  example = {key: np.zeros(shape.shape, shape.dtype) for key, shape in rollout_batch_shapes(1, 1, 1).items()}
  update = make_update_step(graphdef, tx, schedule, loss_of_model, config.grad_accum_steps, grpo.num_iterations)

  def logprobs_of(params: nnx.State, batch: dict) -> jax.Array:
    return logprobs_of_model(nnx.merge(graphdef, params), RolloutBatch(**batch), None)

  shardings = sharding.batch_shardings(example, placement.mesh, placement.rules)
  return UpdatePrograms(
    update=placement.jit_step(update, batch_example=example),
    logprobs=jax.jit(
      logprobs_of, in_shardings=(placement.state_shardings.params, shardings), out_shardings=shardings["tokens"]
    ),
  )


class _GRPOStep:
  """One GRPO step, (state, prompt records) -> (state, metrics), its compiled parts built once."""

  def __init__(self, steps: GRPOSteps, parts: StepParts):
    config, run, graphdef = parts.config, parts.run, parts.graphdef
    self.steps, self.config, self.grpo = steps, config, steps.grpo
    self.graphdef, self.placement, self.tokenizer = graphdef, run.placement, run.tokenizer
    grpo = steps.grpo
    # The rollouts record their trajectories (`logprobs`); the replay lays them out with the decode's mask and EOS
    # ids (the tokenizer's, else the model config's).
    self._options = rollout_options(config, run.placement.mesh).with_tokenizer_ids(
      run.tokenizer, run.origin.model_config
    )
    programs = update_programs(
      steps, config, graphdef, run.placement, parts.tx, parts.schedule, parts.objective.loss_chunk, self._options
    )
    self._update, self._logprobs = programs.update, programs.logprobs
    # The reference policy, frozen at the start: a LoRA run's base with its adapters off (`_reference_params`: the
    # state's own base arrays); a full run's starting parameters, kept (reloaded when the run resumes).
    self._lora = run_config.lora_config_from(config).enabled
    self._reference = None
    if grpo.beta and not self._lora:
      if run.origin.resume_step is None:
        self._reference = jax.tree.map(jnp.copy, run.state.params)  # the state's own are donated to the update
      else:
        self._reference = start.starting_params(config, run.checkpoint_dir, run.origin.model_config, run.placement)
    self._rows = rollout_rows(config, steps)
    self._pad_id = run.tokenizer.pad_id

  def __call__(self, state: TrainState, batch: prompts.PromptBatch) -> tuple[TrainState, dict]:
    step = int(state.step)  # waits for the last update: the rollout decodes with its weights
    started = time.perf_counter()
    queries, columns = prompts.columns_of(batch, self.grpo.num_generations)
    prompt_ids = [
      self.tokenizer.encode(format_prompt(self.tokenizer, q, self.config.data.chat_template)) for q in queries
    ]
    result = self._rollout(state.params, prompt_ids, step)
    rolled_out = time.perf_counter()
    completions = [self.tokenizer.decode(tokens) for tokens in result.tokens]
    total, _ = rewards.score(self.steps.rewards, queries, completions, columns)
    advantages = group_advantages(total, self.grpo.num_generations, self.grpo.advantage_estimator)
    rollout = self._placed(self._rollout_batch(prompt_ids, result, advantages))
    if not self.steps.use_rollout_logps:
      rollout["old_logprobs"] = self._logprobs(state.params, rollout)
    if self.grpo.beta:
      rollout["ref_logprobs"] = self._logprobs(self._reference_params(state.params), rollout)
    updating = time.perf_counter()
    state, metrics = self._update(state, rollout)
    jax.block_until_ready(metrics)
    done = time.perf_counter()
    forwards = np.asarray(result.num_forwards, np.float64)
    metrics = dict(
      metrics,
      reward_mean=np.float32(total.mean()),
      reward_std=np.float32(total.std()),
      rollout_tpf=np.float32(result.overall_tpf),
      rollout_forwards=np.float32(forwards.mean()),
      rollout_seconds=np.float32(rolled_out - started),
      update_seconds=np.float32(done - updating),
    )
    if "response" in columns or "task" in columns:
      metrics["accuracy"] = np.float32(np.mean(rewards.exact_match(queries, completions, **columns)))
    return state, metrics

  def _rollout(self, params: nnx.State, prompt_ids: list[list[int]], step: int) -> Any:
    """The answers to `prompt_ids` sampled with `params`: one engine on the train state's arrays, decoding with
    the step's seed (a resumed run draws what an uninterrupted one did)."""
    options = dataclasses.replace(self._options, rows=self._rows, seed=_step_seed(self.config.seed, step))
    return rollout_engine(nnx.merge(self.graphdef, params), self.steps, options, self.placement.rules).run(prompt_ids)

  def _rollout_batch(self, prompt_ids: list[list[int]], result: Any, advantages: np.ndarray) -> dict[str, np.ndarray]:
    """The update's inputs (`RolloutBatch`'s fields) as host arrays."""
    rows, width = len(prompt_ids), self.steps.max_prompt_length
    prompt = np.full((rows, width), self._pad_id, np.int32)
    for row, ids in enumerate(prompt_ids):
      prompt[row, width - len(ids) :] = ids
    trajectory = result.rollout
    tokens, iteration = np.asarray(trajectory.tokens, np.int32), np.asarray(trajectory.iteration, np.int32)
    mask = tokens >= 0
    batch = dict(
      prompt=prompt,
      prompt_len=np.array([len(ids) for ids in prompt_ids]),
      tokens=tokens,
      iteration=iteration,
      old_logprobs=np.where(mask, np.asarray(trajectory.logprobs), 0.0),
      mask=mask,
      advantages=advantages,
      ref_logprobs=np.zeros(tokens.shape),
    )
    return {key: np.asarray(batch[key], dtype) for key, (_, dtype) in _BATCH_FIELDS.items()}

  def _placed(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """The update's batch, whole in every process, as global arrays split by rows over the run's mesh: the
    one-process run's arrays (in a multi-process run each process contributes the rows of its own devices)."""
    return hosts.place(batch, sharding.batch_shardings(batch, self.placement.mesh, self.placement.rules))

  def _reference_params(self, params: nnx.State) -> nnx.State:
    """The reference policy's parameters: the kept start, or (LoRA) `params` with every adapter's B zero."""
    if self._reference is not None:
      return self._reference
    return jax.tree_util.tree_map_with_path(lambda path, x: jnp.zeros_like(x) if _adapter_b(path) else x, params)


def _adapter_b(path: tuple) -> bool:
  """Whether a state entry is a LoRA adapter's B factor (zero: the adapter adds nothing)."""
  return is_adapter(path) and "lora_b" in [str(getattr(k, "key", k)) for k in path]


def _step_seed(seed: int, step: int) -> int:
  """The rollout seed of `step` (answers of a step draw fold_in(key(it), row), docs/sampling.md)."""
  return (seed * 1_000_003 + step) % (2**31 - 1)


def train_grpo(config: ml_collections.ConfigDict, workdir: str) -> TrainResult:
  """Train by GRPO as `config.grpo` says, in the training loop (`train_and_evaluate` with `GRPOSteps`)."""
  return train_and_evaluate(config, workdir, GRPOSteps(config))
