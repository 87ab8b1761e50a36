"""Expert parallelism: a mixture-of-experts layer's experts split across ranks, tokens sent to them by all-to-all.

Tensor parallelism cuts every expert into ``n`` slices (:mod:`.sharding`); expert parallelism gives each rank
whole experts, ``num_experts / n`` of them, and moves tokens instead of partial sums. In minserve's engine it
runs inside the tensor-parallel group, as vLLM's ``enable_expert_parallel`` does: attention stays split by
heads, and after attention's all-reduce every rank holds the same ``[tokens, hidden]`` input to the MoE layer.
On rank ``r`` of ``n`` the layer then:

1. takes its share of the tokens, rows ``r·c … (r+1)·c − 1`` with ``c = ceil(tokens / n)``;
2. routes them (the router is replicated): ``top_k`` (token, expert) pairs per token;
3. plans: counts its pairs per expert and all-gathers the counts, so every rank knows the whole plan
   ``[source rank, expert]``: what it will receive from whom and, on rank 0, every rank's load;
4. dispatches: sorts its pairs by expert, which sorts them by the rank holding the expert (rank ``d`` holds
   experts ``d·E/n … (d+1)·E/n − 1``), and sends each rank its pairs' token rows in one all-to-all;
5. runs its experts on the rows that arrived, one batch per expert;
6. combines: the reverse all-to-all brings each output back to the rank that sent the token, which adds a
   token's ``top_k`` outputs with the router's weights;
7. all-gathers the shares, so every rank holds every token again for the next attention.

What it costs: a token goes to ``top_k`` experts, and with balanced routing ``(n − 1) / n`` of them live on
another rank, so the dispatch sends ``tokens × top_k × hidden × bytes × (n − 1) / n`` summed over the ranks,
the combine as much back, and the final all-gather ``tokens × hidden × bytes``. Routing is rarely balanced:
:attr:`ExpertParallelMoE.routed` records the plan, so the load of each rank and the pairs sent between each
two ranks are measured, not assumed (:func:`load_per_rank`, :func:`pairs_between_ranks`).

Within one tensor-parallel group there is a path without the all-to-all: every rank holds every token, so
each could run its own experts on the tokens routed to them and one all-reduce could add the partial outputs.
The all-to-all is what expert parallelism needs once ranks hold different tokens (data-parallel attention,
experts spread over more GPUs than attention uses), and it is the path this module teaches.
"""

from __future__ import annotations

import torch
from torch import nn

from minserve.model.llama import SparseMoE, run_grouped, weighted_sum
from minserve.parallel.comm import Communicator


class ExpertParallelMoE(nn.Module):
    """A :class:`~minserve.model.llama.SparseMoE` holding this rank's ``num_experts / n`` experts (see the
    module docstring); it takes the place of the whole layer on every rank."""

    def __init__(self, moe: SparseMoE, comm: Communicator) -> None:
        super().__init__()
        self.comm = comm
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.experts_per_rank = moe.num_experts // comm.world_size
        self.first_expert = comm.rank * self.experts_per_rank
        self.gate = moe.gate  # every rank routes its own share of the tokens
        self.experts = nn.ModuleList(moe.experts[self.first_expert : self.first_expert + self.experts_per_rank])
        self.reset_load()

    def reset_load(self) -> None:
        # routed[s, e]: (token, expert) pairs rank s sent to expert e since the last reset (a plain attribute,
        # kept on the CPU, as SparseMoE's counter is).
        self.routed = torch.zeros(self.comm.world_size, self.num_experts, dtype=torch.long, device="cpu")

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """``[num_experts]`` pairs routed to each expert by every rank: what ``SparseMoE`` counts in one process."""
        return self.routed.sum(dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, rank = self.comm.world_size, self.comm.rank
        share = -(-len(x) // n)  # tokens per rank; the last rank's share may be short, or empty
        mine = x[rank * share : (rank + 1) * share]
        weights, expert_ids = self.gate(mine)  # [len(mine), top_k] each
        pair_experts = expert_ids.flatten()  # pair p: token p // top_k
        plan = self._plan(pair_experts)  # [n, num_experts]
        send = plan[rank].view(n, self.experts_per_rank).sum(dim=1).tolist()  # pairs to each rank
        from_each = plan[:, self.first_expert : self.first_expert + self.experts_per_rank]  # [n, experts_per_rank]
        receive = from_each.sum(dim=1).tolist()  # pairs from each rank
        order = pair_experts.argsort(stable=True)  # by expert, so by the rank that holds it
        arrived = self.comm.all_to_all(mine[order // self.top_k], send, receive)
        # Each rank's rows arrive sorted by expert: from_each[s, j] rows of local expert j from rank s, in turn.
        local_experts = torch.arange(self.experts_per_rank, device=x.device).repeat(n)
        done = run_grouped(self.experts, arrived, local_experts.repeat_interleave(from_each.flatten()))
        returned = self.comm.all_to_all(done, receive, send)
        outputs = torch.empty_like(returned)
        outputs[order] = returned  # back in pair order
        return self._gather(weighted_sum(outputs, weights), share, len(x))

    def _plan(self, pair_experts: torch.Tensor) -> torch.Tensor:
        """Every rank's pairs per expert, ``[n, num_experts]``, added to :attr:`routed`."""
        counts = torch.bincount(pair_experts, minlength=self.num_experts)
        plan = self.comm.all_gather(counts[None], dim=0)
        self.routed = self.routed + plan.cpu()  # not in place: it may be read outside inference_mode
        return plan

    def _gather(self, combined: torch.Tensor, share: int, num_tokens: int) -> torch.Tensor:
        """Every rank's share of the outputs, end to end: ``[num_tokens, hidden]`` (a short share padded for the
        all-gather, the padding cut off)."""
        padded = combined.new_zeros(share, combined.shape[-1])
        padded[: len(combined)] = combined
        return self.comm.all_gather(padded, dim=0)[:num_tokens]


def expert_parallel_blocks(model: nn.Module) -> list[ExpertParallelMoE]:
    """The model's expert-parallel layers; a model without any (one process, or plain tensor parallelism) is
    refused, since only these know each rank's share."""
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, ExpertParallelMoE)]
    if not blocks:
        raise ValueError("the model has no expert-parallel layers: build it with enable_expert_parallel=True")
    return blocks


def load_per_rank(model: nn.Module) -> torch.Tensor:
    """``[moe layers, n]``: the (token, expert) pairs each rank's experts ran, per sparse layer, since the last
    :meth:`~minserve.model.llama.LlamaForCausalLM.reset_expert_load`; any rank's model knows every rank's.
    Summed over ranks, a layer's row is tokens × top_k."""
    blocks = expert_parallel_blocks(model)
    return torch.stack([moe.tokens_per_expert.view(moe.comm.world_size, -1).sum(dim=1) for moe in blocks])


def pairs_between_ranks(model: nn.Module) -> torch.Tensor:
    """``[n, n]``: (token, expert) pairs each rank (row) dispatched to each rank (column), summed over the sparse
    layers. Off the diagonal they crossed a link, twice (there and back); on it they stayed home."""
    blocks = expert_parallel_blocks(model)
    n = blocks[0].comm.world_size
    return sum(moe.routed.view(n, n, -1).sum(dim=-1) for moe in blocks)
