"""An NPU family's graph plan: the graphs every part compiles into its context, chosen at export and printed.

Each rung of a context ladder gets two graphs: a prompt graph of `prompt_len` rows and a token graph. The token graph
decodes one row (`token_len` 1), or verifies k rows and decodes through them (`token_len` k: a decode step is its one
real row and k - 1 padding rows, which lookup speculation fills with drafts; runtime/engine/graphs.py). The sequence's
first token has a graph of its own (the sink, its own activation ranges). Batched (segmented) graphs come only when
asked for (`--batch-sizes`). Every graph of a part shares the part's weights in one context binary, and a part's
compile holds each graph it has compiled until the last (runtime/session/compile_memory.py): the number of graphs is
what a context costs to compile, so the plan keeps it small.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from staticlm.errors import InvalidOption
from staticlm.export.family import ExportOptions
from staticlm.runtime.family.manifest import GraphEntry, GraphKind

MAX_GRAPHS_PER_CONTEXT = 64  # QNN's limit on the graphs of one context binary
MAX_RUNGS = 5
DEVICE_LADDER = (512, 1024, 2048, 4096)  # the default rungs; a model with fewer positions stops at its own
DEVICE_PROMPT_LEN = 128
DEVICE_TOKEN_LEN = 8  # README, "The NPU's token graph": lookup drafts ride in a decode step's padding rows


@dataclass(frozen=True)
class GraphPlan:
    contexts: tuple[int, ...] = DEVICE_LADDER
    prompt_len: int = DEVICE_PROMPT_LEN
    token_len: int = DEVICE_TOKEN_LEN  # 1: a decode graph; k > 1: a k-row verify graph that also decodes
    batch_sizes: tuple[int, ...] = ()  # segmented graphs for --num-responses, only when asked for
    extra_verify_lens: tuple[int, ...] = ()  # further verify graphs, only when asked for

    def __post_init__(self) -> None:
        if not 1 <= self.token_len < self.prompt_len:
            raise InvalidOption(f"--token-len must be in [1, prompt length {self.prompt_len}), got {self.token_len}")

    @classmethod
    def default_for(cls, max_positions: int) -> GraphPlan:
        """The device ladder up to the model's own positions (its largest context the top rung)."""
        rungs = tuple(s for s in DEVICE_LADDER if s < max_positions) + (min(DEVICE_LADDER[-1], max_positions),)
        prompt_len = min(DEVICE_PROMPT_LEN, rungs[0] // 2)
        return cls(contexts=tuple(sorted(set(rungs)))[-MAX_RUNGS:], prompt_len=prompt_len,
                   token_len=min(DEVICE_TOKEN_LEN, prompt_len - 1))

    @classmethod
    def of_options(cls, options: ExportOptions) -> GraphPlan:
        """Every shape options name: decode graphs, and its verify lengths as graphs of their own."""
        return cls(contexts=tuple(options.contexts), prompt_len=options.prefill_len, token_len=1,
                   batch_sizes=tuple(options.batch_sizes), extra_verify_lens=tuple(options.verify_lens))

    @property
    def verify_lens(self) -> tuple[int, ...]:
        return tuple(sorted({*self.extra_verify_lens, *((self.token_len,) if self.token_len > 1 else ())}))

    def float_options(self) -> ExportOptions:
        """The float family the HTP export calibrates with: the plan's graphs plus decode graphs (the traces record
        decode steps on them; the plan keeps them only when its token graph is one)."""
        return ExportOptions(contexts=self.contexts, prefill_len=self.prompt_len, verify_lens=self.verify_lens,
                             batch_sizes=self.batch_sizes)

    def keeps(self, entry: GraphEntry) -> bool:
        """Whether the family keeps a graph of the float family (the sink and segmented graphs are the plan's own)."""
        return entry.kind is not GraphKind.DECODE or self.token_len == 1 or entry.shape.batch > 1

    def num_graphs(self, *, num_segment_graphs: int = 0) -> int:
        """Graphs a context holds: per rung the prompt graph, the token graph and further verify graphs, the sink."""
        per_rung = 1 + (self.token_len == 1) + len(self.verify_lens)
        return len(self.contexts) * per_rung + 1 + num_segment_graphs

    def check(self, *, num_segment_graphs: int = 0) -> None:
        """A plan over QNN's limits is refused before anything is exported."""
        if len(self.contexts) > MAX_RUNGS:
            raise InvalidOption(f"an HTP family takes at most {MAX_RUNGS} context rungs, got {len(self.contexts)} "
                                f"({', '.join(map(str, self.contexts))})")
        n = self.num_graphs(num_segment_graphs=num_segment_graphs)
        if n > MAX_GRAPHS_PER_CONTEXT:
            raise InvalidOption(f"the plan puts {n} graphs in a context, over QNN's {MAX_GRAPHS_PER_CONTEXT}: give "
                                f"fewer --context rungs, --verify-lens or --batch-sizes")

    def describe(self, *, num_segment_graphs: int = 0) -> str:
        token = "a decode graph" if self.token_len == 1 else f"a {self.token_len}-row verify graph that decodes"
        extra = f", verify {','.join(map(str, self.extra_verify_lens))}" if self.extra_verify_lens else ""
        segments = f", {num_segment_graphs} segmented" if num_segment_graphs else ""
        return (f"{self.num_graphs(num_segment_graphs=num_segment_graphs)} graphs a context: per rung of "
                f"{'/'.join(map(str, self.contexts))} a {self.prompt_len}-row prompt graph and {token}{extra}, "
                f"the sink{segments}")

    def with_options(self, **given) -> GraphPlan:
        """The plan with what the user gave (None: left to the plan)."""
        return dataclasses.replace(self, **{k: v for k, v in given.items() if v is not None})
