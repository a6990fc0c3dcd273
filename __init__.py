"""staticlm: static-shape ONNX graphs and application-owned KV buffers for on-device LLMs.

The Python API, with onnxruntime-genai's ergonomics:

    import staticlm

    model = staticlm.Model.open("path/to/family", staticlm.RunOptions(temperature=0.7))
    chat = model.chat()
    for text in chat.send("What is the capital of France?"):
        print(text, end="")

`model.generator` is the token-level view of the same KV cache (append_tokens, generate_next_token, rewind_to);
`model.generate(ids)` returns a `GenerationResult` whose `finish_reason` is a `FinishReason`, and
`model.default_params()` the `GenerationParams` an answer runs with. The names load on first use, so
`import staticlm.kv_manager` stays pure numpy and loads no ONNX Runtime.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from staticlm.errors import InvalidOption, UserError
    from staticlm.kv_manager import ContextFull
    from staticlm.runtime.chat import ChatSession
    from staticlm.runtime.generate.drive import GenerationResult
    from staticlm.runtime.generate.generator import Generator
    from staticlm.runtime.generate.sampling import SamplingParams
    from staticlm.runtime.generate.text_stream import FinishReason, GenerationParams
    from staticlm.runtime.model import Model
    from staticlm.runtime.options import RunOptions
    from staticlm.runtime.session.device import Device
    from staticlm.runtime.text.chat_template import Message

_API = {
    "Model": "staticlm.runtime.model", "RunOptions": "staticlm.runtime.options",
    "ChatSession": "staticlm.runtime.chat", "Message": "staticlm.runtime.text.chat_template",
    "Generator": "staticlm.runtime.generate.generator", "GenerationParams": "staticlm.runtime.generate.text_stream",
    "GenerationResult": "staticlm.runtime.generate.drive", "FinishReason": "staticlm.runtime.generate.text_stream",
    "SamplingParams": "staticlm.runtime.generate.sampling", "Device": "staticlm.runtime.session.device",
    "ContextFull": "staticlm.kv_manager", "UserError": "staticlm.errors", "InvalidOption": "staticlm.errors",
}
__all__ = ["ChatSession", "ContextFull", "Device", "FinishReason", "GenerationParams", "GenerationResult",
           "Generator", "InvalidOption", "Message", "Model", "RunOptions", "SamplingParams", "UserError"]
assert sorted(_API) == __all__


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'staticlm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value
