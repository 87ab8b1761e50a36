"""Parallel inference (chapter 06): the collectives, counted (:mod:`.comm`), and a model split across ranks
by swapping its layers for sharded ones (:mod:`.sharding`). The engine's tensor-parallel executor
(:mod:`minserve.engine.tensor_parallel`) spawns the ranks and keeps them in step."""

from minserve.parallel.comm import Communicator, Traffic
from minserve.parallel.sharding import check_tensor_parallel, shard_model

__all__ = ["Communicator", "Traffic", "check_tensor_parallel", "shard_model"]
