"""From a validated request body to what the generation loop runs: prompt ids (fitted to the context), generation
parameters with the server's run options as defaults, and the grammar that constrains the output."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from staticlm.kv_manager import Overflow
from staticlm.runtime.family.generation_defaults import FIELDS as SAMPLING_FIELDS
from staticlm.runtime.family.generation_defaults import resolve
from staticlm.runtime.generate.sampling import SamplingParams
from staticlm.runtime.generate.text_stream import GenerationParams
from staticlm.runtime.text.prompt_room import max_prompt_tokens

from .errors import APIError, bad_value
from .prompt import chat_prompt
from .reasoning import CLOSE, BudgetConstraints, ReasoningPlan, prompt_opens_thinking, soft_switch, template_reasons
from .schemas import ChatMessage, ChatRequest, CompletionRequest, SamplingFields
from .state import ServeState


@dataclass
class Prepared:
    prompt_ids: list[int]
    params: GenerationParams
    num_choices: int
    num_logprobs: int | None
    constraint: Any  # a factory of runtime Constraints, or None
    tool_names: set[str] | None  # parse tool calls out of the answers (None: never)
    stream: bool
    include_usage: bool
    prompt_text: str = ""  # completions' echo
    reasoning: ReasoningPlan | None = None  # a reasoning model's answers: how to read their thoughts


def check_model(state: ServeState, model: str | None) -> None:
    if model not in (None, "", state.model_id):
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_id!r}",
                       param="model", code="model_not_found")


def _logit_bias(state: ServeState, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    vocab = state.model.manifest.model.vocab_size
    out = []
    for key, value in (bias or {}).items():
        if not key.strip().isdigit() or not 0 <= int(key) < vocab:
            raise bad_value("logit_bias", f"logit_bias keys must be token ids in 0..{vocab - 1}, got {key!r}")
        if not -100 <= value <= 100:
            raise bad_value("logit_bias", f"logit_bias values must be in [-100, 100], got {value} for {key}")
        out.append((int(key), float(value)))
    return tuple(out)


def _params(state: ServeState, req: SamplingFields, *, max_new: int, num_prompt_tokens: int) -> GenerationParams:
    o = state.options
    pick = lambda value, default: default if value is None else value
    # the request's fields, else the server's run options; what both leave unset, the model's own or the shared
    # table's (a temperature of 0 is exact greedy: the unset warpers off)
    given = {name: pick(getattr(req, name), getattr(o, name)) for name in SAMPLING_FIELDS}
    try:
        sampling = SamplingParams(**resolve(given, state.model.manifest.generation_defaults),
                                  seed=o.seed if req.seed is None else req.seed_or_none(),
                                  presence_penalty=req.presence_penalty or 0.0,
                                  frequency_penalty=req.frequency_penalty or 0.0,
                                  logit_bias=_logit_bias(state, req.logit_bias), num_prompt_tokens=num_prompt_tokens)
    except ValueError as e:  # the fields are validated against the schema first: a bad run option's default
        raise bad_value(_named_field(str(e)), str(e)) from None
    stop = req.stop_strings() if req.stop is not None else o.stop
    return GenerationParams(max_new_tokens=max_new, sampling=sampling, stop_strings=stop,
                            ignore_eos=req.ignore_eos or o.ignore_eos)


def _named_field(message: str) -> str | None:
    """The request field a sampling check names (its message names the CLI option: --top-p -> top_p)."""
    for name in (*SAMPLING_FIELDS, "presence_penalty", "frequency_penalty", "logit_bias"):
        if message.startswith((f"--{name.replace('_', '-')} ", f"{name} ")):
            return name
    return None


@functools.cache
def max_token_chars(tokenizer) -> int:
    """The most characters one token stands for (its vocabulary string's length bounds its text's: a byte-level
    BPE writes a byte a character, SentencePiece's byte tokens are "<0xAB>")."""
    return max((len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size)), default=1) or 1


def check_text_fits(state: ServeState, num_chars: int, *, param: str) -> None:
    """Refuse, before tokenizing it, a prompt whose text alone needs more tokens than the context holds (the
    tokenizer's time and memory grow with a prompt of megabytes, only for it to be refused after): each token
    covers at most max_token_chars characters. Under --on-overflow slide a long prompt is cut, not refused: it is
    tokenized."""
    if state.options.overflow is Overflow.SLIDE:
        return
    least = -(-num_chars // max_token_chars(state.model.tokenizer))
    if least >= state.max_context:
        raise APIError(400, f"the prompt has at least {least} tokens; this model's context holds "
                       f"{state.max_context} (the answer needs at least one more)", param=param,
                       code="context_length_exceeded")


def _limit(state: ServeState, asked: int | None) -> int:
    return min(asked or state.options.max_new_tokens, state.max_context - 1)


def _too_long(state: ServeState, n: int, *, param: str) -> APIError:
    return APIError(400, f"the prompt has {n} tokens; this model's context holds {state.max_context} "
                    "(the answer needs at least one more)", param=param, code="context_length_exceeded")


def check_choices(state: ServeState, n: int) -> None:
    num_rows = state.generation_loop.num_rows
    if n > num_rows:
        raise bad_value("n", f"n={n} asks for more choices than this server's {num_rows} batch rows")


def check_messages(messages: list[ChatMessage]) -> None:
    """What a text-only model cannot take, and tool answers that name no call, are 400s naming the part."""
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if part.type != "text":
                where = f"messages[{i}].content[{j}]"
                raise bad_value(where, f"{where} is a part of type {part.type!r}; this model reads text only")
        if m.role == "tool" and not m.tool_call_id:
            raise bad_value(f"messages[{i}].tool_call_id", f"messages[{i}] is a tool message without tool_call_id")


RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token")


def _template_kwargs(state: ServeState, req: ChatRequest) -> tuple[dict, int]:
    """The chat template's extra variables (thinking off by the budget or the soft switch unless the request
    says otherwise), and the reasoning budget (-1: none)."""
    kwargs = dict(req.chat_template_kwargs or {})
    clash = [k for k in kwargs if k in RESERVED_TEMPLATE_VARIABLES]
    if clash:
        raise bad_value("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(clash)}")
    budget = state.serve.reasoning_budget
    if req.reasoning_budget is not None:
        if req.reasoning_budget < -1:
            raise bad_value("reasoning_budget", "reasoning_budget must be -1 (no limit), 0 (thinking off) or a "
                            f"number of tokens, got {req.reasoning_budget}")
        budget = req.reasoning_budget
    users = [m for m in req.messages if m.role == "user"]
    switch = soft_switch(users[-1].text()) if users else None
    if budget == 0:
        kwargs["enable_thinking"] = False
    elif switch is not None:
        kwargs.setdefault("enable_thinking", switch)
    return kwargs, budget


def _reasoning(state: ServeState, ids: list[int], *, budget: int, thinking_off: bool,
               constraint: Any) -> tuple[ReasoningPlan | None, Any]:
    """How to read the answers of a model whose template thinks, and the constraint that keeps its budget (and
    applies a grammar only after its thoughts)."""
    fmt = state.model.format
    if not template_reasons(fmt.chat_template):
        return None, constraint
    tok = fmt.tokenizer
    started = not thinking_off and prompt_opens_thinking(tok.decode(ids[-16:]))
    plan = ReasoningPlan(split=state.serve.reasoning_format != "none", started=started)
    limited = budget > 0 and not thinking_off
    if (limited and constraint is None) or (started and constraint is not None):
        constraint = BudgetConstraints(budget=budget if limited else None, tokenizer=tok, started=started,
                                       close_ids=tok.encode(CLOSE, add_special_tokens=False), inner=constraint)
    return plan, constraint


def prepare_chat(state: ServeState, req: ChatRequest) -> Prepared:
    check_model(state, req.model)
    if not req.messages:
        raise bad_value("messages", "messages must not be empty")
    check_messages(req.messages)
    check_choices(state, req.n)
    check_text_fits(state, sum(len(m.text()) for m in req.messages), param="messages")
    fmt = state.model.format
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise bad_value("tool_choice", "tool_choice needs tools")
    rendered = tools if choice != "none" else None
    messages, kwargs = chat_prompt(fmt, req.messages, tools=rendered, system_prompt=state.options.system_prompt_or_none)
    template_kwargs, budget = _template_kwargs(state, req)
    if template_kwargs:
        kwargs["template_kwargs"] = template_kwargs
    ids = fmt.prompt_ids(messages, **kwargs)
    limit = _limit(state, req.limit())
    if len(ids) >= state.max_context:
        if state.options.overflow is not Overflow.SLIDE:
            raise _too_long(state, len(ids), param="messages")
        room = max_prompt_tokens(max_context=state.max_context, max_new_tokens=limit)
        ids, _ = fmt.fitted_prompt_ids(messages, max_tokens=room, **kwargs)
    constraint, names = None, None
    if rendered:
        names = {t["function"]["name"] for t in rendered}
        if isinstance(choice, str) and choice == "required":
            constraint = state.grammars.tool_call([t["function"] for t in rendered])
        elif not isinstance(choice, str):
            wanted = choice.function["name"]
            if wanted not in names:
                raise bad_value("tool_choice", f"tool_choice names {wanted!r}, which is not among the tools")
            constraint = state.grammars.tool_call([t["function"] for t in rendered if t["function"]["name"] == wanted])
    fmt_ = req.response_format
    if constraint is None and fmt_ is not None and fmt_.type != "text":
        if fmt_.type == "json_schema":
            if fmt_.json_schema is None or not fmt_.json_schema.schema_:
                raise bad_value("response_format", "response_format json_schema needs json_schema.schema")
            constraint = state.grammars.json_schema(fmt_.json_schema.schema_)
        else:
            constraint = state.grammars.json_schema({"type": "object"})
    plan, constraint = _reasoning(state, ids, budget=budget, constraint=constraint,
                                  thinking_off=template_kwargs.get("enable_thinking") is False)
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return Prepared(prompt_ids=ids, params=_params(state, req, max_new=min(limit, state.max_context - len(ids)),
                                                   num_prompt_tokens=len(ids)),
                    num_choices=req.n, num_logprobs=num_logprobs, constraint=constraint, tool_names=names,
                    stream=req.stream, include_usage=bool(req.stream_options and req.stream_options.include_usage),
                    reasoning=plan)


def prepare_completion(state: ServeState, req: CompletionRequest) -> Prepared:
    check_model(state, req.model)
    check_choices(state, req.n)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise bad_value("prompt", "one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_text_fits(state, len(prompt), param="prompt")
        text, ids = prompt, state.model.tokenizer.encode(prompt, add_special_tokens=True)
    else:
        vocab = state.model.manifest.model.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise bad_value("prompt", f"token ids must be in 0..{vocab - 1}")
        text, ids = state.model.tokenizer.decode(prompt), list(prompt)
    if not ids:
        raise bad_value("prompt", "the prompt is empty")
    limit = _limit(state, req.limit())
    if len(ids) >= state.max_context:
        if state.options.overflow is not Overflow.SLIDE:
            raise _too_long(state, len(ids), param="prompt")
        ids = ids[len(ids) - max_prompt_tokens(max_context=state.max_context, max_new_tokens=limit):]  # keep the end
    return Prepared(prompt_ids=ids, params=_params(state, req, max_new=min(limit, state.max_context - len(ids)),
                                                   num_prompt_tokens=len(ids)),
                    num_choices=req.n, num_logprobs=req.logprobs, constraint=None, tool_names=None,
                    stream=req.stream, include_usage=bool(req.stream_options and req.stream_options.include_usage),
                    prompt_text=text if req.echo else "")


__all__ = ["Prepared", "check_model", "prepare_chat", "prepare_completion"]
