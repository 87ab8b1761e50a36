"""User-facing configuration: frozen dataclasses, each checked when it is built, each setting declared once.

* :mod:`.engine` — :class:`EngineConfig`, composed of groups as vLLM composes its ``VllmConfig``:
  :class:`CheckpointConfig`, :class:`CacheConfig`, :class:`SchedulerConfig`, :class:`ParallelConfig`,
  :class:`DeviceConfig` and :class:`SpeculativeConfig`; ``EngineConfig.from_options`` takes them flat;
* :mod:`.scheduler` — :class:`SchedulerConfig`, the group the engine core takes (the simulator too);
* :mod:`.speculative` — :class:`SpeculativeConfig`, vLLM's dict shape, checked;
* :mod:`.server` — :class:`ServerConfig`, the HTTP server's limits;
* :mod:`.options` — :func:`option`: a field with its flag's help text and choices; :mod:`minserve.flags`
  turns each into a command-line flag, so a new setting is one line in its group and shows up in every
  command that takes the group.

Nothing here imports the engine, the model or the server (an import-linter contract holds it).
"""

from minserve.config.engine import CacheConfig, CheckpointConfig, DeviceConfig, EngineConfig, ParallelConfig
from minserve.config.options import Option, option, options_of
from minserve.config.scheduler import PREEMPTION_MODES, SCHEDULING_POLICIES, SchedulerConfig
from minserve.config.server import ServerConfig
from minserve.config.speculative import SpeculativeConfig

__all__ = [
    "PREEMPTION_MODES",
    "SCHEDULING_POLICIES",
    "CacheConfig",
    "CheckpointConfig",
    "DeviceConfig",
    "EngineConfig",
    "Option",
    "ParallelConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "option",
    "options_of",
]
