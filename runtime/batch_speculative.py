"""Speculative decoding for several sequences at once (BASS-PAD, ragged acceptance).

Every active sequence drafts on its own; the drafts are padded to one length and verified in a single
batched AR=N call, each sequence over its own KV window with its own mask. Each sequence then accepts
its own number of tokens and commits exactly those rows (`advance` per sequence): the rejected rows and
the padding rows stay where the model wrote them and are overwritten by the next step, never copied.
The draft length follows BASS's Algorithm 1 on the batch's best acceptance, as the paper does.
"""
from __future__ import annotations

import numpy as np

from .sampling import SamplingParams
from .speculative import Drafter, DraftLength, SpeculationStats, accept_draft, fit_to_verify_graphs, speculation_pays

PAD_TOKEN = 0  # fills the rows past a sequence's own draft; causal masking keeps real rows from seeing them


class BatchSpeculator:
    def __init__(self, drafters: list[Drafter], *, length: DraftLength | None = None, probe_every: int = 8) -> None:
        self.drafters = drafters  # one per sequence: a draft model keeps per-sequence state
        self.length = length or DraftLength()
        self.stats = SpeculationStats()
        self.probe_every = probe_every
        self._acceptance = 0.6  # optimistic prior, so speculation gets tried (see Speculator)
        self._num_skipped = 0

    def step(self, engine, last: np.ndarray, *, active: np.ndarray, contexts: list[list[int]],
             params: SamplingParams, rng: np.random.Generator) -> list[list[int]] | None:
        """One batched draft-and-verify step; per sequence the new tokens (accepted drafts, then the next
        pending token), or None to decode plainly this step.

        last [B]: each sequence's pending token (sampled, not yet in the cache); contexts[b] ends with it.
        """
        if not engine.verify_lens:
            return None
        seqs = np.flatnonzero(active).tolist()
        max_draft = fit_to_verify_graphs(self.length.current, engine.verify_lens)
        drafts: dict[int, list[int]] = {}
        proposals: dict[int, list[np.ndarray] | None] = {}
        for b in seqs:
            drafts[b], proposals[b] = self.drafters[b].propose(contexts[b], max_draft, params=params, rng=rng)
        longest = max((len(d) for d in drafts.values()), default=0)
        while longest and engine.verify_len(longest + 1) is None:
            longest -= 1  # near the end of the ladder a shorter verify graph may still fit
        if not longest:
            return None
        if not speculation_pays(engine.verify_cost_ratio(engine.verify_len(longest + 1)),
                                acceptance=self._acceptance, num_draft=longest):
            self._num_skipped += 1
            if self._num_skipped % self.probe_every:
                return None
        ids = np.full((engine.batch, longest + 1), PAD_TOKEN, np.int64)  # [B, n]
        ids[:, 0] = last
        num_real = np.zeros(engine.batch, np.int64)
        for b in seqs:
            drafts[b] = drafts[b][:longest]
            ids[b, 1:1 + len(drafts[b])] = drafts[b]
            num_real[b] = 1 + len(drafts[b])
        logits = engine.verify(ids, num_real=num_real)  # [B, n, V]
        commits = np.zeros(engine.batch, np.int64)
        out: list[list[int]] = [[] for _ in range(engine.batch)]
        best = longest_full = 0  # BASS grows the length when some sequence accepted its whole draft
        for b in seqs:
            draft = drafts[b]
            q = proposals[b][:len(draft)] if proposals[b] is not None else None
            accepted, nxt = accept_draft(logits[b], draft, q, params=params, context=contexts[b], rng=rng)
            commits[b] = 1 + len(accepted)
            out[b] = [*accepted, nxt]
            best = max(best, len(accepted))
            if len(accepted) == len(draft):
                longest_full = max(longest_full, len(draft))
            self.stats.num_drafted += len(draft)
            self.stats.num_accepted += len(accepted)
        engine.commit(commits)
        self.stats.num_steps += 1
        self.length.update(best, longest_full if longest_full else None)
        num_drafted = sum(len(drafts[b]) for b in seqs)
        if num_drafted:
            self._acceptance = 0.8 * self._acceptance + 0.2 * sum(int(c) - 1 for c in commits) / num_drafted
        return out
