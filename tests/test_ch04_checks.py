"""Chapter 04's checks (minserve.lab.kv_checks) pass on the engine and fail where the property is gone.

Each check runs against the real engine (minserve-tiny, tiny configurations), then against an engine with
the property taken away (prefix caching off, a block reserved ahead, most-recently-freed reuse, a seat too
few) or against deliberately broken numbers, and must fail there. Steps and tokens only, never a speed.
"""

from __future__ import annotations

import pytest

from minserve import LLM, SamplingParams
from minserve.engine.block_manager import BlockManager, NoFreeBlocksError
from minserve.lab import kv_checks, kv_experiments

SYSTEM = "# You review Python code.\n# Rules: be brief, quote the line, prefer the standard library.\n\nimport os\n"
QUESTIONS = ["def save(path):", "class Cache:", "def main(argv):", "for name in names:"]
SHORT = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _llm(**options) -> LLM:
    return LLM(device="cpu", num_threads=1, **options)  # one thread: a shared CPU's other threads are busy


# --- paging -----------------------------------------------------------------------------------------------------


def _paging_usage(llm: LLM):
    prompts = ["def fibonacci(n):", "class Stack:\n", "with open(name) as f:", "def __repr__(self):"]
    return kv_experiments.sample_kv_usage(llm, prompts, [_greedy(n) for n in (8, 40, 20, 3)])


@pytest.fixture(scope="module")
def paging():
    return _paging_usage(_llm(block_size=16, max_num_seqs=4, num_kv_blocks=64))


def test_paging_check_holds_on_the_engine(paging):
    usage, outputs = paging
    result = kv_checks.check_paging(usage, block_size=16, max_model_len=512)
    assert len(outputs) == 4 and result["max_waste_slots"] < 16 * 4
    assert kv_checks.predicted_used_blocks(usage, 16).tolist() == usage["used_blocks"].tolist()


def test_paging_check_fails_when_the_engine_reserves_a_block_ahead(monkeypatch):
    blocks_needed = BlockManager.blocks_needed
    monkeypatch.setattr(
        BlockManager, "blocks_needed", lambda self, seq, n: blocks_needed(self, seq, n + self.block_size)
    )
    usage, _ = _paging_usage(_llm(block_size=16, max_num_seqs=4, num_kv_blocks=64))
    with pytest.raises(AssertionError, match="steps hold other than"):
        kv_checks.check_paging(usage, block_size=16, max_model_len=512)


def test_paging_check_fails_on_a_leaked_or_extra_block(paging):
    usage, _ = paging
    extra = usage.copy()
    extra.loc[3, "used_blocks"] += 1
    with pytest.raises(AssertionError, match="steps hold other than"):
        kv_checks.check_paging(extra, 16, 512)
    leaked = usage.copy()
    leaked.loc[leaked.index[-1], "used_blocks"] = 1
    with pytest.raises(AssertionError):
        kv_checks.check_paging(leaked, 16, 512)


def test_paging_check_fails_when_a_reservation_keeps_the_contiguous_share(paging):
    usage, _ = paging
    result = kv_checks.check_paging(usage, block_size=16, max_model_len=512, share_at_most=0.5)
    assert result["paged_share_of_contiguous"] <= 0.5
    # A server that reserved max_model_len slots for each sequence holds the whole contiguous share.
    reserved = usage.copy()
    reserved["used_blocks"] = reserved["running"] * (512 // 16)
    reserved["seq_tokens"] = reserved["running"].map(lambda n: [512] * n)
    with pytest.raises(AssertionError, match="contiguous reservation"):
        kv_checks.check_paging(reserved, block_size=16, max_model_len=512, share_at_most=0.5)


# --- bytes per token ------------------------------------------------------------------------------------------


def test_bytes_per_token_check_holds_on_the_presets_and_fails_on_a_wrong_config():
    from minserve import capacity

    published = {"Llama-2-7B": 524_288, "Llama-3-8B": 131_072, "Llama-3-70B": 327_680}
    computed = {name: capacity.kv_bytes_per_token_preset(name, "bfloat16") for name in published}
    assert kv_checks.check_bytes_per_token(computed, published) == published
    # A formula that forgot grouped-query attention (a KV head per query head) triples Llama-3's bytes.
    without_gqa = computed | {"Llama-3-8B": 131_072 * 4}
    with pytest.raises(AssertionError, match="Llama-3-8B"):
        kv_checks.check_bytes_per_token(without_gqa, published)


def test_pool_bytes_check_holds_on_the_engine_and_fails_on_a_hidden_allocation():
    from minserve import capacity

    llm = _llm(block_size=16, num_kv_blocks=8)
    stats, per_token = llm.stats(), capacity.kv_bytes_per_token(llm.model_config, "float32")
    kv_checks.check_pool_bytes(stats["kv_cache_bytes"], stats["kv_blocks_total"], 16, per_token)
    with pytest.raises(AssertionError, match="allocated"):
        kv_checks.check_pool_bytes(stats["kv_cache_bytes"] + 1, stats["kv_blocks_total"], 16, per_token)


# --- the prefix cache -----------------------------------------------------------------------------------------


def test_predicted_cached_tokens_counts_full_shared_blocks_only():
    shared = list(range(1, 41))  # 40 shared tokens: two full blocks of 16, and 8 over
    prompts = [[*shared, 100], [*shared, 200, 201], list(range(1, 18))]
    assert kv_checks.common_prefix_tokens(prompts) == 17
    assert kv_checks.predicted_cached_tokens(prompts[:2], 16) == [0, 32]
    # The third shares 17 tokens with the others, one full block; its own last token is never cached.
    assert kv_checks.predicted_cached_tokens(prompts, 16) == [0, 16, 16]
    assert kv_checks.predicted_cached_tokens([shared[:16], shared[:16]], 16) == [0, 0]


def _served(enable_prefix_caching: bool):
    llm = _llm(enable_prefix_caching=enable_prefix_caching, max_num_seqs=4, num_kv_blocks=64)
    return kv_experiments.serve_one_by_one(llm, [SYSTEM + q for q in QUESTIONS], SHORT)


@pytest.fixture(scope="module")
def served_with_cache():
    return _served(True)


def test_prefix_cache_check_holds_with_the_cache_on(served_with_cache):
    outputs, hit_rate = served_with_cache
    result = kv_checks.check_prefix_cache(outputs, hit_rate, block_size=16)
    assert result["predicted_hit_rate"] > 0.3 and result["cached_tokens"][0] == 0


def test_prefix_cache_check_fails_with_the_cache_off():
    outputs, hit_rate = _served(False)
    assert hit_rate == 0
    with pytest.raises(AssertionError, match="cached tokens per request"):
        kv_checks.check_prefix_cache(outputs, hit_rate, block_size=16)


def test_prefix_cache_check_fails_on_a_wrong_hit_rate(served_with_cache):
    outputs, hit_rate = served_with_cache
    with pytest.raises(AssertionError, match="hit rate"):
        kv_checks.check_prefix_cache(outputs, hit_rate - 0.05, block_size=16)


def test_cache_changes_only_work_and_fails_when_off_is_not_off_or_answers_change(served_with_cache):
    outputs, hit_rate = served_with_cache
    plain, hit_off = _served(False)
    kv_checks.check_cache_changes_only_work(outputs, plain, hit_rate_off=hit_off)
    with pytest.raises(AssertionError, match="cache off still hit"):  # "off" that still cached
        kv_checks.check_cache_changes_only_work(outputs, outputs, hit_rate_off=hit_rate)
    swapped = [plain[1], plain[0], *plain[2:]]  # a cache that served one request another's answer
    with pytest.raises(AssertionError, match="answers differ"):
        kv_checks.check_cache_changes_only_work(outputs, swapped, hit_rate_off=0.0)


# --- eviction -------------------------------------------------------------------------------------------------

POOL = 16


def _eviction(llm: LLM):
    sweep = kv_experiments.eviction_sweep(llm, SYSTEM, filler_requests=[0, 2, 4, 6, 7, 8, 10], filler_prompt_tokens=32)
    return sweep, len(llm.tokenizer.encode(SYSTEM))


def test_eviction_check_holds_on_the_engine():
    sweep, prompt_tokens = _eviction(_llm(num_kv_blocks=POOL, block_size=16, max_num_seqs=8))
    assert sweep["filler_blocks"].tolist() == [0, 4, 8, 12, 14, 16, 20]
    result = kv_checks.check_eviction(sweep, POOL, prompt_tokens, 16)
    assert result["hit_rate_fresh"] > 0 and result["hit_rate_cycled"] == 0


def test_eviction_check_fails_with_the_cache_off():
    sweep, prompt_tokens = _eviction(
        _llm(num_kv_blocks=POOL, block_size=16, max_num_seqs=8, enable_prefix_caching=False)
    )
    with pytest.raises(AssertionError, match="cached tokens per ask"):
        kv_checks.check_eviction(sweep, POOL, prompt_tokens, 16)


def test_eviction_check_fails_when_the_most_recently_freed_block_is_reused_first(monkeypatch):
    def allocate_most_recent(self, seq, num_new_tokens):  # the LRU allocator with the queue's other end
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {needed} blocks, {self.num_free_blocks} free")
        for _ in range(needed):
            block_id = next(reversed(self.free_queue))
            self._forget_name(self.blocks[block_id])
            self._take(block_id)
            seq.block_table.append(block_id)

    monkeypatch.setattr(BlockManager, "allocate", allocate_most_recent)
    sweep, prompt_tokens = _eviction(_llm(num_kv_blocks=POOL, block_size=16, max_num_seqs=8))
    with pytest.raises(AssertionError, match="cached tokens per ask"):
        kv_checks.check_eviction(sweep, POOL, prompt_tokens, 16)


def test_predicted_eviction_is_lru_arithmetic():
    # A 50-token prompt shares ⌊49 / 16⌋ = 3 blocks; in a pool of 10 they go after 8, 9, 10 blocks of traffic.
    assert kv_checks.predicted_eviction([0, 7, 8, 9, 10, 30], 10, 50, 16) == [48, 48, 32, 16, 0, 0]


# --- admission control ----------------------------------------------------------------------------------------


def _pressure(max_num_seqs: int):
    llm = _llm(num_kv_blocks=8, block_size=16, max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
              enable_prefix_caching=False)  # fmt: skip
    prompts = [f"# handler {i}\ndef handler(request, response):\n    return dispatch(request)\n" for i in range(5)]
    return kv_experiments.sample_kv_usage(llm, prompts, _greedy(12))


def test_admission_check_holds_on_the_engine():
    usage, outputs = _pressure(max_num_seqs=8)
    result = kv_checks.check_admission(usage, outputs, pool_blocks=8, block_size=16, max_num_seqs=8, max_tokens=12)
    assert result["predicted_admitted"] == result["measured_admitted"] < 5


def test_admission_check_fails_with_a_seat_too_few():
    usage, outputs = _pressure(max_num_seqs=1)
    with pytest.raises(AssertionError, match="first step"):
        kv_checks.check_admission(usage, outputs, pool_blocks=8, block_size=16, max_num_seqs=8, max_tokens=12)


def test_predicted_admitted_stops_at_the_first_that_does_not_fit():
    # Blocks of 16: 2 + 3 + 1 = 6 fit in 6, the fourth finds none free.
    assert kv_checks.predicted_admitted([20, 40, 5, 5], free_blocks=6, block_size=16, max_num_seqs=8) == 3
    # In 4: the first (2 blocks) fits, the second (3) does not, and the third (1) waits behind it (FCFS).
    assert kv_checks.predicted_admitted([20, 40, 5], free_blocks=4, block_size=16, max_num_seqs=8) == 1
    assert kv_checks.predicted_admitted([20, 40, 5, 5], free_blocks=100, block_size=16, max_num_seqs=2) == 2
    assert kv_checks.predicted_full_length_concurrency(56, pool_blocks=16, block_size=16) == 4
