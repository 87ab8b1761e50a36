"""The router's policies and replica health on their own, without HTTP (the router's tests: test_router.py)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minserve.serve.routing import (
    LeastOutstanding,
    PrefixAware,
    Replica,
    RoundRobin,
    RouterConfig,
    make_routing_policy,
    prefix_key,
    rendezvous,
)


def _replicas(count: int) -> list[Replica]:
    return [Replica(f"http://10.0.0.{i}:8000") for i in range(count)]


def _completion(prompt) -> dict:
    return {"model": "m", "prompt": prompt}


def test_round_robin_takes_each_replica_in_turn():
    replicas = _replicas(3)
    policy = RoundRobin()
    chosen = [policy.choose(replicas, {}) for _ in range(7)]
    assert chosen == [replicas[i % 3] for i in range(7)]


def test_least_outstanding_takes_the_least_loaded_and_shares_ties():
    replicas = _replicas(3)
    policy = LeastOutstanding()
    replicas[0].in_flight, replicas[1].in_flight, replicas[2].in_flight = 5, 2, 3
    assert {policy.choose(replicas, {}) for _ in range(4)} == {replicas[1]}
    for replica in replicas:
        replica.in_flight = 0
    assert Counter(policy.choose(replicas, {}).url for _ in range(30)) == {r.url: 10 for r in replicas}


def test_prefix_aware_sends_a_prefix_to_one_replica_and_spreads_prefixes():
    replicas = _replicas(4)
    policy = PrefixAware(prefix_chars=64)
    shared = "You are a careful assistant who answers in Python. " * 3
    homes = {policy.choose(replicas, _completion(shared + f"question {i}")) for i in range(20)}
    assert len(homes) == 1, "requests that differ only past prefix_chars share a replica"
    owners = Counter(policy.choose(replicas, _completion(f"system prompt number {i}")).url for i in range(400))
    assert len(owners) == 4 and min(owners.values()) >= 400 / 4 / 2, f"uneven spread: {owners}"


@pytest.mark.parametrize("max_imbalance", [0, 3, 16])
def test_prefix_aware_leaves_an_overloaded_replica_past_max_imbalance(max_imbalance):
    replicas = _replicas(3)
    policy = PrefixAware(max_imbalance=max_imbalance)
    body = _completion("def handler(event, context):")
    home = policy.choose(replicas, body)
    home.in_flight = max_imbalance  # exactly the bound beyond the others (at 0): still home
    assert policy.choose(replicas, body) is home
    home.in_flight = max_imbalance + 1  # past it: the least loaded instead
    other = policy.choose(replicas, body)
    assert other is not home and other.in_flight == 0


@given(
    num_replicas=st.integers(2, 8),
    lost=st.integers(0, 7),
    keys=st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=60, unique=True),
)
def test_rendezvous_moves_only_the_lost_replicas_keys(num_replicas, lost, keys):
    replicas = _replicas(num_replicas)
    gone = replicas[lost % num_replicas]
    survivors = [replica for replica in replicas if replica is not gone]
    before = {key: rendezvous(key, replicas) for key in keys}
    after = {key: rendezvous(key, survivors) for key in keys}
    for key in keys:
        if before[key] is not gone:
            assert after[key] is before[key], "a key whose replica stayed must stay with it"
        else:
            assert after[key] in survivors
    assert {key: rendezvous(key, replicas) for key in keys} == before, "the replica back: its keys come back"


def test_prefix_key_of_completions_and_chats():
    assert prefix_key(_completion("abcdef"), 4) == "abcd"
    assert prefix_key(_completion(["abcdef"]), 4) == "abcd"
    assert prefix_key(_completion(list(range(100))), 16) == "0,1,2,3"  # 16 characters: about 4 tokens
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    assert prefix_key(chat, 1000) == "system: Be brief.\nuser: Hi\n"
    parts = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]}
        ]
    }
    assert prefix_key(parts, 1000) == "system: Be brief.\n"
    assert prefix_key(chat, 10) == "system: Be"
    for nonsense in ({}, {"prompt": 3}, {"messages": "x"}, [], "text"):
        assert prefix_key(nonsense, 10) == ""


def test_a_replica_leaves_after_unhealthy_after_failed_checks_or_one_refusal_and_comes_back():
    replica = Replica("http://a", unhealthy_after=3)
    replica.failed_check()
    replica.failed_check()
    assert replica.healthy, "two failures of three: still in"
    replica.failed_check()
    assert not replica.healthy
    replica.passed_check()
    assert replica.healthy and replica.failed_checks == 0
    replica.failed_check(refused=True)
    assert not replica.healthy, "nothing listens: out at once"


def test_bad_settings_are_refused_naming_them():
    with pytest.raises(ValueError, match="round-robin"):
        make_routing_policy("random")
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(policy="fastest")
    with pytest.raises(ValueError, match="unhealthy_after"):
        RouterConfig(unhealthy_after=0)
    with pytest.raises(ValueError, match="health_interval_s"):
        RouterConfig(health_interval_s=0)
    policy = PrefixAware(prefix_chars=10, max_imbalance=2)
    assert make_routing_policy(policy) is policy
    assert repr(make_routing_policy("prefix-aware", 100, 4)) == "PrefixAware(prefix_chars=100, max_imbalance=4)"
