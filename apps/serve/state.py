"""What every handler of one server shares: the model, the generation loop's worker, the options, metrics, grammars."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from staticlm.apps.grammar import Grammars
from staticlm.runtime.generate.loop import GenerationLoop
from staticlm.runtime.generate.slot_writer import SlotWriter
from staticlm.runtime.generate.slots import SlotStore
from staticlm.runtime.model import Model
from staticlm.runtime.options import RunOptions

from .metrics import ServeMetrics
from .options import ServeOptions, default_max_body_bytes
from .response_store import ResponseStore
from .worker import EngineWorker

SAVE_AT_EXIT_S = 5.0  # the prompt cache's last save may take this long at exit; past it, abandoned (whole files only)


@dataclass
class ServeState:
    model: Model
    options: RunOptions
    serve: ServeOptions
    worker: EngineWorker
    metrics: ServeMetrics
    grammars: Grammars
    model_id: str
    created: int = field(default=0)
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses' conversations

    @classmethod
    def build(cls, model: Model, serve: ServeOptions) -> ServeState:
        loop = model.open_loop(max_queue=serve.max_queue, prompt_cache=serve.prompt_cache, eager=True)
        on_idle = on_stop = None
        if serve.cache_dir is not None:
            slots = SlotStore.for_engine(serve.cache_dir, model.engine, max_entries=loop.max_saved_prefixes)
            num_loaded = loop.restore_prefixes(slots.load())
            print(f"staticlm serve: {num_loaded} cached prompt(s) loaded from {serve.cache_dir}", file=sys.stderr,
                  flush=True)
            writer = SlotWriter(slots)  # the engine thread only copies the rows; the files are written apart
            on_idle = lambda: writer.save(loop.cached_prefixes())  # noqa: E731
            on_stop = lambda: writer.close(timeout=SAVE_AT_EXIT_S)  # noqa: E731
        worker = EngineWorker(loop, on_idle=on_idle, on_stop=on_stop)
        return cls(model=model, options=model.options, serve=serve, worker=worker,
                   metrics=ServeMetrics(loop), grammars=Grammars.for_model(model),
                   model_id=serve.model_id or Path(model.engine.model_dir).resolve().name, created=int(time.time()))

    @property
    def generation_loop(self) -> GenerationLoop:
        return self.worker.generation_loop

    @property
    def max_context(self) -> int:
        return self.generation_loop.max_context

    @property
    def max_body_bytes(self) -> int:
        return self.serve.max_body_bytes or default_max_body_bytes(self.max_context)


__all__ = ["ServeState"]
