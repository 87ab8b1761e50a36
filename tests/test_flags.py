"""Command-line flags come from the configuration dataclasses: one declaration per setting."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import pytest

from minserve.cli import SERVE_ENGINE_FIELDS, SERVE_SERVER_FIELDS, build_parser
from minserve.config import PREEMPTION_MODES, SCHEDULING_POLICIES, EngineConfig, SchedulerConfig, ServerConfig, option
from minserve.flags import ENGINE_SCHEDULING, add_config_flags, config_argv, config_options


@dataclass(frozen=True)
class Knobs:
    rate_rps: float = option(2.5, "requests per second")
    enable_cache: bool = option(True, "keep a cache")
    verbose: bool = option(False, "say more")
    label: str | None = option(None, "a name", choices=("a", "b"))
    fast: bool | None = option(None, "go fast (unset: the command decides)")


def test_a_field_declared_once_is_a_typed_flag_with_its_default():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, Knobs, [f.name for f in fields(Knobs)])
    assert Knobs(**config_options(parser.parse_args([]), Knobs, ["rate_rps", "enable_cache", "verbose"])) == Knobs()
    args = parser.parse_args(["--rate-rps", "4", "--no-cache", "--verbose", "--label", "b", "--fast"])
    assert Knobs(**config_options(args, Knobs, [f.name for f in fields(Knobs)])) == Knobs(4.0, False, True, "b", True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--label", "c"])


def test_unset_flags_pass_on_only_what_was_given():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, EngineConfig, ENGINE_SCHEDULING, unset=True)
    given = config_options(parser.parse_args(["--max-num-seqs", "3", "--no-chunked-prefill"]), EngineConfig,
                           ENGINE_SCHEDULING)  # fmt: skip
    assert given == {"max_num_seqs": 3, "enable_chunked_prefill": False}


def test_serve_takes_every_engine_and_server_setting_it_names_with_the_configs_defaults():
    args = build_parser().parse_args(["serve"])
    engine = EngineConfig.from_options(**config_options(args, EngineConfig, SERVE_ENGINE_FIELDS))
    server = ServerConfig(**config_options(args, ServerConfig, SERVE_SERVER_FIELDS))
    assert engine == EngineConfig() and server == ServerConfig()
    args = build_parser().parse_args(["serve", "--preemption-mode", "swap", "--threads", "1", "--port", "9"])
    assert config_options(args, EngineConfig, SERVE_ENGINE_FIELDS)["preemption_mode"] == "swap"
    assert args.num_threads == 1 and args.port == 9


@pytest.mark.parametrize(("given", "value"), [([], None), (["--fast"], True), (["--no-fast"], False)])
def test_a_boolean_left_unset_takes_both_switches_and_passes_on_what_was_said(given, value):
    parser = argparse.ArgumentParser()
    add_config_flags(parser, Knobs, ["fast"])
    args = parser.parse_args(given)
    assert args.fast is value
    assert config_argv(args, Knobs, ["fast"]) == given  # what `minserve route` hands its replicas


def test_flat_settings_land_in_their_groups_and_an_unknown_one_is_named():
    config = EngineConfig.from_options(model="m", block_size=8, kv_cache_dtype="int8", tensor_parallel_size=2,
                                       num_threads=1, speculative_config=None, enable_tracing=False)  # fmt: skip
    assert config.checkpoint.model == "m" and config.scheduler.block_size == 8 and config.cache.kv_cache_dtype == "int8"
    assert config.parallel.world_size == 2 and config.device.num_threads == 1 and not config.enable_tracing
    assert config.scheduler.num_kv_blocks is None  # an engine's count is what fits in memory, worked out at start
    # Every flat setting is one group's field (no name in two groups), and each is a flag of its group's.
    owners = [name for group in ("checkpoint", "cache", "scheduler", "parallel", "device")
              for name in vars(getattr(EngineConfig(), group))]  # fmt: skip
    assert len(owners) == len(set(owners))
    assert set(EngineConfig.options()) == set(owners) - {"num_cpu_blocks"} | {"speculative_config", "enable_tracing"}
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineConfig.from_options(max_num_seq=3)
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        EngineConfig(scheduler=SchedulerConfig(num_cpu_blocks=4))


def test_the_engine_implements_every_policy_and_preemption_the_configuration_names():
    from minserve.engine.policies import POLICIES
    from minserve.engine.preemption import PREEMPTIONS

    assert tuple(POLICIES) == SCHEDULING_POLICIES and tuple(PREEMPTIONS) == PREEMPTION_MODES
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        SchedulerConfig(scheduling_policy="lifo")
