"""What each rank of a tensor-parallel test runs, in a process of its own (spawned: importable by name)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def join_group(rank: int, world_size: int, init_file: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip


def sharded_logits(rank: int, world_size: int, init_file: str, token_ids: list[int], quantization: str | None,
                   results: dict) -> None:  # fmt: skip
    """Rank ``rank``'s logits of ``token_ids`` through its shard of minserve-tiny, and what it sent."""
    from minserve.model.loader import load_model, resolve_model_path
    from minserve.parallel import Communicator, shard_model
    from minserve.quant import QuantScheme, quantize_model

    join_group(rank, world_size, init_file)
    try:
        model = load_model(resolve_model_path("minserve-tiny"), torch.float32, torch.device("cpu"))
        comm = Communicator(rank, world_size)
        shard_model(model, comm)
        if quantization:
            quantize_model(model, QuantScheme.named(quantization))
        comm.traffic.reset()
        logits = model.logits_without_cache(torch.tensor(token_ids))
        results[rank] = {"logits": logits, "traffic": comm.traffic}
    finally:
        dist.destroy_process_group()
