"""The OpenAI API's request and response bodies, as pydantic models (what FastAPI validates and documents).

Requests accept the fields of OpenAI's `/v1/completions` and
`/v1/chat/completions`; unknown fields are refused, and so are the fields this
server cannot honour (`unsupported`: more than one choice, log
probabilities, penalties, ...) with a message naming the field. Responses
carry OpenAI's fields and ours in an extra object, `refusion`
(`DecodeStats`: forwards, tokens per forward, decode seconds, the token limit
applied).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from refusion_jax.serving.errors import bad_request


class GenerationRequest(pydantic.BaseModel):
  """What both endpoints take. Unset sampling fields take the server's settings (its command line)."""

  model_config = pydantic.ConfigDict(extra="forbid")

  model: str
  max_tokens: int | None = None
  temperature: float | None = pydantic.Field(default=None, ge=0.0, le=2.0)
  seed: int | None = pydantic.Field(default=None, ge=0, lt=2**63)
  stop: str | list[str] | None = None
  stream: bool = False
  stream_options: dict[str, Any] | None = None
  n: int = 1
  top_p: float | None = None
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  logit_bias: dict[str, float] | None = None
  user: str | None = None

  def unsupported(self) -> None:
    """Refuse (400) a field this server cannot honour, naming it and what to send instead."""
    refused = {
      "n": (self.n != 1, "this server returns one choice per request: send n=1 (or leave it out)"),
      "top_p": (self.top_p not in (None, 1.0), "nucleus sampling is not supported: leave top_p out"),
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
  """`POST /v1/completions`: one prompt (text or token ids)."""

  prompt: str | list[str] | list[int] | list[list[int]]
  logprobs: int | None = None
  echo: bool = False
  best_of: int | None = None
  suffix: str | None = None

  def _refused(self) -> dict[str, tuple[bool, str]]:
    one = not isinstance(self.prompt, list) or len(self.prompt) == 0 or isinstance(self.prompt[0], int)
    return {
      "prompt": (not one and len(self.prompt) != 1, "send one prompt per request (a string or a list of token ids)"),
      "logprobs": (self.logprobs is not None, "log probabilities are not returned: leave logprobs out"),
      "echo": (self.echo, "the prompt is not echoed: leave echo out"),
      "best_of": (self.best_of not in (None, 1), "best_of is not supported: leave it out"),
      "suffix": (self.suffix is not None, "insertion (suffix) is not supported: leave it out"),
    }

  def one_prompt(self) -> str | list[int]:
    """The prompt as text or as token ids (after `unsupported`, there is exactly one)."""
    prompt = self.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
      prompt = prompt[0]
    if not prompt:
      raise bad_request("prompt is empty; give at least one character or token id.", param="prompt")
    return prompt


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
  """`POST /v1/chat/completions`: a chat, rendered by the checkpoint's chat template."""

  messages: list[ChatMessage] = pydantic.Field(min_length=1)
  max_completion_tokens: int | None = None
  logprobs: bool | None = None
  top_logprobs: int | None = None
  tools: list[dict[str, Any]] | None = None
  tool_choice: Any = None
  response_format: dict[str, Any] | None = None

  def _refused(self) -> dict[str, tuple[bool, str]]:
    both = self.max_tokens is not None and self.max_completion_tokens is not None
    return {
      "logprobs": (bool(self.logprobs) or self.top_logprobs is not None, "log probabilities are not returned"),
      "tools": (bool(self.tools) or self.tool_choice is not None, "tool calls are not supported: leave tools out"),
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


class Usage(pydantic.BaseModel):
  prompt_tokens: int
  completion_tokens: int
  total_tokens: int


class DecodeStats(pydantic.BaseModel):
  """Ours, beside OpenAI's fields: how the answer was decoded.

  forwards: model forwards the request's row took part in (its prefill included).
  tokens_per_forward: answer tokens per forward (TPF).
  decode_seconds: from admission into a row to the answer's end.
  queue_seconds: from arrival to admission.
  max_tokens: the token limit applied: the request's rounded up to the slot grid, capped by gen_length.
  gen_length: the server's answer length G.
  temperature, seed: the sampling applied (the request's, else the server's; a seed drawn for it if neither).
  """

  forwards: int
  tokens_per_forward: float
  decode_seconds: float
  queue_seconds: float
  max_tokens: int
  gen_length: int
  temperature: float
  seed: int


class CompletionChoice(pydantic.BaseModel):
  index: int = 0
  text: str
  logprobs: None = None
  finish_reason: Literal["stop", "length"] | None


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


class ChatChoice(pydantic.BaseModel):
  index: int = 0
  message: AssistantMessage
  logprobs: None = None
  finish_reason: Literal["stop", "length"] | None


class ChatCompletionResponse(pydantic.BaseModel):
  id: str
  object: Literal["chat.completion"] = "chat.completion"
  created: int
  model: str
  choices: list[ChatChoice]
  usage: Usage
  refusion: DecodeStats


class Delta(pydantic.BaseModel):
  role: Literal["assistant"] | None = None
  content: str | None = None


class ChatChunkChoice(pydantic.BaseModel):
  index: int = 0
  delta: Delta
  logprobs: None = None
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
