"""Chapter 06's mixture of experts: a tiny one made from the embedded model, run in one process and with its
experts split over two ranks (expert parallelism), and what the all-to-all carried.

:func:`upcycled_moe_checkpoint` writes a Mixtral-format checkpoint (``MixtralForCausalLM``: every layer's
MLP a mixture of experts, top-k renormalised) from ``minserve-tiny``: attention, norms and embedding as
they are, each layer's MLP copied into every expert with a little multiplicative noise, and a random router
("sparse upcycling", as some MoE models begin). Renormalised top-k weights sum to one, so with no noise the
mixture *is* the MLP and the model writes minserve-tiny's text whatever the router chooses; with noise the
experts differ, and a token sent to the wrong expert or back to the wrong place would change the output.
It needs only torch and safetensors, a second or two.

:func:`run_expert_parallel` runs the same greedy requests in one process and on two expert-parallel ranks.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file, save_file

from minserve.capacity.kv import dtype_bytes
from minserve.engine.llm import LLM
from minserve.engine.sampling_params import SamplingParams
from minserve.lab.parallel_runs import ENGINE_OPTIONS
from minserve.model.config import ModelConfig
from minserve.model.loader import ASSETS_DIR
from minserve.parallel import Traffic, load_per_rank, pairs_between_ranks

BASE_MODEL = "minserve-tiny"
# Mixtral's names for the parts of an MoE layer; the dense model's MLP parts they are copied from.
EXPERT_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def upcycled_moe_checkpoint(
    directory: Path, num_experts: int = 4, top_k: int = 2, noise: float = 0.1, router_std: float = 0.2, seed: int = 0
) -> Path:
    """Write a Mixtral-format checkpoint of ``num_experts`` experts (``top_k`` a token) made from
    minserve-tiny into ``directory`` (see the module docstring); returns ``directory``. ``noise``: each expert
    weight is the MLP's times ``1 + noise × N(0, 1)``; ``router_std``: the router's weights' spread (larger
    gives each token clearer favourites, so rounding differences cannot flip its choice)."""
    source = ASSETS_DIR / BASE_MODEL
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():  # tokenizer, chat template, generation config
        if path.name not in ("config.json", "model.safetensors"):
            shutil.copy(path, directory / path.name)
    config = json.loads((source / "config.json").read_text())
    config |= {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": num_experts,
               "num_experts_per_tok": top_k, "sliding_window": None}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if ".mlp." not in name:
            weights[name] = tensor
            continue
        layer, part = name.split(".mlp.")  # "model.layers.0", "gate_proj.weight"
        for expert in range(num_experts):
            for mixtral, dense in EXPERT_PARTS.items():
                if part == f"{dense}.weight":
                    scale = 1 + noise * torch.randn(tensor.shape, generator=generator)
                    weights[f"{layer}.block_sparse_moe.experts.{expert}.{mixtral}.weight"] = (
                        tensor.float() * scale
                    ).to(tensor.dtype)
        if part == "gate_proj.weight":  # once per layer: the router, hidden → one score per expert
            router = router_std * torch.randn(num_experts, config["hidden_size"], generator=generator)
            weights[f"{layer}.block_sparse_moe.gate.weight"] = router.to(tensor.dtype)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@dataclass
class ExpertParallelRun:
    """The same greedy requests in one process and on ``world_size`` expert-parallel ranks.

    ``load`` / ``one_process_load``: ``[moe layers, experts]`` pairs each expert ran; ``load_per_rank``:
    ``[moe layers, ranks]``; ``pairs``: ``[ranks, ranks]`` pairs each rank dispatched to each (summed over
    layers); ``traffic``: rank 0's collectives; ``forwarded_tokens``: tokens through the model (each
    request's prompt and outputs but the last, which is sampled and never fed back).
    """

    config: ModelConfig
    world_size: int
    token_ids: list[list[int]]
    one_process_token_ids: list[list[int]]
    load: torch.Tensor
    one_process_load: torch.Tensor
    load_per_rank: torch.Tensor
    pairs: torch.Tensor
    traffic: Traffic
    forwarded_tokens: int
    element_bytes: int


def run_expert_parallel(
    model_dir: Path, prompts: Sequence[str], params: SamplingParams, world_size: int = 2
) -> ExpertParallelRun:
    """Greedy ``prompts`` through the mixture of experts in ``model_dir``, in one process and then on
    ``world_size`` ranks with ``enable_expert_parallel`` (prefix caching off, so every token is forwarded)."""
    options = ENGINE_OPTIONS | {"enable_prefix_caching": False}
    one = LLM(str(model_dir), **options)
    expected = [o.token_ids for o in one.generate(list(prompts), params)]
    one_process_load = one.model.expert_load()
    del one
    llm = LLM(str(model_dir), tensor_parallel_size=world_size, enable_expert_parallel=True, **options)
    try:
        outputs = llm.generate(list(prompts), params)
        model = llm.engine.model
        return ExpertParallelRun(
            config=model.config,
            world_size=world_size,
            token_ids=[o.token_ids for o in outputs],
            one_process_token_ids=expected,
            load=model.expert_load(),
            one_process_load=one_process_load,
            load_per_rank=load_per_rank(model),
            pairs=pairs_between_ranks(model),
            traffic=dataclasses.replace(llm.engine.parallel.comm.traffic),
            forwarded_tokens=sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outputs),
            element_bytes=dtype_bytes(str(llm.engine.dtype)),
        )
    finally:
        llm.engine.shutdown()


def balanced_dispatch_bytes(config: ModelConfig, tokens: int, world_size: int, element_bytes: int) -> float:
    """What the dispatch all-to-alls of every sparse layer send over all ranks if routing were balanced:
    ``tokens × top_k × hidden × bytes × (n − 1) / n`` a layer (the combine sends as much back)."""
    per_layer = tokens * config.num_experts_per_tok * config.hidden_size * element_bytes
    return len(config.moe_layers) * per_layer * (world_size - 1) / world_size


def expert_traffic_table(run: ExpertParallelRun) -> pd.DataFrame:
    """The dispatch's bytes: predicted for balanced routing, and measured (rank 0's all-to-all counter, which
    for two ranks holds every pair that crossed: its own sent out, and the others' answered from its experts),
    beside the pairs that crossed and the share of all pairs they are."""
    row_bytes = run.config.hidden_size * run.element_bytes
    pairs = run.pairs
    crossed = int(pairs.sum() - pairs.diagonal().sum())
    return pd.DataFrame(
        {
            "pairs": [int(pairs.sum())] * 2,
            "pairs that crossed": [None, crossed],
            "crossed share": [(run.world_size - 1) / run.world_size, crossed / int(pairs.sum())],
            "dispatch bytes": [
                balanced_dispatch_bytes(run.config, run.forwarded_tokens, run.world_size, run.element_bytes),
                run.traffic.all_to_all_bytes,
            ],
            "bytes per crossing pair": [row_bytes, run.traffic.all_to_all_bytes / crossed if crossed else None],
        },
        index=pd.Index(["balanced routing (predicted)", "this run (measured)"], name="dispatch"),
    )
