"""The ahead-of-time report of a GRPO step (`python -m refusion_jax.aot --programs grpo`, docs/rl.md §9): its
rollout, reference log-probabilities and update compiled from a config's shapes, built by the trainer's own
functions, with the memory and FLOPs of `training/aot_report.py`'s rows.

It lives with the trainer rather than beside the supervised step's report because it builds the trainer's
programs: the training package stays below `rl`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import jax
import ml_collections
from flax import nnx

from refusion_jax.decoding.engine import engine_decoder
from refusion_jax.decoding.mesh import padded_rows
from refusion_jax.model.transformer import inference_config, inference_view
from refusion_jax.parallel import compiled, sharding
from refusion_jax.rl import trainer
from refusion_jax.training.aot_report import (
  abstract_run,
  loop_report,
  mesh_text,
  quantized_text,
  step_report,
  train_advice,
)
from refusion_jax.training.run_config import objective_config_from


def grpo_reports(
  config: ml_collections.ConfigDict, devices: Sequence[jax.Device], chip: compiled.Chip | None
) -> Iterator[compiled.Report]:
  """A GRPO step's compiled programs (`config.grpo`, docs/rl.md §5), built by the trainer's own functions
  (`refusion_jax.rl.trainer`) on the config's mesh, one at a time, yielding each report as it is done:

  1. the rollout: the jitted decode loop of `rollout_method` (speculative ReFusion, or AR) at the trainer's
     rows (`rollout_rows`: batch_size x num_generations unless `grpo.rollout_rows`) and prompt bucket, on the
     inference view of the train state's parameters (LoRA adapters and an integer base included);
  2. with beta > 0, the reference log-probabilities (`UpdatePrograms.logprobs`, a LoRA model's with adapters off:
     the same program on the same parameters);
  3. the update (`UpdatePrograms.update`): the replay, GRPO's loss, its gradient (the adapters only under LoRA)
     and `num_iterations` optimizer updates, at batch_size x num_generations rows.
  """
  steps = trainer.GRPOSteps(config)
  rows, accum = steps.rows(config), config.grad_accum_steps
  run = abstract_run(config, devices, rows, max(config.num_train_steps, 1) * steps.updates_per_step)
  model_config, rules, mesh, lora_config = run.model_config, run.rules, run.mesh, run.lora_config
  placement, graphdef = run.placement, run.graphdef
  # The trainer takes the special ids from the tokenizer; placeholders here (they do not change the programs).
  options = dataclasses.replace(
    trainer.rollout_options(config, mesh),
    mask_id=model_config.mask_token_id,
    eos_id=model_config.eos_token_id,
    pad_id=model_config.pad_token_id,
  )
  method, prompt_width = steps.method, steps.prompt_width
  adapters = f", LoRA r={lora_config.rank}" if lora_config.enabled else ""
  described = f"{adapters}{quantized_text(model_config)}, mesh {mesh_text(mesh)}"

  # 1. The rollout: what `Engine(nnx.merge(graphdef, state.params), method, options, ...)` compiles.
  view_graphdef, view_params = nnx.split(
    nnx.eval_shape(lambda p: inference_view(nnx.merge(graphdef, p)), placement.abstract_state.params)
  )
  view_config = inference_config(model_config)
  k = trainer.rollout_rows(config, steps)
  decoder = engine_decoder(view_config, method, dataclasses.replace(options, rows=k), rules)
  loop_rows = padded_rows(k, mesh, rules)
  name = (
    f"GRPO rollout ({method.name}{', speculative' if method.name == 'refusion' else ''}, T={method.temperature}, "
    f"logprobs, prefill + 1 loop iteration), {loop_rows} rows x (prompt {prompt_width} + {method.gen_length}), "
    f"{view_config.param_dtype} weights{described}"
  )
  yield loop_report(name, decoder, view_graphdef, view_params, view_config, loop_rows, prompt_width, mesh, rules, chip)

  # 2. and 3. The reference log-probabilities and the update, at every answer of a step.
  objective = objective_config_from(config, model_config)
  programs = trainer.update_programs(
    steps, config, graphdef, placement, run.tx, run.schedule, objective.loss_chunk, options
  )
  batch = {
    key: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding.batch_sharding(mesh, len(s.shape), rules))
    for key, s in trainer.rollout_batch_shapes(rows, steps.max_prompt_length, method.gen_length).items()
  }
  shape = f"{rows} rows x (prompt {steps.max_prompt_length} + {method.gen_length})"
  if steps.grpo.beta:
    name = f"GRPO reference log-probs ({'adapters off' if lora_config.enabled else 'the start'}), {shape}{described}"
    yield step_report(name, programs.logprobs, (placement.abstract_state.params, batch), run, chip)
  name = (
    f"GRPO update ({steps.grpo.num_iterations} x replay + loss + gradient + optimizer), {shape}, grad_accum {accum}, "
    f"remat {model_config.remat}{', layers scanned' if model_config.scan_layers else ''}{described}"
  )
  loops = accum * steps.grpo.num_iterations
  report = step_report(name, programs.update, (placement.abstract_state, batch), run, chip, loop_count=loops)
  report.advice = train_advice(report, config, model_config, sharding.batch_parallel_ways(mesh, rules))
  yield report
