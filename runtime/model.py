"""One way to open a model: a family directory plus run options give the engine, tokenizer and chat format.

Every front end (the CLI, the desktop app, the bench, calibration, the batch path) and the Python API open a
model here, so a run option means the same everywhere.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from staticlm.errors import InvalidOption
from staticlm.runtime.chat import ChatFormat, ChatSession
from staticlm.runtime.engine.engine import Engine
from staticlm.runtime.family.manifest import Manifest, load_manifest
from staticlm.runtime.generate.drive import GenerationResult, Response, generate_many, stream
from staticlm.runtime.generate.generator import Generator
from staticlm.runtime.generate.loop import GenerationLoop
from staticlm.runtime.generate.loop_parts import LoopParts
from staticlm.runtime.generate.text_stream import GenerationParams
from staticlm.runtime.options import RunOptions
from staticlm.runtime.speculative.batch_speculative import BatchSpeculator
from staticlm.runtime.speculative.drafters import DraftModelDrafter, PromptLookupDrafter
from staticlm.runtime.speculative.speculate_options import SpeculateMode, SpeculateOptions
from staticlm.runtime.speculative.speculative import DraftLength, Speculator
from staticlm.runtime.text.tokenizer import Tokenizer


def open_tokenizer(model_dir: str | Path, manifest: Manifest | None = None) -> Tokenizer:
    """The family's tokenizer with its special tokens (manifest: when the caller has read it already)."""
    m = manifest or load_manifest(model_dir)
    st = m.special_tokens
    return Tokenizer.from_file(Path(model_dir) / m.tokenizer_file, bos_token_id=st.bos_token_id,
                               eos_token_ids=st.eos_token_ids, add_bos_token=st.add_bos_token)


def chat_format(model_dir: str | Path, manifest: Manifest | None = None) -> ChatFormat:
    """How the family's chat template turns messages into prompt ids (no engine needed)."""
    m = manifest or load_manifest(model_dir)
    return ChatFormat(tokenizer=open_tokenizer(model_dir, m), chat_template=m.chat_template,
                      bos_token=m.special_tokens.bos_token, eos_token=m.special_tokens.eos_token)


class Model:
    """An exported family, opened: `engine` (graphs and KV), `tokenizer`, `format` (the chat template) and
    `generator`, the token-level view of the engine's KV (append_tokens, generate_next_token, rewind_to), and
    `loop`, the generation loop every answer runs through (loop.py).

        model = Model.open("path/to/family", RunOptions(temperature=0.7))
        chat = model.chat()
        for text in chat.send("Hello!"):
            print(text, end="")
    """

    def __init__(self, engine: Engine, *, options: RunOptions) -> None:
        self.engine, self.options = engine, options
        self.format = chat_format(engine.model_dir, engine.manifest)
        self.tokenizer = self.format.tokenizer
        # One engine holds one KV cache, so it has one Generator (whose token list mirrors that cache): every
        # chat and the token-level API share it, and each request rewinds to what it has in common with the cache.
        self.generator = Generator(engine, self.tokenizer)
        self.generator.speculator = self.speculator(num_sequences=1)
        self._loop: GenerationLoop | None = None
        self.last_result: GenerationResult | None = None

    @classmethod
    def open(cls, model_dir: str | Path | None = None, options: RunOptions | None = None, *,
             warm_up: bool = True) -> Model:
        """model_dir overrides options.model_dir; one of them must name a family."""
        options = options or RunOptions()
        model_dir = model_dir if model_dir is not None else options.model_dir
        if model_dir is None:
            raise InvalidOption("no model directory: pass one (staticlm export writes it)")
        options = options.replace(model_dir=model_dir)
        check_draft_model(options.speculate_options())
        engine = Engine(options.model_dir, options=options.engine_options())
        token_rows = engine.graphs.decode[0].shape.ar
        if options.speculate is None and token_rows > 1:  # the NPU plan's token graph: drafts ride in its rows
            options = options.replace(speculate="lookup", draft_len=options.draft_len or token_rows - 1)
        if warm_up:
            engine.warm_up(verify=options.speculate_options().mode is not SpeculateMode.NONE)
        return cls(engine, options=options)

    @property
    def manifest(self) -> Manifest:
        return self.engine.manifest

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def loop(self) -> GenerationLoop:
        """The generation loop (opened on first use; a server opens its own with open_loop)."""
        return self._loop if self._loop is not None else self.open_loop()

    def open_loop(self, *, max_queue: int = 64, prompt_cache: bool = True, eager: bool = False) -> GenerationLoop:
        """The model's one loop, with these settings (its lane is the model's engine: one loop per model)."""
        self._loop = GenerationLoop(self.loop_parts(), max_queue=max_queue, prompt_cache=prompt_cache, eager=eager)
        return self._loop

    def loop_parts(self) -> LoopParts:
        """What a generation loop over this model is handed: the lane, the rows' speculator factory, the options."""
        return LoopParts(lane=self.generator, speculator=self.speculator, speculates=self.speculates,
                         shared_prompt_kv=self.options.shared_prompt_kv)

    def default_params(self, options: RunOptions | None = None) -> GenerationParams:
        """An answer's parameters from the run options (default: the model's), the sampling fields they leave unset
        taken from the family's own defaults, else the shared table (runtime/family/generation_defaults.py)."""
        return (options or self.options).generation_params(self.manifest.generation_defaults)

    def stream(self, prompt_ids: list[int], params: GenerationParams | None = None, *,
               should_stop: Callable[[], bool] = lambda: False, **request) -> Iterator[str]:
        """One answer's text as it comes (request: num_logprobs, constraint); the summary is `last_result`."""
        return stream(self.loop, prompt_ids, params or self.default_params(), should_stop=should_stop,
                      on_result=self._set_result, **request)

    def generate(self, prompt_ids: list[int], params: GenerationParams | None = None, **request) -> GenerationResult:
        for _ in self.stream(prompt_ids, params, **request):
            pass
        return self.last_result

    def generate_many(self, prompt_ids: list[int], params: GenerationParams | None = None, *, num_responses: int,
                      on_text: Callable[[int, str], None] = lambda index, text: None,
                      should_stop: Callable[[], bool] = lambda: False, **request) -> list[Response]:
        """num_responses answers to one prompt, decoded together on the loop's rows (request: num_logprobs,
        constraint)."""
        if self.manifest.model.local_layers and not self.manifest.batch_sizes:
            raise InvalidOption(f"{self.engine.model_dir}: --num-responses is not available for a model with "
                                "sliding-window layers (its batched graphs are not exported yet); run one at a time")
        if num_responses > 1 and not self.loop.rows.available:
            raise InvalidOption(self.loop.rows.unavailable)
        return generate_many(self.loop, prompt_ids, params or self.default_params(),
                             num_responses=num_responses, on_text=on_text, should_stop=should_stop, **request)

    def _set_result(self, result: GenerationResult) -> None:
        self.last_result = result

    def chat(self, *, system_prompt: str | None = None) -> ChatSession:
        """A conversation; system_prompt defaults to the options' one."""
        return ChatSession(self, self.format, params=self.default_params(),
                           system_prompt=system_prompt if system_prompt is not None
                           else self.options.system_prompt_or_none)

    @property
    def speculates(self) -> bool:
        return self.options.speculate_options().mode is not SpeculateMode.NONE

    def speculator(self, *, num_sequences: int, engine=None) -> Speculator | BatchSpeculator | None:
        """A draft model must share the target's tokenizer; one drafter per sequence (a draft model keeps
        per-sequence KV), all draft engines on one weight mapping.

        Without --speculate, an engine that pairs rows (Engine.pairs_rows) still drafts one token by prompt lookup
        where it can: the row a decode step runs beside its token then checks a guess instead of recomputing the
        row before it, at the same cost (engine: the one the speculator steps, default the lane; the batch rows draft
        only in the steps they pair, rows.py)."""
        spec = self.options.speculate_options()
        if spec.mode is SpeculateMode.NONE:
            if not getattr(engine or self.engine, "pairs_rows", False):
                return None
            length, drafters = DraftLength(initial=1, fixed=True), [PromptLookupDrafter()] * num_sequences
        elif spec.mode is SpeculateMode.LOOKUP:
            length = DraftLength(initial=spec.fixed_length, fixed=True) if spec.fixed_length else DraftLength()
            drafters = [PromptLookupDrafter()] * num_sequences  # stateless: one serves every sequence
        else:
            length = DraftLength(initial=spec.fixed_length, fixed=True) if spec.fixed_length else DraftLength()
            first = Engine(spec.draft_dir, options=self.engine.options)
            if first.manifest.model.vocab_size != self.manifest.model.vocab_size or \
                    _tokenizer_bytes(first) != _tokenizer_bytes(self.engine):
                raise InvalidOption(f"the draft model {spec.draft_dir} does not share the target's tokenizer")
            engines = [first] + [Engine(spec.draft_dir, options=first.options, weights_from=first)
                                 for _ in range(num_sequences - 1)]
            drafters = [DraftModelDrafter(e, self.tokenizer) for e in engines]
        if num_sequences > 1:
            return BatchSpeculator(drafters, length=length)
        return Speculator(drafters[0], length=length)


def check_draft_model(spec: SpeculateOptions) -> None:
    """Refuse a missing draft model before anything loads, naming it as the draft."""
    if spec.mode is SpeculateMode.DRAFT and not (Path(spec.draft_dir) / "manifest.json").is_file():
        raise InvalidOption(f"the draft model {spec.draft_dir} (--speculate draft:DIR) is not an exported "
                            "family: export one with staticlm export --draft-layers K --out DIR")


def _tokenizer_bytes(engine: Engine) -> bytes:
    return (engine.model_dir / engine.manifest.tokenizer_file).read_bytes()
