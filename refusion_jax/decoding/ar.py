"""The autoregressive baseline: plain next-token decoding with the KV cache, on ReFusion's backbone.

One prompt prefill yields the first token, then one forward per further
token. Batched and jitted end to end as one `lax.while_loop`; the host side is
`refusion_jax.decoding.common.run_decoder`, whose `DecodeResult` records
`PHASE_STEP` for every token.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from refusion_jax.decoding.common import (
  DecodeOutputs,
  DecodeResult,
  check_temperature,
  counts_compilations,
  optional_eos_id,
  pick_tokens,
  prefill,
  run_decoder,
  step_outputs,
)
from refusion_jax.decoding.sharding import row_sharded_while_loop
from refusion_jax.model import cache as kv_cache
from refusion_jax.model.transformer import Transformer


@functools.partial(jax.jit, static_argnames=("graphdef", "gen_length", "sample"))
@counts_compilations
def ar_loop(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  prompt: jax.Array,
  lengths: jax.Array,
  key: jax.Array,
  temperature: jax.Array,
  eos_id: jax.Array,
  *,
  gen_length: int,
  sample: bool,
) -> DecodeOutputs:
  """Prefill + token-by-token decode.

  Args:
    prompt: [B, P] right-padded prompt ids; lengths: [B].

  Returns:
    `DecodeOutputs`: answer [B, G] (0 after a row stopped), commit_iteration
    [B, G] = the token's index, num_forwards = steps [B] = tokens decoded.
  """
  model = nnx.merge(graphdef, params)
  batch, width = prompt.shape
  chex.assert_shape(lengths, (batch,))
  logits, cache = prefill(model, prompt, lengths, width + gen_length)
  last_logits = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)
  first, _ = pick_tokens(last_logits, key, 0, temperature, sample)
  first = first[:, 0]

  out = jnp.zeros((batch, gen_length), jnp.int32).at[:, 0].set(first)
  done = first == eos_id
  forwards = jnp.ones((batch,), jnp.int32)

  def cond(carry):
    step, _, _, _, done = carry
    return (step < gen_length) & ~jnp.all(done)

  def body(carry):
    step, cache, out, forwards, done = carry
    fed = out[:, step - 1][:, None]
    positions = (lengths + step - 1)[:, None]
    mask = kv_cache.block_mask(cache, jnp.ones((batch, 1, 1), bool))
    logits, kv = model(fed, positions, mask, cache)
    cache = kv_cache.append(cache, kv, positions, ~done[:, None])
    token, _ = pick_tokens(logits, key, step, temperature, sample)
    token = token[:, 0]
    live = ~done
    out = out.at[:, step].set(jnp.where(live, token, out[:, step]))
    forwards = forwards + live
    done = done | (token == eos_id)
    return step + 1, cache, out, forwards, done

  _, _, out, forwards, _ = row_sharded_while_loop(cond, body, (jnp.int32(1), cache, out, forwards, done))
  return step_outputs(out, jnp.broadcast_to(jnp.arange(gen_length, dtype=jnp.int32), out.shape), forwards)


def ar_generate(
  model: Transformer,
  prompt_ids: Sequence[Sequence[int]],
  *,
  gen_length: int,
  temperature: float = 0.0,
  seed: int = 0,
  eos_id: int | None = None,
  pad_id: int | None = None,
  mesh: jax.sharding.Mesh | None = None,
) -> DecodeResult:
  """Batched autoregressive decoding with the KV cache.

  The prompt prefill is one forward and yields the first token; each further
  token costs one forward of the previous token. A row stops at its first EOS;
  the loop ends when every row has stopped or G tokens exist.

  Args:
    prompt_ids: B prompts of integer token ids (any lengths).
    gen_length: G, the most tokens to generate per row.
    temperature: 0 for greedy, else Gumbel-max sampling at that temperature.
    eos_id: stop token; defaults to the model config's, none if that is unset.
    pad_id: prompt padding id (never attended); defaults to the config's pad, else its EOS, else 0.
    mesh: decode on this mesh (`refusion_jax.make_mesh`); None: the default device.

  Returns:
    A `DecodeResult`: num_forwards = steps = answer tokens per row (prefill
    included), commit_iteration[b, t] = t.
  """
  temperature = check_temperature(temperature)
  eos = optional_eos_id(eos_id, model.config)
  loop = functools.partial(
    ar_loop,
    key=jax.random.key(seed),
    temperature=jnp.float32(temperature),
    eos_id=jnp.int32(eos),
    gen_length=gen_length,
    sample=temperature > 0,
  )
  return run_decoder(model, prompt_ids, loop, gen_length=gen_length, eos_id=eos, pad_id=pad_id, mesh=mesh)
