"""The generation loop's bookkeeping, property-tested apart from any model: the row scheduler, the order admitted
prompts are prefilled in, and the prompt cache (runtime/generate/scheduler.py, prompt_cache.py), each against a
naive model of what it promises."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from staticlm.runtime.generate.prompt_cache import PromptCache, common_prefix
from staticlm.runtime.generate.scheduler import QueueFull, RowScheduler, next_prefill

NUM_ROWS = 4
ops = st.lists(st.tuples(st.sampled_from(["submit", "admit", "release", "drop"]), st.integers(1, NUM_ROWS)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, max_queue=st.integers(0, 3))
def test_scheduler_admits_in_order_never_over_allocates_and_bounds_its_queue(ops, max_queue):
    s = RowScheduler(num_rows=NUM_ROWS, max_queue=max_queue)
    submitted: list[str] = []  # in order, every request the scheduler took
    admitted: list[str] = []
    holding: dict[int, str] = {}  # row -> request
    for i, (op, n) in enumerate(ops):
        if op == "submit":
            name = f"r{i}:{n}"
            try:
                s.submit(name, num_rows=n)
                submitted.append(name)
            except QueueFull:
                assert s.num_waiting >= max_queue  # it refused only when max_queue requests already wait
        elif op == "admit":
            for request, num_rows in s.admissible():
                admitted.append(request)
                free = s.free_rows()
                assert len(free) >= num_rows  # the rows it promised are there
                for row in free[:num_rows]:
                    s.occupy(row, request)
                    holding[row] = request
        elif op == "release" and holding:
            row = sorted(holding)[n % len(holding)]
            s.release(row)
            del holding[row]
        elif op == "drop" and s.num_waiting:
            assert s.drop_waiting(s.waiting()[-1])
            submitted.pop(len(admitted) + s.num_waiting)  # the newest waiting request leaves the order
        assert s.num_busy == len(holding) <= NUM_ROWS
        assert sorted(s.busy_rows()) == sorted(holding)
        assert admitted == submitted[:len(admitted)]  # oldest first, nobody jumps the queue
        assert s.waiting() == submitted[len(admitted):]
        assert s.head() == next(iter(submitted[len(admitted):]), None)  # the next one admitted


# (op, size): "admit" a prompt of that many tokens to prefill, "prefill" one chunk of that many tokens
prefill_ops = st.lists(st.tuples(st.sampled_from(["admit", "prefill"]), st.integers(1, 40)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(ops=prefill_ops, max_overtaken=st.integers(0, 4), can_switch=st.booleans())
def test_prefill_order_takes_the_shortest_switches_only_when_it_may_and_bounds_each_prompts_wait(
        ops, max_overtaken, can_switch):
    pending: list[dict] = []  # admitted prompts, oldest first, as admission.py keeps them
    for i, (op, n) in enumerate(ops):
        if op == "admit":
            pending.append({"name": i, "left": n, "overtaken": 0})
            continue
        if not pending:
            continue
        started = next((j for j, p in enumerate(pending) if p.get("started")), None)
        j = next_prefill([p["left"] for p in pending], num_overtaken=[p["overtaken"] for p in pending],
                         max_overtaken=max_overtaken, started=started, can_switch=can_switch)
        # the naive model: the oldest one overtaken enough, else the shortest, oldest first; the started one
        # instead, unless it may be set aside and the other is due or strictly shorter than its rest
        due = [k for k, p in enumerate(pending) if p["overtaken"] >= max_overtaken]
        best = due[0] if due else sorted(range(len(pending)), key=lambda k: (pending[k]["left"], k))[0]
        switch = can_switch and (due or pending[best]["left"] < pending[started]["left"]) if started is not None \
            else True
        assert j == (best if switch else started)
        if not can_switch and started is not None:
            assert j == started  # a prompt the lane cannot set aside runs to its end
        chosen = pending[j]
        if j != started:
            for older in pending[:j]:
                older["overtaken"] += 1
            if started is not None:
                pending[started]["started"] = False  # set aside, its rest kept
        chosen["started"] = True
        chosen["left"] -= min(n, chosen["left"])
        if not chosen["left"]:
            pending.remove(chosen)
        # a long prompt's wait is bounded: at most max_overtaken later prompts go before it
        assert all(p["overtaken"] <= max_overtaken for p in pending)


cached = st.lists(st.lists(st.integers(0, 3), max_size=6), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(rows=cached, prompt=st.lists(st.integers(0, 3), max_size=8), data=st.data())
def test_prompt_cache_finds_the_longest_prefix_and_picks_victims_by_repetition_emptiness_and_age(rows, prompt, data):
    cache = PromptCache(len(rows))
    order = data.draw(st.permutations(range(len(rows))))
    for row in order:  # stored in this order: the first is the least recently used
        if rows[row]:
            cache.store(row, rows[row])
    for row in data.draw(st.lists(st.sampled_from(range(len(rows))), max_size=3)):
        cache.touch(row)  # a row whose prefix served a prompt becomes the most recently used
        order = [r for r in order if r != row] + [row]
    candidates = data.draw(st.lists(st.sampled_from(range(len(rows))), unique=True))
    best_row, best = cache.longest(prompt, rows=candidates)
    want = max((common_prefix(rows[r], prompt) for r in candidates), default=0)
    assert best == want and (best == 0) == (best_row is None)
    if best_row is not None:
        assert common_prefix(rows[best_row], prompt) == best
    num = data.draw(st.integers(0, len(candidates)))
    victims = cache.victims(num, free=candidates, prompt=prompt)
    assert len(victims) == len(set(victims)) == num and set(victims) <= set(candidates)

    # The naive model: a row the prompt repeats (at least half its tokens start the prompt) is overwritten first,
    # the most shared first; then empty rows; then cached ones, the least recently used first
    def rank(r: int) -> tuple[int, int, int]:
        shared = common_prefix(rows[r], prompt)
        if rows[r] and 2 * shared >= len(rows[r]):
            return 0, -shared, 0
        return (1, 0, 0) if not rows[r] else (2, 0, order.index(r))
    ranks = sorted(rank(r) for r in candidates)
    assert [rank(r) for r in victims] == ranks[:num]  # a victim never ranks after a row that was spared
