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
from refusion_jax.model import lora
from refusion_jax.model.transformer import inference_config, inference_view
from refusion_jax.parallel import compiled, sharding
from refusion_jax.parallel.activations import normalize_rules
from refusion_jax.rl import trainer
from refusion_jax.training.aot_report import (
  loop_report,
  mesh_devices,
  mesh_text,
  model_config_of,
  quantized_text,
  train_advice,
)
from refusion_jax.training.run_config import check_quantize, lora_config_from, objective_config_from
from refusion_jax.training.state import init_state_fn, make_optimizer, make_placement


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
  model_config = model_config_of(config)
  rules = normalize_rules(config.sharding_rules)
  mesh = sharding.make_mesh(dict(config.mesh), mesh_devices(dict(config.mesh), devices))
  rows, accum = steps.rows(config), config.grad_accum_steps
  sharding.check_batch_split(rows, accum, mesh, rules, processes=1)
  tx, schedule = make_optimizer(config.optimizer, total_steps=max(config.num_train_steps, 1) * steps.updates_per_step)
  lora_config = lora_config_from(config)
  check_quantize(config)
  placement = make_placement(init_state_fn(model_config, tx, config.seed, lora_config), mesh, rules)
  graphdef, _ = lora.abstract_lora_model(model_config, lora_config)
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
  programs = trainer.update_programs(steps, config, graphdef, placement, tx, schedule, objective.loss_chunk, options)
  batch = {
    key: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding.batch_sharding(mesh, len(s.shape), rules))
    for key, s in trainer.rollout_batch_shapes(rows, steps.max_prompt_length, method.gen_length).items()
  }
  shape = f"{rows} rows x (prompt {steps.max_prompt_length} + {method.gen_length})"
  devices_used = list(mesh.devices.flat)
  if steps.grpo.beta:
    args = (placement.abstract_state.params, batch)
    traced = programs.logprobs.trace(*args)
    name = f"GRPO reference log-probs ({'adapters off' if lora_config.enabled else 'the start'}), {shape}{described}"
    report = compiled.compile_report(name, traced.lower, args, devices_used, chip)
    report.traced_flops = compiled.matmul_flops(traced.jaxpr) / mesh.devices.size
    yield report
  args = (placement.abstract_state, batch)
  traced = programs.update.trace(*args)
  name = (
    f"GRPO update ({steps.grpo.num_iterations} x replay + loss + gradient + optimizer), {shape}, grad_accum {accum}, "
    f"remat {model_config.remat}{', layers scanned' if model_config.scan_layers else ''}{described}"
  )
  loops = accum * steps.grpo.num_iterations
  report = compiled.compile_report(name, traced.lower, args, devices_used, chip, loop_count=loops)
  report.traced_flops = compiled.matmul_flops(traced.jaxpr) / mesh.devices.size
  if model_config.scan_layers:  # XLA's cost analysis counts the scan's one layer once: no FLOPs rather than wrong ones
    report.flops = report.bytes_accessed = None
  report.advice = train_advice(report, config, model_config, sharding.batch_parallel_ways(mesh, rules))
  yield report
