"""Text in, text out: a notebook-friendly front end over `decode`.

    sampler = Sampler(model, "bytes")                       # ReFusion, its default settings
    sampler("2 + 2 =")                                      # -> str
    sampler(["a", "b"])                                     # -> list[str], one batch
    texts, result = sampler.generate(["a", "b"])            # + the DecodeResult (trace, TPF)
    Sampler(model, tok, method=rj.AR(gen_length=32))        # the baselines, same interface
    Sampler(model, tok, method=rj.ReFusion(slot_size=8), batch_size=8)(texts)   # 8 rows kept busy

Prompts are padded into the length buckets of `refusion_jax.decoding.prompts`.
The sampler keeps one `driver.Engine` per (rows, bucket): the parameters are
placed once, and calls with new prompts of a bucket reuse the compiled
program: with `batch_size`, whatever the number of texts; without, for the
same number.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax

from refusion_jax.data.special_tokens import resolve_special_tokens
from refusion_jax.data.tokenizer import Tokenizer, format_prompt, load_tokenizer
from refusion_jax.decoding.checks import check_positive, check_prompts
from refusion_jax.decoding.contract import Method
from refusion_jax.decoding.driver import Engine, check_method
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
    *,
    batch_size: int | None = None,
    seed: int = 0,
    chat_template: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    mask_id: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    chunk_iterations: int | None = None,
  ):
    """
    Args:
      model: the backbone.
      tokenizer: a `Tokenizer`, or a name/path for `load_tokenizer` ("bytes", a HF directory).
      method: the method value; None: `ReFusion()`.
      batch_size, seed, mesh, chunk_iterations: as `rj.decode` takes them.
      chat_template: wrap every prompt with the tokenizer's chat template first.
      mask_id, eos_id, pad_id: override the tokenizer's and the config's ids.
    """
    method = ReFusion() if method is None else method
    check_method(method)
    check_positive("batch_size", batch_size, "all prompts of a call as one batch")
    self.model = inference_view(model)  # remat off and weights cast once, not per call
    self.method = method
    self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    self.chat_template = chat_template
    self.batch_size, self.chunk_iterations = batch_size, chunk_iterations
    known = resolve_special_tokens(tokenizer=self.tokenizer, config=model.config)
    self.special_ids = dict(
      mask_id=known.mask if mask_id is None else mask_id,
      eos_id=known.eos if eos_id is None else eos_id,
      pad_id=known.pad if pad_id is None else pad_id,
    )
    self._engine_options = dict(mesh=mesh, seed=seed, **self.special_ids)
    self._engines: dict[tuple[int, int], Engine] = {}

  def encode(self, text: str) -> list[int]:
    """Prompt ids of one text (after the chat template when it is on)."""
    ids = self.tokenizer.encode(format_prompt(self.tokenizer, text, self.chat_template))
    if not ids:
      raise ValueError("The prompt is empty after tokenisation; give at least one character.")
    return ids

  def engine(self, rows: int, prompt_width: int) -> Engine:
    """The sampler's engine for K = `rows` rows and prompt bucket `prompt_width` (built on first use)."""
    if (rows, prompt_width) not in self._engines:
      engine = Engine(self.model, self.method, rows=rows, prompt_width=prompt_width, **self._engine_options)
      self._engines[rows, prompt_width] = engine
    return self._engines[rows, prompt_width]

  def decode_ids(self, prompt_ids: Sequence[Sequence[int]]) -> DecodeResult:
    """Decode token-id prompts (one batch) with this sampler's method, as `rj.decode` would."""
    check_prompts(prompt_ids, self.model.config, self.method.gen_length)
    engine = self.engine(self.batch_size or len(prompt_ids), bucket_length(max(len(p) for p in prompt_ids)))
    return engine.run(prompt_ids, self.chunk_iterations)

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
