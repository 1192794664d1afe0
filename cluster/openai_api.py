"""OpenAI-compatible request/response schemas, error bodies and prompt encoding.

The request models mirror the fields of OpenAI's ``/v1/chat/completions`` and ``/v1/completions``
that graftblock implements (``temperature``, ``top_p``, ``top_k``, ``seed``, ``max_tokens``,
``stop``, ``stream``) plus vLLM's ``top_k`` / ``stop_token_ids`` extensions. A field OpenAI defines
but graftblock does not implement (``n > 1``, ``logprobs``, penalties, tools, ...) is refused with a
400 naming it; an unknown field is refused too. Every error is OpenAI's body::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}

Responses carry the usual ``usage`` and one extension field, ``graftblock``: the method and its
speculative statistics for this response (tau = tokens gained per verify step, bonus included).
"""

from __future__ import annotations

import enum
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from speculation.assets import encode_turn


class ErrorType(str, enum.Enum):
    """OpenAI error ``type`` values graftblock returns."""

    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    NOT_FOUND = "not_found_error"
    RATE_LIMIT = "rate_limit_error"
    TIMEOUT = "timeout_error"
    OVERLOADED = "overloaded_error"
    SERVER = "server_error"


class APIError(Exception):
    """An error a handler returns as an OpenAI error body with HTTP ``status``."""

    def __init__(self, status: int, message: str, type_: ErrorType = ErrorType.INVALID_REQUEST,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers: dict[str, str] = dict(headers or {})
        """Extra HTTP response headers, e.g. ``Retry-After`` on a 429."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type.value, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, ErrorType.INVALID_REQUEST, param, code)


# --------------------------------------------------------------------------- requests
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


#: OpenAI fields graftblock does not implement, and the value that means "not used". A request that
#: sets one to anything else gets a 400 naming it.
UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "n": 1, "best_of": 1, "logprobs": None, "top_logprobs": None, "echo": False, "suffix": None,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None, "tools": None,
    "tool_choice": None, "functions": None, "function_call": None, "response_format": None,
    "parallel_tool_calls": None, "audio": None, "modalities": None, "prediction": None,
}
#: Fields accepted and ignored (bookkeeping on the client's side).
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier")


class _SamplingFields(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    """Extension (vLLM's): keep the k most likely tokens; 0 disables it."""
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    """Extension (vLLM's): token ids that end the completion (on top of the model's EOS)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Unsupported fields: accepted by the schema, refused by :meth:`check_supported` with a 400.
    n: int | None = 1
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: Any = None
    user: str | None = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_supported(self) -> None:
        """400 for any unimplemented OpenAI field set to a value that would change the output."""
        for name, neutral in UNSUPPORTED_DEFAULTS.items():
            if name not in type(self).model_fields:
                continue
            value = getattr(self, name)
            if value is None or value == neutral or (name == "logprobs" and value is False) or value == {}:
                continue
            raise bad_request(f"'{name}' = {value!r} is not supported by this server "
                              f"(supported: {name} = {neutral!r})", param=name, code="unsupported_parameter")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = 1

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a string or token ids); a batch of prompts is refused."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise bad_request("'prompt' is empty", param="prompt")
        if all(isinstance(t, int) for t in p):
            return list(p)  # type: ignore[arg-type]
        if len(p) == 1:
            return p[0]  # type: ignore[return-value]
        raise bad_request(f"a batch of {len(p)} prompts is not supported; send one prompt per request",
                          param="prompt", code="unsupported_parameter")


def parse_request(raw: bytes, model_cls: type[_SamplingFields]) -> _SamplingFields:
    """Decode and validate a request body: malformed JSON and schema violations become 400s."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"We could not parse the JSON body of your request ({exc.msg if hasattr(exc, 'msg') else exc}). "
                          "The body must be a JSON object.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    try:
        req = model_cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(x) for x in err["loc"]]
        param = ".".join(loc) if loc else None
        if err["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: {param}", param=param,
                              code="unrecognized_argument") from None
        if err["type"] == "missing":
            raise bad_request(f"Missing required parameter: '{param}'", param=param, code="missing_required_parameter") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise bad_request(f"Invalid value for '{param}': {msg} (got {err.get('input')!r})", param=param,
                          code="invalid_value") from None
    req.check_supported()
    return req


# --------------------------------------------------------------------------- prompts
def encode_chat(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    """Token ids of a conversation ready for the assistant's reply.

    With a chat template: ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``.
    Without one (a base model) the messages must alternate user/assistant and end with a user turn;
    they are written as the plain transcript of :func:`speculation.assets.encode_turn` (the same ids
    ``graftblock generate`` uses).
    """
    if getattr(tokenizer, "chat_template", None):
        conv = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in messages]
        encoded = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        if hasattr(encoded, "keys") and "input_ids" in encoded:
            encoded = encoded["input_ids"]
        if encoded and isinstance(encoded[0], list):
            encoded = encoded[0]
        return [int(t) for t in encoded]
    roles = [m.role for m in messages]
    expected = ["user" if i % 2 == 0 else "assistant" for i in range(len(messages))]
    if roles != expected or roles[-1] != "user":
        raise bad_request("this model has no chat template: messages must alternate user/assistant, starting "
                          f"and ending with a user message (got roles {roles})", param="messages")
    texts = [m.text() for m in messages]
    history = [(texts[i], texts[i + 1]) for i in range(0, len(texts) - 1, 2)]
    if not texts[-1].strip():
        raise bad_request("the last user message is empty", param="messages")
    return encode_turn(tokenizer, history, texts[-1])


def encode_prompt(tokenizer: Any, prompt: str | list[int], vocab_size: int) -> list[int]:
    """Token ids of a completion prompt (a string through the tokenizer, or ids checked against the vocab)."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty", param="prompt")
        return [int(t) for t in tokenizer(prompt)["input_ids"]]
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}", param="prompt")
    return list(prompt)


# --------------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecStats(BaseModel):
    """The ``graftblock`` extension field: speculative statistics of this response."""

    method: str
    tau: float
    """Mean tokens gained per verify step, bonus included (1.0 for vanilla)."""
    accepted_tokens: int
    """Draft tokens the target accepted (bonus tokens excluded)."""
    drafted_tokens: int
    """Draft nodes proposed (roots excluded)."""
    verify_steps: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    graftblock: SpecStats


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    graftblock: SpecStats | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    """A non-streamed completion, and (``object`` the same) each streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    graftblock: SpecStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "graftblock"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
