"""Block accounting under random workloads: the real scheduler and block manager, a stand-in for the model.

Hypothesis drives random mixes of arrivals, steps, finishes, cancellations and memory pressure (forcing
preemption); after every step no block may be leaked, double-owned or lost from the free queue.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minserve.engine.block_manager import BlockManager
from minserve.engine.scheduler import Scheduler
from minserve.engine.sequence import Sequence
from tests import stand_in


def _sequence(i: int, prompt: list[int], max_tokens: int) -> Sequence:
    return stand_in.make_sequence(i, prompt, max_tokens)


def _step(scheduler: Scheduler, block_manager: BlockManager, next_token: int) -> list[Sequence]:
    return stand_in.step(scheduler, next_token)[1]


requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, 3), min_size=1, max_size=40),  # few distinct tokens: many shared prefixes
        st.integers(1, 12),
    ),
    min_size=1,
    max_size=12,
)
actions = st.lists(st.sampled_from(["step", "step", "step", "cancel"]), min_size=1, max_size=120)


@settings(max_examples=150, deadline=None)
@given(
    requests=requests,
    actions=actions,
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 64),
    prefix_caching=st.booleans(),
    num_cpu_blocks=st.sampled_from([0, 3, 40]),  # no swapping, host memory that fills up, plenty
    policy=st.sampled_from(["fcfs", "priority", "spf", "static"]),
)
def test_no_block_is_leaked_or_double_owned(
    requests, actions, num_blocks, block_size, budget, prefix_caching, num_cpu_blocks, policy
):
    block_manager = BlockManager(num_blocks, block_size, prefix_caching, num_cpu_blocks)
    mode = "swap" if num_cpu_blocks else "recompute"
    scheduler = Scheduler(block_manager, 8, budget, policy=policy, preemption_mode=mode)
    capacity_tokens = num_blocks * block_size
    live = []
    for i, (prompt, max_tokens) in enumerate(requests):
        if len(prompt) + max_tokens <= capacity_tokens:  # what the engine's check_fits guarantees
            seq = _sequence(i, prompt, max_tokens)
            scheduler.add(seq)
            live.append(seq)
    for step, action in enumerate(actions):
        if action == "cancel" and live:
            victim = live[step % len(live)]
            scheduler.finish(victim)
            live.remove(victim)
        else:
            for seq in _step(scheduler, block_manager, next_token=step % 4):
                live.remove(seq)
        block_manager.check_invariants(live)
    # Drain: every request that was not cancelled finishes; nothing is stuck.
    for step in range(10_000):
        if not scheduler.has_unfinished():
            break
        for seq in _step(scheduler, block_manager, next_token=step % 4):
            live.remove(seq)
        block_manager.check_invariants(live)
    assert not scheduler.has_unfinished() and not live
    assert block_manager.num_free_blocks == num_blocks  # nothing leaked on the device
    assert len(block_manager.free_cpu_blocks) == num_cpu_blocks  # nor in host memory


def test_shared_prefix_blocks_are_reference_counted_and_survive_release():
    block_manager = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(block_manager, max_num_seqs=4, max_num_batched_tokens=64)
    first = _sequence(0, [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=1)
    scheduler.add(first)
    _step(scheduler, block_manager, next_token=0)  # prefills and finishes: 2 full blocks named, then freed
    assert block_manager.num_free_blocks == 8 and len(block_manager.hash_to_block) == 2
    second, third = _sequence(1, [1, 2, 3, 4, 5, 6, 7, 8, 10], 3), _sequence(2, [1, 2, 3, 4, 0, 0, 0, 0, 1], 3)
    scheduler.add(second)
    scheduler.add(third)
    scheduler.schedule()
    assert second.num_cached_tokens == 8 and third.num_cached_tokens == 4
    shared = second.block_table[0]
    assert third.block_table[0] == shared and block_manager.blocks[shared].ref_count == 2
    block_manager.check_invariants([second, third])


def test_the_last_prompt_token_is_always_computed():
    block_manager = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(block_manager, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add(_sequence(0, [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=1))
    _step(scheduler, block_manager, next_token=0)
    again = _sequence(1, [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=1)
    scheduler.add(again)
    batch = scheduler.schedule()
    assert again.num_cached_tokens == 4  # the block holding the last token is recomputed
    assert batch.num_new_tokens == [4]


def test_least_recently_freed_cached_block_is_evicted_first():
    block_manager = BlockManager(num_blocks=4, block_size=2)
    scheduler = Scheduler(block_manager, max_num_seqs=4, max_num_batched_tokens=64)
    for i, prompt in enumerate(([1, 1, 9], [2, 2, 9])):
        scheduler.add(_sequence(i, prompt, max_tokens=1))
        _step(scheduler, block_manager, next_token=0)
    named_before = set(block_manager.hash_to_block.values())
    assert len(named_before) == 2
    scheduler.add(_sequence(2, [3, 3, 3, 3, 3, 3, 9], max_tokens=1))  # needs all 4 blocks
    _step(scheduler, block_manager, next_token=0)
    assert block_manager.find_cached_prefix([1, 1, 5]) == []  # both old prefixes were evicted
    scheduler.add(_sequence(3, [1, 1, 9], max_tokens=1))
    _step(scheduler, block_manager, next_token=0)
    block_manager.check_invariants([])


def _two_sequences_with_blocks() -> tuple[BlockManager, Sequence, Sequence]:
    """A clean manager: ``a`` holds two named full blocks and a partial one; ``b`` one partial block."""
    block_manager = BlockManager(num_blocks=8, block_size=4)
    a, b = _sequence(0, [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=1), _sequence(1, [7, 7, 7], max_tokens=1)
    for seq in (a, b):
        block_manager.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        block_manager.name_full_blocks(seq)
    block_manager.check_invariants([a, b])
    return block_manager, a, b


def _share(block_manager: BlockManager, seq: Sequence, block_id: int) -> None:
    """Corrupt on purpose: give ``seq`` the block and keep ref_count equal to the number of holders."""
    seq.block_table.append(block_id)
    block_manager.blocks[block_id].ref_count += 1


def test_invariants_catch_an_unnamed_block_owned_by_two_sequences():
    block_manager, a, b = _two_sequences_with_blocks()
    unnamed = a.block_table[2]  # a's partial third block: never named, so never shareable
    assert block_manager.blocks[unnamed].block_hash is None
    fresh = _sequence(2, [5, 5], max_tokens=1)
    _share(block_manager, fresh, unnamed)
    # Every ref_count still equals its number of holders: only the "shared means named" rule sees this.
    with pytest.raises(AssertionError, match="unnamed but shared"):
        block_manager.check_invariants([a, b, fresh])


def test_invariants_catch_a_block_twice_in_one_table():
    block_manager, a, b = _two_sequences_with_blocks()
    _share(block_manager, b, b.block_table[0])
    with pytest.raises(AssertionError, match="appears twice"):
        block_manager.check_invariants([a, b])


def test_invariants_catch_a_named_block_shared_at_another_position():
    block_manager, a, b = _two_sequences_with_blocks()
    _share(block_manager, b, a.block_table[0])  # a's first block as b's second: a different prefix
    with pytest.raises(AssertionError, match="different positions"):
        block_manager.check_invariants([a, b])


@pytest.mark.parametrize("corruption", ["ref_count", "free_queue", "lost_name"])
def test_invariants_catch_broken_counts_and_names(corruption):
    block_manager, a, b = _two_sequences_with_blocks()
    if corruption == "ref_count":
        block_manager.blocks[b.block_table[0]].ref_count += 1  # counted, but nobody holds it
    elif corruption == "free_queue":
        block_manager.free_queue[a.block_table[0]] = None  # held, yet handed out as free
    else:
        del block_manager.hash_to_block[block_manager.blocks[a.block_table[0]].block_hash]
    with pytest.raises(AssertionError):
        block_manager.check_invariants([a, b])
