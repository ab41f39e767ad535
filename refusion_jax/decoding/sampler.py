"""Text in, text out: a notebook-friendly front end over `decode`.

    sampler = Sampler(model, "bytes")                       # ReFusion, its default settings
    sampler("2 + 2 =")                                      # -> str
    sampler(["a", "b"])                                     # -> list[str], one batch
    texts, result = sampler.generate(["a", "b"])            # + the DecodeResult (trace, TPF)
    Sampler(model, tok, method=rj.AR(gen_length=32))        # the baselines, same interface
    Sampler(model, tok, method=rj.ReFusion(slot_size=8), rows=8)(texts)   # 8 rows kept busy

Prompts are padded into the length buckets of `refusion_jax.decoding.prompts`.
The sampler keeps one `engine.Engine` per (rows, bucket): the parameters are
placed once, and calls with new prompts of a bucket reuse the compiled
program: with `rows`, whatever the number of texts; without, for the same
number. How it decodes (rows, seed, special ids, mesh, chunk_iterations, a
prefix cache) is one `DecodeOptions`, given whole or as keywords, as
`rj.decode` takes it; with `prefix_cache_tokens`, its engines share one prefix
cache, kept across calls, so a prompt asked again or sharing a header with an
earlier one prefills only what is new.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from refusion_jax.data.tokenizer import Tokenizer, format_prompt, load_tokenizer
from refusion_jax.decoding.checks import check_method, check_prompts
from refusion_jax.decoding.contract import Method
from refusion_jax.decoding.engine import Engine
from refusion_jax.decoding.options import DecodeOptions, decode_options
from refusion_jax.decoding.prefix_cache import PrefixCache
from refusion_jax.decoding.prompts import bucket_length
from refusion_jax.decoding.refusion import ReFusion
from refusion_jax.decoding.result import DecodeResult
from refusion_jax.decoding.stop_strings import check_stop_strings
from refusion_jax.decoding.text_stream import TextStream
from refusion_jax.model.transformer import Transformer, inference_view


class Sampler:
  """Decode text prompts with a method value (`rj.ReFusion(...)`, `rj.AR(...)`, `rj.MDM(...)`).

  Special ids (mask, EOS, pad) default to the tokenizer's — the ids the model
  saw in training — then to the model config's; pass `mask_id=` etc. to
  override.
  """

  def __init__(
    self,
    model: Transformer,
    tokenizer: Tokenizer | str,
    method: Method | None = None,
    options: DecodeOptions | None = None,
    *,
    chat_template: bool = False,
    **option_fields: Any,
  ):
    """
    Args:
      model: the backbone.
      tokenizer: a `Tokenizer`, or a name/path for `load_tokenizer` ("bytes", a HF directory).
      method: the method value; None: `ReFusion()`.
      options: how to decode (`DecodeOptions`), its fields also given as keywords (`rows=8`, `seed=1`,
        `mask_id=...`), as `rj.decode` takes them; special ids left unset are the tokenizer's, then the config's.
      chat_template: wrap every prompt with the tokenizer's chat template first.
    """
    method = ReFusion() if method is None else method
    check_method(method)
    options = decode_options(options, option_fields, "refusion_jax.Sampler")
    self.model = inference_view(model)  # remat off and weights cast once, not per call
    self.method = method
    self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    self.chat_template = chat_template
    self.options = options.with_tokenizer_ids(self.tokenizer, model.config)
    self._engines: dict[tuple[int, int], Engine] = {}
    tokens = self.options.prefix_cache_tokens
    self.prefix_cache = PrefixCache(self.model.config, tokens) if tokens else None  # every engine's, if on

  @property
  def special_ids(self) -> dict[str, int | None]:
    """The special ids it decodes with: the options', else the tokenizer's, else the model config's."""
    return self.options.special_ids

  def encode(self, text: str) -> list[int]:
    """Prompt ids of one text (after the chat template when it is on)."""
    ids = self.tokenizer.encode(format_prompt(self.tokenizer, text, self.chat_template))
    if not ids:
      raise ValueError("The prompt is empty after tokenisation; give at least one character.")
    return ids

  def engine(self, rows: int, prompt_width: int) -> Engine:
    """The sampler's engine for K = `rows` rows and prompt bucket `prompt_width` (built on first use)."""
    if (rows, prompt_width) not in self._engines:
      options = dataclasses.replace(self.options, rows=rows)
      engine = Engine(self.model, self.method, options, prompt_width=prompt_width, prefix_cache=self.prefix_cache)
      self._engines[rows, prompt_width] = engine
    return self._engines[rows, prompt_width]

  def decode_ids(self, prompt_ids: Sequence[Sequence[int]]) -> DecodeResult:
    """Decode token-id prompts (one batch) with this sampler's method, as `rj.decode` would."""
    check_prompts(prompt_ids, self.model.config, self.method.gen_length)
    engine = self.engine(self.options.rows or len(prompt_ids), bucket_length(max(len(p) for p in prompt_ids)))
    return engine.run(prompt_ids)

  def generate(self, texts: Sequence[str]) -> tuple[list[str], DecodeResult]:
    """Decode a batch of text prompts; returns the answers' texts and the full result."""
    result = self.decode_ids([self.encode(t) for t in texts])
    return [self.tokenizer.decode(tokens) for tokens in result.tokens], result

  def stream(self, text: str, *, stop: str | Sequence[str] | None = None, iterations: int = 4) -> Iterator[str]:
    """The answer to `text` as it is decoded: text increments that join into `self(text)` (up to a stop string).

        for piece in sampler.stream("2 + 2 ="):
          print(piece, end="", flush=True)

    ReFusion commits slots out of order, so an increment is the newly settled part of the answer's leading run
    of committed tokens (`text_stream.TextStream`: a cut multi-byte character or a possible stop string waits
    for the next tokens), read every `iterations` loop iterations; the server streams the same way.
    """
    ids = self.encode(text)
    engine = self.engine(1, bucket_length(len(ids)))
    request = engine.submit(ids)
    answer = TextStream(self.tokenizer, engine.decoder.eos_id, self.method.gen_length, check_stop_strings(stop))
    try:
      while answer.finish_reason is None:
        finished = engine.advance(iterations)
        piece = answer.update(engine.partial(request), final=request in finished)
        if piece:
          yield piece
    finally:  # also when the caller stops early: the engine is left idle
      engine.cancel(request)

  def __call__(self, texts: str | Sequence[str]) -> str | list[str]:
    """One text -> its answer; a list of texts -> their answers (decoded as one batch)."""
    if isinstance(texts, str):
      return self.generate([texts])[0][0]
    return self.generate(list(texts))[0]
