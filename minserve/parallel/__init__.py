"""Parallel inference (chapter 06): the collectives, counted (:mod:`.comm`), a model split across ranks
by swapping its layers for sharded ones (:mod:`.sharding`), and a mixture of experts' experts split across
them with tokens sent by all-to-all (:mod:`.expert_parallel`), and a model cut into pipeline stages, with
the bubble's formula and measurement (:mod:`.pipeline`). The engine's parallel executors
(:mod:`minserve.engine.tensor_parallel`, :mod:`minserve.engine.pipeline_parallel`) spawn the ranks and keep
them in step."""

from minserve.parallel.comm import Communicator, Traffic
from minserve.parallel.expert_parallel import ExpertParallelMoE, load_per_rank, pairs_between_ranks
from minserve.parallel.sharding import check_tensor_parallel, shard_model

__all__ = ["Communicator", "ExpertParallelMoE", "Traffic", "check_tensor_parallel", "load_per_rank",
           "pairs_between_ranks", "shard_model"]  # fmt: skip
