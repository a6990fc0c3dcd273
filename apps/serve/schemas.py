"""The OpenAI request bodies the server reads (pydantic): unknown fields are ignored, a known field with a bad
value is a 400 naming it."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_STOP_STRINGS = 4  # OpenAI's; the Messages API's own cap is MAX_STOP_SEQUENCES (messages.py)
# Each choice checks every stop string at every token on the engine's thread (runtime/text/stopping.py: its held
# suffix is as long as the longest stop string), so their number and length are bounded: no API says how long a
# stop string may be, and none needs one this long.
MAX_STOP_CHARS = 256
MAX_CHOICES = 64  # the scheduler refuses more than the batch rows, with the real number
# seed: any 64-bit value; -1 means "a random seed" as in llama-server (and as leaving it out does)
RANDOM_SEED = -1
MAX_SEED = 2**64 - 1
MAX_TOP_K = 2**31 - 1  # past any vocabulary: top_k that large keeps every token


def check_stop_lengths(stops: list[str]) -> None:
    for stop in stops:
        if len(stop) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got {len(stop)}")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, allow_inf_nan=False)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True, allow_inf_nan=False)


class ContentPart(_Open):
    type: str
    text: str | None = None


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class FunctionSpec(_Open):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Tool(_Open):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: dict[str, str]

    @field_validator("function")
    @classmethod
    def _has_name(cls, v: dict[str, str]) -> dict[str, str]:
        if not v.get("name"):
            raise ValueError("tool_choice.function needs a name")
        return v


class JsonSchemaFormat(_Body):
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """What both endpoints take: sampling, limits, stop strings, choices and the llama-server extras."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0, lt=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=RANDOM_SEED, le=MAX_SEED)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # llama-server's extra: decode to max_tokens (benchmarks)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None, info: ValidationInfo) -> str | list[str] | None:
        limit = (info.context or {}).get("max_stop_strings", MAX_STOP_STRINGS)  # None: checked by the Messages API
        if isinstance(v, list) and limit is not None and len(v) > limit:
            raise ValueError(f"at most {limit} stop strings")
        check_stop_lengths([v] if isinstance(v, str) else v or [])
        return v

    def seed_or_none(self) -> int | None:
        """The request's seed; None for no seed or -1 (a random one)."""
        return None if self.seed == RANDOM_SEED else self.seed

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    reasoning_budget: int | None = None  # reasoning tokens before </think> is forced (-1: none, 0: no thinking)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    def limit(self) -> int | None:
        return self.max_tokens
