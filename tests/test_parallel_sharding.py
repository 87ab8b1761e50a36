"""Tensor parallelism's layers (minserve.parallel): two ranks over gloo give one process's logits, and the
bytes they all-reduce are the formula's."""

import pytest
import torch
import torch.multiprocessing as mp

from minserve.model.config import ModelConfig
from minserve.model.loader import load_config, load_model, resolve_model_path
from minserve.parallel import check_tensor_parallel
from tests.parallel_ranks import sharded_logits

TOKENS = [1, 5, 9, 42, 7, 300, 2000, 1023, 1024, 17, 3, 3]  # both halves of the vocabulary


def _run_ranks(world_size, tmp_path, quantization=None):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(sharded_logits, args=(world_size, str(tmp_path / "rendezvous"), TOKENS, quantization, results),
                 nprocs=world_size)  # fmt: skip
        return dict(results)


@pytest.fixture(scope="module")
def one_process():
    model = load_model(resolve_model_path("minserve-tiny"), torch.float32, torch.device("cpu"))
    return model.logits_without_cache(torch.tensor(TOKENS))


def _config() -> ModelConfig:
    return load_config(resolve_model_path("minserve-tiny"))


def test_two_ranks_give_one_process_logits_and_the_formulas_bytes(tmp_path, one_process):
    results = _run_ranks(2, tmp_path)
    for rank in (0, 1):
        torch.testing.assert_close(results[rank]["logits"], one_process, rtol=1e-5, atol=1e-5)
    config, tokens = _config(), len(TOKENS)
    traffic = results[0]["traffic"]
    # two all-reduces a layer of [tokens, hidden] float32, and one after the embedding lookup
    assert traffic.all_reduce_bytes == (2 * config.num_layers + 1) * tokens * config.hidden_size * 4
    assert traffic.all_reduce_calls == 2 * config.num_layers + 1
    assert traffic.all_gather_bytes == tokens * (config.vocab_size // 2) * 4  # each rank's half of the logits


def test_quantized_shards_keep_their_collectives(tmp_path, one_process):
    results = _run_ranks(2, tmp_path, quantization="int8")
    assert results[0]["traffic"].all_reduce_calls == 2 * _config().num_layers + 1  # the hooks survived the swap
    agree = (results[0]["logits"].argmax(-1) == one_process.argmax(-1)).float().mean()
    assert agree >= 0.9


def test_a_size_that_does_not_divide_the_heads_names_the_sizes_that_do():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide .* sizes that work: 1, 2"):
        check_tensor_parallel(_config(), 3)
