"""Speculative decoding for several sequences at once (BASS-PAD, ragged acceptance).

Every active sequence drafts on its own; the drafts are padded to one length and verified in a single
batched AR=N call, each sequence over its own KV window with its own mask. Each sequence then accepts
its own number of tokens and commits exactly those rows (`advance` per sequence): the rejected rows and
the padding rows stay where the model wrote them and are overwritten by the next step, never copied.
Whether a step pays and how long drafts are: SpeculationPolicy, the same one a single sequence uses.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from staticlm.runtime.engine.batch_engine import BatchEngine
from staticlm.runtime.generate.sampling import SamplingParams
from staticlm.runtime.speculative.speculation_policy import DraftLength, SpeculationPolicy
from staticlm.runtime.speculative.speculative import Drafter, SpeculationStats, accept_draft


def verify_rows(last: np.ndarray, drafts: dict[int, list[int]], *, num_draft: int) -> np.ndarray:
    """[B, num_draft + 1] ids: each sequence's pending token, its draft, then its last real token repeated.

    Causal masking keeps a sequence's real rows from seeing its padding rows, so any id would do for the
    logits that count; but never id 0, for the reason runtime/engine/engine.py's `_run` pads with the last real token
    (id 0 carries massive activations in SmolLM2, and quantized activation ranges must see what runs).
    Sequences without an entry in drafts (finished ones) repeat their pending token.
    """
    ids = np.repeat(last.astype(np.int64)[:, None], num_draft + 1, axis=1)
    for b, draft in drafts.items():
        ids[b, 1:1 + len(draft)] = draft
        ids[b, 1 + len(draft):] = ids[b, len(draft)]
    return ids


class BatchSpeculator:
    def __init__(self, drafters: list[Drafter], *, length: DraftLength | None = None, probe_every: int = 8) -> None:
        self.drafters = drafters  # one per sequence: a draft model keeps per-sequence state
        self.policy = SpeculationPolicy(length=length, probe_every=probe_every)
        self.stats = SpeculationStats()

    def step(self, engine: BatchEngine, last: np.ndarray, *, active: np.ndarray, contexts: list[list[int]],
             params: Sequence[SamplingParams | None], rngs: Sequence[np.random.Generator | None]
             ) -> list[list[int]] | None:
        """One batched draft-and-verify step; per sequence the new tokens (accepted drafts, then the next
        pending token), or None to decode plainly this step.

        last [B]: each sequence's pending token (sampled, not yet in the cache); contexts[b] ends with it.
        params[b], rngs[b]: each active sequence's own sampling (None for the idle rows).
        """
        if not engine.verify_lens:
            return None
        seqs = np.flatnonzero(active).tolist()
        num_asked = self.policy.draft_length(engine)
        drafts: dict[int, list[int]] = {}
        proposals: dict[int, list[np.ndarray] | None] = {}
        for b in seqs:
            drafts[b], proposals[b] = self.drafters[b].propose(contexts[b], num_asked, params=params[b], rng=rngs[b])
        longest = max((len(d) for d in drafts.values()), default=0)
        while longest and engine.verify_len(longest + 1) is None:
            longest -= 1  # near the end of the ladder a shorter verify graph may still fit
        if not longest or not self.policy.should_verify(engine, longest):
            return None
        for b in seqs:
            drafts[b] = drafts[b][:longest]
        num_real = np.zeros(engine.batch, np.int64)
        num_real[seqs] = [1 + len(drafts[b]) for b in seqs]
        logits = engine.verify(verify_rows(last, drafts, num_draft=longest), num_real=num_real)  # [B, n, V]
        commits = np.zeros(engine.batch, np.int64)
        out: list[list[int]] = [[] for _ in range(engine.batch)]
        for b in seqs:
            draft = drafts[b]
            q = proposals[b][:len(draft)] if proposals[b] is not None else None
            accepted, nxt = accept_draft(logits[b], draft, q, params=params[b], context=contexts[b], rng=rngs[b])
            commits[b] = 1 + len(accepted)
            out[b] = [*accepted, nxt]
        engine.commit(commits)
        num_drafted = [len(drafts[b]) for b in seqs]
        num_accepted = [int(commits[b]) - 1 for b in seqs]
        self.policy.record(num_drafted, num_accepted)  # every sequence's outcome (SpeculationPolicy.record says why)
        self.stats.num_steps += 1
        self.stats.num_drafted += sum(num_drafted)
        self.stats.num_accepted += sum(num_accepted)
        return out
