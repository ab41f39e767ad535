"""Decoding on a mesh of 8 fake CPU devices gives the single-device tokens and forward counts (docs/method.md §5).

`refusion_jax.decoding.mesh`: rows split over the batch-parallel axes, parameters and cache by logical axes.
"""

import textwrap

import numpy as np
from helpers.fake_devices import run_json

# Runs in a subprocess: the device count must be set before JAX initialises.
_SHARDED_VS_SINGLE = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    import refusion_jax as rj
    from refusion_jax.decoding.loop import compile_count
    from refusion_jax.decoding.prompts import prefill
    from refusion_jax.decoding.mesh import place_params
    from refusion_jax.model.config import tiny
    from refusion_jax.model.transformer import init_model
    from refusion_jax.parallel.activations import sharded_activations

    seed = int(sys.argv[1])
    config = tiny(vocab_size=260, mask_token_id=259, pad_token_id=256, eos_token_id=258)
    model = init_model(config, seed=seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 256, rng.integers(2, 12)).tolist() for _ in range(5)]  # 5 rows: padded on every mesh
    refusion = rj.ReFusion(gen_length=16, slot_size=4, serial_blocks=2, slot_threshold=0.5, token_threshold=0.3)
    decoders = dict(
      refusion=lambda mesh: rj.decode(model, prompts, refusion, mesh=mesh),
      # One row asked for (padded to the mesh), the loop's state in and out of the mesh every 3 iterations.
      refusion_chunked=lambda mesh: rj.decode(model, prompts, refusion, mesh=mesh, rows=1, chunk_iterations=3),
      ar=lambda mesh: rj.decode(model, prompts, rj.AR(gen_length=8), mesh=mesh),
      mdm=lambda mesh: rj.decode(model, prompts, rj.MDM(gen_length=8, block_length=4, steps=4), mesh=mesh),
    )

    def summary(result):
      return dict(tokens=result.tokens, forwards=result.num_forwards.tolist(), steps=result.steps.tolist(),
                  iteration=result.commit_iteration.tolist(), phase=result.commit_phase.tolist())

    # ReFusion on every mesh; the baselines (same front end, same helpers) on the mixed one.
    runs = {"{}": {name: summary(fn(None)) for name, fn in decoders.items()}}
    compiles = {}
    for shape, names in (({"data": 8}, ["refusion"]), ({"fsdp": 4, "tensor": 2}, ["refusion"]),
                         ({"data": 2, "fsdp": 2, "tensor": 2}, list(decoders))):
      mesh = rj.make_mesh(shape)
      runs[json.dumps(shape)] = {}
      for name in names:
        before = compile_count()
        runs[json.dumps(shape)][name] = summary(decoders[name](mesh))
        compiles[name] = compile_count() - before  # the last mesh's count

    # Where the parameters and the prefilled cache live on fsdp=4 x tensor=2.
    mesh = rj.make_mesh({"fsdp": 4, "tensor": 2})
    graphdef, params = nnx.split(model)
    params = place_params(params, mesh)
    q_proj = params["layers"][0]["self_attn"]["q_proj"].get_value()
    tokens = jnp.asarray(rng.integers(0, 256, (8, 16)), jnp.int32)
    prefilled = lambda p, t, l: prefill(nnx.merge(graphdef, p), t, l, 32)[1]
    cache = jax.jit(sharded_activations(prefilled, mesh))(params, tokens, jnp.full((8,), 16, jnp.int32))
    print(json.dumps(dict(
      devices=len(jax.devices()), runs=runs, compiles=compiles,
      q_proj=[list(q_proj.shape), list(q_proj.addressable_shards[0].data.shape)],
      cache_k=[list(cache.k.shape), list(cache.k.addressable_shards[0].data.shape)],
      cache_valid=[list(cache.valid.shape), list(cache.valid.addressable_shards[0].data.shape)])))
""")


def test_sharded_decoding_matches_single_device():
  seed = int(np.random.default_rng().integers(1 << 16))
  report = run_json(_SHARDED_VS_SINGLE, str(seed))
  assert report["devices"] == 8
  single = report["runs"].pop("{}")
  for mesh, results in report["runs"].items():
    for name, result in results.items():
      assert result == single[name], (seed, mesh, name)
  assert single["refusion_chunked"] == single["refusion"]
  # One compile per program on a mesh too, however many loop calls (chunks of 3 iterations) a run takes.
  assert report["compiles"] == dict(refusion=1, refusion_chunked=1, ar=1, mdm=1)
  # embed over fsdp (4 ways), heads over tensor (2 ways); cache rows over fsdp, KV heads over tensor.
  (embed, heads, head_dim), shard = report["q_proj"]
  assert shard == [embed // 4, heads // 2, head_dim]
  (layers, batch, capacity, kv_heads, head_dim), shard = report["cache_k"]
  assert shard == [layers, batch // 4, capacity, kv_heads // 2, head_dim]
  (batch, capacity), shard = report["cache_valid"]
  assert shard == [batch // 4, capacity]


# Runs in a subprocess (8 fake devices): requests with their own temperatures and seeds, sharing an engine's rows
# split over the data axis, get the tokens they get alone on one device.
_PER_REQUEST_SAMPLING = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    jax.config.update("jax_platforms", "cpu")
    import numpy as np
    import refusion_jax as rj
    from refusion_jax.decoding.engine import Engine, decode
    from refusion_jax.model.config import tiny
    from refusion_jax.model.transformer import init_model

    seed = int(sys.argv[1])
    model = init_model(tiny(vocab_size=260, mask_token_id=259, pad_token_id=256, eos_token_id=258), seed=seed)
    rng = np.random.default_rng(seed)
    method = rj.ReFusion(gen_length=16, slot_size=4, slot_threshold=0.5, token_threshold=0.3)
    requests = [(rng.integers(0, 256, rng.integers(2, 12)).tolist(), float(t), int(rng.integers(1 << 20)))
                for t in (0.0, 0.7, 1.3, 0.0, 0.9)]
    engine = Engine(model, method, rows=4, prompt_width=16, mesh=rj.make_mesh({"data": 4, "fsdp": 2}), sampling=True)
    numbers = [engine.submit(p, temperature=t, seed=s) for p, t, s in requests]
    while not engine.idle:
      engine.advance(3)
    sharded = engine.pop(numbers).tokens
    alone = [decode(model, [p], rj.ReFusion(**{**method.__dict__, "temperature": t}), seed=s).tokens[0]
             for p, t, s in requests]
    print(json.dumps(dict(sharded=sharded, alone=alone)))
""")


def test_requests_with_their_own_sampling_on_a_mesh_match_one_device():
  seed = int(np.random.default_rng().integers(1 << 16))
  out = run_json(_PER_REQUEST_SAMPLING, str(seed))
  assert out["sharded"] == out["alone"], f"seed {seed}"
