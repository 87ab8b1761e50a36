"""Expert parallelism over gloo: two ranks, each holding half the experts, tokens sent to them by all-to-all,
give one process's logits and greedy tokens; every routed (token, expert) pair is run once, on one rank; the
all-to-all bytes counted are those of the pairs that crossed between ranks. The other way to split a mixture
of experts across ranks, a slice of every expert (plain tensor parallelism), gives the same logits."""

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minserve import LLM, SamplingParams
from minserve.model.loader import load_config, load_model
from minserve.parallel import Communicator, check_tensor_parallel, load_per_rank, pairs_between_ranks, shard_model
from tests.checkpoints import build_hf_model, save_checkpoint
from tests.parallel_ranks import join_group

WORLD_SIZE = 2
PROMPTS = [[5, 17, 300, 42, 1024, 7, 99], [1500, 3, 250, 60, 61, 62, 900, 11, 12], [8, 9, 10]]
# Different lengths: the last steps decode one sequence alone, so rank 1's share of the tokens is empty.
PARAMS = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (5, 9, 16)]
OPTIONS = {"dtype": "float32", "enable_tracing": False, "enable_prefix_caching": False}
TOKEN_LISTS = [[5, 17, 300, 42, 1024, 7, 99, 1500, 3, 250, 60, 61, 62], [42]]  # shares of 7 and 6; of 1 and 0


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return save_checkpoint(build_hf_model("mixtral"), tmp_path_factory.mktemp("mixtral"))


@pytest.fixture(scope="module")
def engine_run(mixtral):
    """One process's greedy tokens and expert load, then the same requests on two expert-parallel ranks."""
    one = LLM(str(mixtral), **OPTIONS)
    expected = [o.token_ids for o in one.generate(PROMPTS, PARAMS)]
    one_process_load = one.model.expert_load()
    llm = LLM(str(mixtral), tensor_parallel_size=WORLD_SIZE, enable_expert_parallel=True, **OPTIONS)
    try:
        outs = llm.generate(PROMPTS, PARAMS)
        model = llm.engine.model
        return {
            "expected": expected,
            "tokens": [o.token_ids for o in outs],
            # every token goes through the model once, but the last one sampled (it is not fed back)
            "forwarded": sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs),
            "one_process_load": one_process_load,
            "load": model.expert_load(),
            "load_per_rank": load_per_rank(model),
            "pairs": pairs_between_ranks(model),
            "experts_here": [len(moe.experts) for moe in model.moe_blocks()],
            "traffic": dataclasses.replace(llm.engine.parallel.comm.traffic),
            "config": model.config,
        }
    finally:
        llm.engine.shutdown()


def test_two_expert_parallel_ranks_give_one_process_greedy_tokens(engine_run):
    assert engine_run["tokens"] == engine_run["expected"]
    assert engine_run["experts_here"] == [2, 2]  # rank 0 holds experts 0 and 1 of 4, in each sparse layer


def test_every_routed_pair_runs_once_on_one_rank(engine_run):
    config = engine_run["config"]
    per_rank = engine_run["load_per_rank"]  # [moe layers, ranks]
    assert per_rank.shape == (len(config.moe_layers), WORLD_SIZE)
    assert (per_rank.sum(dim=1) == engine_run["forwarded"] * config.num_experts_per_tok).all()
    assert torch.equal(engine_run["load"], engine_run["one_process_load"])  # each expert got the same tokens
    assert engine_run["pairs"].sum() == per_rank.sum()


def test_rank_0_counts_the_bytes_of_the_pairs_that_crossed_to_or_from_it(engine_run):
    pairs, hidden = engine_run["pairs"], engine_run["config"].hidden_size
    sent, received = pairs[0, 1:].sum(), pairs[1:, 0].sum()  # dispatched away; and answered for the others
    assert sent > 0 and received > 0
    assert engine_run["traffic"].all_to_all_bytes == (sent + received) * hidden * 4  # float32 rows


def test_expert_parallelism_is_refused_where_it_cannot_split_the_experts(mixtral):
    with pytest.raises(ValueError, match="this llama model is dense.*drop enable_expert_parallel"):
        LLM("minserve-tiny", tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="set tensor_parallel_size > 1"):
        LLM(str(mixtral), enable_expert_parallel=True)
    three_experts = dataclasses.replace(load_config(mixtral), num_experts=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide.*3 experts; sizes that work: 1$"):
        check_tensor_parallel(three_experts, 2, expert_parallel=True)
    check_tensor_parallel(three_experts, 2)  # sliced experts need only their width to divide


# --- the layers on their own, both ways of splitting the experts ----------------------------------------------


def shard_logits(rank: int, world_size: int, init_file: str, directory: str, results: dict) -> None:
    """Rank ``rank``'s logits of each of ``TOKEN_LISTS`` through an expert-parallel and a tensor-parallel shard."""
    join_group(rank, world_size, init_file)
    try:
        record = {}
        for expert_parallel in (True, False):
            model = load_model(Path(directory))
            comm = Communicator(rank, world_size)
            shard_model(model, comm, expert_parallel=expert_parallel)
            logits = [model.logits_without_cache(torch.tensor(ids)) for ids in TOKEN_LISTS]
            record[expert_parallel] = {"logits": logits, "traffic": comm.traffic}
            if expert_parallel:
                record["pairs"] = pairs_between_ranks(model)
        results[rank] = record
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Qwen3-MoE with a dense first layer: under both splits its MLP is split as tensor parallelism splits it."""
    return save_checkpoint(build_hf_model("qwen3-moe-dense-first"), tmp_path_factory.mktemp("mixed"))


def test_both_splits_of_the_experts_give_one_process_logits(mixed, tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(shard_logits, args=(WORLD_SIZE, str(tmp_path / "rendezvous"), str(mixed), results),
                 nprocs=WORLD_SIZE)  # fmt: skip
        results = dict(results)
    one_process = load_model(mixed)
    hidden = one_process.config.hidden_size
    for ids, *per_rank in zip(TOKEN_LISTS, *(results[r][True]["logits"] for r in range(WORLD_SIZE))):
        expected = one_process.logits_without_cache(torch.tensor(ids))
        for logits in per_rank:
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    for rank in range(WORLD_SIZE):
        for i, ids in enumerate(TOKEN_LISTS):
            expected = one_process.logits_without_cache(torch.tensor(ids))
            torch.testing.assert_close(results[rank][False]["logits"][i], expected, rtol=1e-5, atol=1e-5)
        pairs = results[rank]["pairs"]
        assert torch.equal(pairs, results[0]["pairs"])  # every rank knows the whole plan
        crossed = pairs[rank].sum() - pairs[rank, rank] + pairs[:, rank].sum() - pairs[rank, rank]
        assert results[rank][True]["traffic"].all_to_all_bytes == crossed * hidden * 4
        assert results[rank][False]["traffic"].all_to_all_calls == 0  # sliced experts: all-reduce only
