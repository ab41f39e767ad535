"""The OpenAI API's request and response bodies, as pydantic models (what FastAPI validates and documents).

Requests accept the fields of OpenAI's `/v1/completions` and
`/v1/chat/completions`, and vLLM's sampling extensions (`top_k`, `min_p`,
`stop_token_ids`); unknown fields are refused, and so are the fields this
server cannot honour (`unsupported`: penalties, top alternatives' log
probabilities, tools, ...) with a message naming the field. Responses carry
OpenAI's fields and ours in an extra object, `refusion` (`DecodeStats`:
forwards, tokens per forward, decode seconds, the token limit applied), on
each choice and, for a single choice, on the response.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from refusion_jax.serving.errors import bad_request


class StreamOptions(pydantic.BaseModel):
  """OpenAI's `stream_options`: `include_usage` adds a last chunk with the usage and no choices."""

  model_config = pydantic.ConfigDict(extra="forbid")
  include_usage: bool = False


class GenerationRequest(pydantic.BaseModel):
  """What both endpoints take. Unset sampling fields take the server's settings (its command line).

  `top_k`, `top_p` and `min_p` filter the distribution each token is drawn from (vLLM's order: top_k, top_p,
  min_p on the tempered distribution); they change nothing at temperature 0 (greedy). `n` answers per prompt
  draw with seeds seed, seed + 1, ... .
  """

  model_config = pydantic.ConfigDict(extra="forbid")

  model: str
  max_tokens: int | None = None
  temperature: float | None = pydantic.Field(default=None, ge=0.0, le=2.0)
  seed: int | None = pydantic.Field(default=None, ge=0, lt=2**63)
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  n: int = pydantic.Field(default=1, ge=1)
  top_p: float | None = pydantic.Field(default=None, gt=0.0, le=1.0)
  top_k: int | None = pydantic.Field(default=None, ge=-1)
  min_p: float | None = pydantic.Field(default=None, ge=0.0, le=1.0)
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  logit_bias: dict[str, float] | None = None
  user: str | None = None

  def filters(self) -> dict[str, float]:
    """The sampling filters as `Engine.submit` takes them (top_k -1 or 0: off, as vLLM reads it)."""
    return dict(
      top_k=max(self.top_k or 0, 0),
      top_p=1.0 if self.top_p is None else self.top_p,
      min_p=self.min_p or 0.0,
    )

  def wants_logprobs(self) -> bool:
    return False

  def unsupported(self) -> None:
    """Refuse (400) a field this server cannot honour, naming it and what to send instead."""
    refused = {
      "stream_options": (
        self.stream_options is not None and not self.stream,
        "stream_options applies to streamed answers: send it with stream=true, or leave it out",
      ),
      "presence_penalty": (bool(self.presence_penalty), "penalties are not supported: leave presence_penalty out"),
      "frequency_penalty": (bool(self.frequency_penalty), "penalties are not supported: leave frequency_penalty out"),
      "logit_bias": (bool(self.logit_bias), "logit_bias is not supported: leave it out"),
      **self._refused(),
    }
    for field, (bad, message) in refused.items():
      if bad:
        raise bad_request(f"{field}: {message}.", param=field, code="unsupported_parameter")
    if self.max_tokens is not None and self.max_tokens <= 0:
      raise bad_request(f"max_tokens is {self.max_tokens}; give a positive number of tokens.", param="max_tokens")

  def _refused(self) -> dict[str, tuple[bool, str]]:
    return {}


class CompletionRequest(GenerationRequest):
  """`POST /v1/completions`: one prompt or a list of them (texts or token ids); choice p·n + i is the i-th answer
  to prompt p, as OpenAI indexes them.

  `logprobs` 0 returns each answer token's log-probability (OpenAI's `logprobs` object, whose `top_logprobs`
  hold the chosen token alone); more alternatives are not computed.
  """

  prompt: str | list[str] | list[int] | list[list[int]]
  logprobs: int | None = pydantic.Field(default=None, ge=0)
  echo: bool = False
  best_of: int | None = None
  suffix: str | None = None

  def wants_logprobs(self) -> bool:
    return self.logprobs is not None

  def _refused(self) -> dict[str, tuple[bool, str]]:
    return {
      "logprobs": (
        bool(self.logprobs),
        "only each answer token's own log-probability is computed, not the top alternatives: send logprobs=0",
      ),
      "echo": (self.echo, "the prompt is not echoed: leave echo out"),
      "best_of": (self.best_of not in (None, 1), "best_of is not supported: leave it out"),
      "suffix": (self.suffix is not None, "insertion (suffix) is not supported: leave it out"),
    }

  def prompts(self) -> list[str | list[int]]:
    """The prompts, each a text or a list of token ids."""
    prompt = self.prompt
    prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    if not prompts or any(not p for p in prompts):
      raise bad_request("prompt is empty; give at least one character or token id in each prompt.", param="prompt")
    return prompts


class TextPart(pydantic.BaseModel):
  """A text part of a message's content (the only kind this server reads)."""

  model_config = pydantic.ConfigDict(extra="forbid")
  type: Literal["text"]
  text: str


class ChatMessage(pydantic.BaseModel):
  """One turn of a chat."""

  model_config = pydantic.ConfigDict(extra="forbid")
  role: Literal["system", "developer", "user", "assistant"]
  content: str | list[TextPart]
  name: str | None = None

  def text(self) -> str:
    return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
  """`POST /v1/chat/completions`: a chat, rendered by the checkpoint's chat template.

  `logprobs: true` returns each answer token's log-probability (`choices[].logprobs.content`); `top_logprobs`
  above 0 is refused (alternatives are not computed). `tool_choice: "none"` is accepted; tools are not.
  """

  messages: list[ChatMessage] = pydantic.Field(min_length=1)
  max_completion_tokens: int | None = None
  logprobs: bool | None = None
  top_logprobs: int | None = pydantic.Field(default=None, ge=0)
  tools: list[dict[str, Any]] | None = None
  tool_choice: Any = None
  response_format: dict[str, Any] | None = None

  def wants_logprobs(self) -> bool:
    return bool(self.logprobs)

  def _refused(self) -> dict[str, tuple[bool, str]]:
    both = self.max_tokens is not None and self.max_completion_tokens is not None
    return {
      "top_logprobs": (
        bool(self.top_logprobs),
        "only each answer token's own log-probability is computed, not the top alternatives: send logprobs=true "
        "without top_logprobs (or top_logprobs=0)",
      ),
      "tools": (bool(self.tools), "tool calls are not supported: leave tools out"),
      "tool_choice": (
        self.tool_choice not in (None, "none"),
        'tool calls are not supported: leave tool_choice out or send "none"',
      ),
      "response_format": (
        self.response_format not in (None, {"type": "text"}),
        'only plain text is returned: leave response_format out (or {"type": "text"})',
      ),
      "max_completion_tokens": (both, "give max_tokens or max_completion_tokens, not both"),
    }

  def unsupported(self) -> None:
    if self.max_completion_tokens is not None and self.max_tokens is None:
      self.max_tokens = self.max_completion_tokens
    super().unsupported()


class TokenizeRequest(pydantic.BaseModel):
  """vLLM's `POST /tokenize` (lm-eval's remote tokenizer): a text's ids, as the server reads a prompt."""

  model_config = pydantic.ConfigDict(extra="forbid")
  prompt: str
  model: str | None = None
  add_special_tokens: bool = True


class DetokenizeRequest(pydantic.BaseModel):
  """vLLM's `POST /detokenize`: the text of token ids."""

  model_config = pydantic.ConfigDict(extra="forbid")
  tokens: list[int]
  model: str | None = None


class PromptTokensDetails(pydantic.BaseModel):
  """OpenAI's `usage.prompt_tokens_details`: `cached_tokens`, the prompt tokens whose KV was reused (the prefix
  cache, docs/serving.md) rather than computed."""

  cached_tokens: int = 0


class Usage(pydantic.BaseModel):
  prompt_tokens: int
  completion_tokens: int
  total_tokens: int
  prompt_tokens_details: PromptTokensDetails = pydantic.Field(default_factory=PromptTokensDetails)


class DecodeStats(pydantic.BaseModel):
  """Ours, beside OpenAI's fields: how the answer was decoded.

  forwards: model forwards the request's row took part in (its prefill included).
  tokens_per_forward: answer tokens per forward (TPF).
  decode_seconds: from the start of its row's decode to the answer's end.
  queue_seconds: from arrival to the start of its row's decode (the wait for a free row included).
  max_tokens: the token limit applied: the request's rounded up to the slot grid, capped by gen_length.
  gen_length: the server's answer length G.
  temperature, seed: the sampling applied (the request's, else the server's; a seed drawn for it if neither).
  top_k, top_p, min_p: the filters applied (0, 1 and 0 filter nothing).
  """

  forwards: int
  tokens_per_forward: float
  decode_seconds: float
  queue_seconds: float
  max_tokens: int
  gen_length: int
  temperature: float
  seed: int
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0


class CompletionLogprobs(pydantic.BaseModel):
  """OpenAI's legacy `logprobs` object: the answer's tokens, each one's log-probability under the distribution it
  was drawn from, where its text begins in the answer, and (logprobs=0) the chosen token alone as the top."""

  tokens: list[str]
  token_logprobs: list[float]
  text_offset: list[int]
  top_logprobs: list[dict[str, float]]


class CompletionChoice(pydantic.BaseModel):
  index: int = 0
  text: str
  logprobs: CompletionLogprobs | None = None
  finish_reason: Literal["stop", "length"] | None
  refusion: DecodeStats | None = None


class CompletionResponse(pydantic.BaseModel):
  id: str
  object: Literal["text_completion"] = "text_completion"
  created: int
  model: str
  choices: list[CompletionChoice]
  usage: Usage | None = None
  refusion: DecodeStats | None = None


class AssistantMessage(pydantic.BaseModel):
  role: Literal["assistant"] = "assistant"
  content: str


class TokenLogprob(pydantic.BaseModel):
  """One answer token in chat's `logprobs.content`: its text, log-probability and UTF-8 bytes."""

  token: str
  logprob: float
  bytes: list[int] | None
  top_logprobs: list[dict[str, Any]] = []


class ChatLogprobs(pydantic.BaseModel):
  content: list[TokenLogprob]


class ChatChoice(pydantic.BaseModel):
  index: int = 0
  message: AssistantMessage
  logprobs: ChatLogprobs | None = None
  finish_reason: Literal["stop", "length"] | None
  refusion: DecodeStats | None = None


class ChatCompletionResponse(pydantic.BaseModel):
  id: str
  object: Literal["chat.completion"] = "chat.completion"
  created: int
  model: str
  choices: list[ChatChoice]
  usage: Usage
  refusion: DecodeStats | None = None


class Delta(pydantic.BaseModel):
  role: Literal["assistant"] | None = None
  content: str | None = None


class ChatChunkChoice(pydantic.BaseModel):
  index: int = 0
  delta: Delta
  logprobs: ChatLogprobs | None = None
  finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(pydantic.BaseModel):
  id: str
  object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
  created: int
  model: str
  choices: list[ChatChunkChoice]
  usage: Usage | None = None
  refusion: DecodeStats | None = None


class ModelCard(pydantic.BaseModel):
  """One served model, with the limits a client must respect."""

  id: str
  object: Literal["model"] = "model"
  created: int
  owned_by: str = "refusion_jax"
  max_prompt_tokens: int
  gen_length: int
  token_grid: int


class ModelList(pydantic.BaseModel):
  object: Literal["list"] = "list"
  data: list[ModelCard]
