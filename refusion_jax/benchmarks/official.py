"""The official PyTorch ReFusion decoder (ML-GSAI/ReFusion `generate.py`) on our weights, to time it against ours.

The official code is imported from a checkout the caller names (never
vendored); torch and transformers are imported only here. Its `generate.py`
was written for transformers 4.5x and its own copy of the Qwen3 model
(`qwen3/modeling_qwen3_refusion.py`), which the installed transformers (5.x)
can no longer import. So the official `generate_refusion` runs *unchanged*
on transformers' own `Qwen3ForCausalLM` (the Qwen3 forward our HF parity
tests check against ours), loaded from our model saved by `save_hf`, with a
cache that adds what the function calls on its cache: the official
`DiffusionDynamicCache` methods and the 4.x cache API it relied on
(`crop(max_length)`, `cache[layer] -> (keys, values)`). The unused `pandas`
import of generate.py is stubbed. Greedy decoding then gives our tokens
(docs/method.md §4 lists where we differ on purpose).

It runs where ours does when torch can reach that device (a CUDA GPU), else
on the CPU, and in our model's activation dtype, so that a timing compares like
with like. In bfloat16 the two decoders' answers can part: see
docs/method.md §4.
"""

from __future__ import annotations

import collections
import importlib.machinery
import os
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from refusion_jax.checkpoints.hf import save_hf
from refusion_jax.decoding.result import PHASE_NONE, DecodeResult
from refusion_jax.model.transformer import Transformer


def _cache_class():
  """transformers' DynamicCache with the official DiffusionDynamicCache methods and the 4.x API it uses."""
  import torch
  from transformers.cache_utils import DynamicCache

  class OfficialCache(DynamicCache):
    def __getitem__(self, layer: int):
      return self.layers[layer].keys, self.layers[layer].values

    def crop(self, max_length: int) -> None:
      for layer in self.layers:
        layer.keys, layer.values = layer.keys[..., :max_length, :], layer.values[..., :max_length, :]

    def full_update(self, new_kv, cache_kwargs=None) -> None:
      for layer, (keys, values) in zip(self.layers, new_kv):
        layer.keys, layer.values = torch.cat([layer.keys, keys], dim=-2), torch.cat([layer.values, values], dim=-2)

    def batch_select_minibatch(self, count: int) -> None:
      for layer in self.layers:
        layer.keys, layer.values = layer.keys[:count], layer.values[:count]

  return OfficialCache


def load_generate(repo: str) -> tuple[Callable, type]:
  """The official `generate_refusion` of the checkout at `repo`, and the cache class it runs with."""
  if not os.path.isfile(os.path.join(repo, "generate.py")):
    raise FileNotFoundError(f"--official_repo {repo!r} has no generate.py; pass a checkout of ML-GSAI/ReFusion.")
  import transformers

  cache = _cache_class()
  package = types.ModuleType("qwen3")
  package.__path__ = []
  modeling = types.ModuleType("qwen3.modeling_qwen3_refusion")
  modeling.Qwen3ForCausalLM = transformers.Qwen3ForCausalLM
  cache_utils = types.ModuleType("qwen3.diffusion_cache_utils")
  cache_utils.DiffusionDynamicCache = cache
  stubs = {"qwen3": package, "qwen3.modeling_qwen3_refusion": modeling, "qwen3.diffusion_cache_utils": cache_utils}
  if "pandas" not in sys.modules:
    pandas = types.ModuleType("pandas")
    pandas.__spec__ = importlib.machinery.ModuleSpec("pandas", None)  # torch inspects the spec of loaded modules
    stubs["pandas"] = pandas
  saved = {name: sys.modules.get(name) for name in [*stubs, "generate"]}
  sys.modules.update(stubs)
  sys.path.insert(0, repo)
  try:
    official = __import__("generate")
  finally:
    sys.path.remove(repo)
    # The function keeps what it imported; the stubs leave sys.modules (the pandas stub stays: torch looks at it).
    for name, module in saved.items():
      if name == "pandas":
        continue
      if module is None:
        sys.modules.pop(name, None)
      else:
        sys.modules[name] = module
  return official.generate_refusion, cache


def torch_device(model: Transformer) -> str:
  """The torch device of the accelerator holding `model`'s weights: "cuda" for a GPU torch can use, else "cpu".

  torch reaches a TPU only through torch_xla, which this comparison does not
  use, so ours on a TPU is compared with the official code on the host CPU.
  On a GPU both share its memory, of which jax takes 75% when it starts: for a
  model that does not fit in the rest, set XLA_PYTHON_CLIENT_PREALLOCATE=false.
  """
  import torch

  platform = next(iter(jax.tree.leaves(nnx.state(model))[0].devices())).platform
  return "cuda" if platform == "gpu" and torch.cuda.is_available() else "cpu"


class OfficialDecoder:
  """The official decoder on `model`'s weights, batch 1, prompt by prompt, on `torch_device(model)`.

  The torch model holds the weights and computes in `model.config.dtype`
  (save_hf writes them in `param_dtype`; a bfloat16 model with float32
  parameters is rounded on loading, as ours rounds them in each matmul).
  torch runs on `threads` intra-op threads: on a small shared CPU its default
  (one spinning thread per core) ran the official decode 15-40x slower under
  load than one thread did, so one thread is its best case there.
  """

  def __init__(self, model: Transformer, repo: str, threads: int = 1):
    import torch
    import transformers

    torch.set_num_threads(threads)
    self._torch = torch
    self._forwards: collections.Counter[int] = collections.Counter()  # query tokens per forward -> forwards
    self._generate, self._cache = load_generate(repo)
    self.dtype = getattr(torch, model.config.dtype)
    with tempfile.TemporaryDirectory() as path:
      save_hf(model, path)
      loaded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
    self.model = loaded.to(torch_device(model)).eval()
    self.device = self.model.device

  def __call__(self, input_ids, position_ids, past_key_values=None, use_cache=True):
    """The model call `generate_refusion` makes; a fresh official cache on the prompt's first forward."""
    if past_key_values is None:
      past_key_values = self._cache(config=self.model.config)
    self._forwards[int(input_ids.shape[-1])] += 1
    return self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=past_key_values, use_cache=True)

  def decode(
    self,
    prompts: Sequence[Sequence[int]],
    *,
    gen_length: int,
    slot_size: int,
    serial_blocks: int,
    slot_threshold: float,
    token_threshold: float,
    mask_id: int,
    eos_id: int,
  ) -> DecodeResult:
    """Greedy answers (up to and including the first EOS) of the official decoder, one prompt at a time.

    Returns:
      A `DecodeResult` with the tokens, the forwards per prompt (the prompt's
      forward included; an infill forward over several slot copies is one) and
      widths["forward"]: forwards by query tokens per row; no trace.
    """
    tokenizer = types.SimpleNamespace(eos_token_id=eos_id)
    answers, forwards, widths = [], [], collections.Counter()
    start = time.perf_counter()
    for prompt in prompts:
      self._forwards.clear()
      x, _ = self._generate(
        self,
        tokenizer,
        self._torch.tensor([list(prompt)], device=self.device),
        gen_length=gen_length,
        temperature=0.0,
        mask_id=mask_id,
        slot_size=slot_size,
        serial_num_blocks=serial_blocks,
        slot_threshold=slot_threshold,
        token_threshold=token_threshold,
      )
      answer = x[0, len(prompt) :].tolist()
      answers.append(answer[: answer.index(eos_id) + 1] if eos_id in answer else answer)
      forwards.append(sum(self._forwards.values()))
      widths.update(self._forwards)
    none = np.full((len(prompts), gen_length), PHASE_NONE, np.int32)
    return DecodeResult(
      tokens=answers,
      num_forwards=np.array(forwards),
      steps=np.zeros(len(prompts), np.int32),
      commit_iteration=none,
      commit_phase=none,
      seconds=time.perf_counter() - start,
      widths={"forward": dict(widths)},
    )
