"""Which replica serves a request: the router's policies, and the health state they choose among.

A policy is one small idea behind one method, ``choose(replicas, body)``: given the healthy replicas the
request may still go to (never empty) and its JSON body, return one. The router calls it and increments
the chosen replica's ``in_flight`` with no ``await`` in between, so under any burst each choice sees every
earlier one.

* :class:`RoundRobin`: each in turn. Even when requests cost the same; blind to a replica that is busy.
* :class:`LeastOutstanding`: the replica with the fewest requests in flight (ties taken in turn). It
  follows the load a replica actually has, so a long request on one sends the next ones to the others.
* :class:`PrefixAware`: requests whose prompts start alike go to the same replica, so its prefix cache
  holds their shared blocks once and hits, instead of every replica computing and caching every prefix.
  It hashes the prompt's first ``prefix_chars`` characters (a chat's messages rendered as
  ``role: content`` lines: in practice the system message and the first user turn) by rendezvous hashing.
  When the chosen replica has more than ``max_imbalance`` requests in flight beyond the least loaded one,
  the request goes to the least loaded instead: one hot prefix must not pile onto one replica while the
  others idle.

A :class:`Replica` is taken out after ``unhealthy_after`` failed health checks in a row, or at once when it
refuses a connection, and comes back at its first passed check. :class:`RouterConfig` holds the router's
settings (it lives here, not in :mod:`minserve.config`, which the engine imports and which so may not
import the server).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from minserve.config import option

CHARS_PER_TOKEN = 4  # a token-id prompt's key takes prefix_chars / 4 ids: about as much text
DEFAULT_PREFIX_CHARS = 256
DEFAULT_MAX_IMBALANCE = 16


@dataclass(eq=False)
class Replica:
    """One server behind the router, as the router sees it.

    ``in_flight``: requests forwarded to it and not yet answered in full. ``failed_checks``: health checks
    (and forwards) failed in a row. A refused connection takes it out at once: nothing listens there, so
    more evidence would only send more requests to it.
    """

    url: str
    unhealthy_after: int = 3
    healthy: bool = True
    in_flight: int = 0
    failed_checks: int = 0

    def passed_check(self) -> None:
        self.healthy, self.failed_checks = True, 0

    def failed_check(self, refused: bool = False) -> None:
        self.failed_checks += 1
        if refused or self.failed_checks >= self.unhealthy_after:
            self.healthy = False

    def describe(self) -> dict[str, Any]:
        """What ``/health`` lists for it."""
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
                "failed_checks": self.failed_checks}  # fmt: skip


class RoutingPolicy:
    """The interface: ``choose`` one of ``replicas`` (healthy, never empty) for a request with ``body``."""

    name = "policy"

    def choose(self, replicas: Sequence[Replica], body: Mapping[str, Any]) -> Replica:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, replicas: Sequence[Replica], body: Mapping[str, Any]) -> Replica:
        chosen = replicas[self._turn % len(replicas)]
        self._turn += 1
        return chosen


class LeastOutstanding(RoutingPolicy):
    name = "least-outstanding"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, replicas: Sequence[Replica], body: Mapping[str, Any]) -> Replica:
        # Ties are looked at from a starting point that moves each time, so idle replicas share the work
        # instead of the first one in the list taking every request of a quiet period.
        start, self._turn = self._turn, self._turn + 1
        rotated = [replicas[(start + i) % len(replicas)] for i in range(len(replicas))]
        return min(rotated, key=lambda replica: replica.in_flight)  # min keeps the first of equals


class PrefixAware(RoutingPolicy):
    """Same prefix, same replica, by rendezvous (highest-random-weight) hashing.

    Each replica gets a score for the request's key, a hash of (replica, key), and the highest score wins.
    Why rendezvous rather than ``hash(key) % len(replicas)``: with the modulo, losing one of n replicas
    changes the divisor, and almost every key moves, so every replica's prefix cache goes cold at once.
    With rendezvous a key's ranking of the *other* replicas does not depend on the lost one, so only the
    keys it won move (to their runner-up), and the rest stay where their KV is cached. A replica that comes
    back wins back exactly its old keys. It needs no ring or virtual nodes, and for a handful of
    replicas scoring all of them per request costs microseconds.
    """

    name = "prefix-aware"

    def __init__(self, prefix_chars: int = DEFAULT_PREFIX_CHARS, max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> None:
        if prefix_chars < 1 or max_imbalance < 0:
            raise ValueError(f"need prefix_chars ≥ 1 and max_imbalance ≥ 0, got {prefix_chars} and {max_imbalance}")
        self.prefix_chars, self.max_imbalance = prefix_chars, max_imbalance
        self._fallback = LeastOutstanding()

    def choose(self, replicas: Sequence[Replica], body: Mapping[str, Any]) -> Replica:
        key = prefix_key(body, self.prefix_chars)
        if not key:  # nothing to be affine to (a body the replica will refuse anyway)
            return self._fallback.choose(replicas, body)
        chosen = rendezvous(key, replicas)
        least = min(replica.in_flight for replica in replicas)
        if chosen.in_flight - least > self.max_imbalance:
            return self._fallback.choose(replicas, body)
        return chosen

    def __repr__(self) -> str:
        return f"PrefixAware(prefix_chars={self.prefix_chars}, max_imbalance={self.max_imbalance})"


def rendezvous(key: str, replicas: Sequence[Replica]) -> Replica:
    """The replica with the highest score for ``key``. A stable hash (not Python's ``hash``, which is
    salted per process), so a restarted router sends each prefix where it went before."""
    return max(replicas, key=lambda replica: _score(replica.url, key))


def _score(url: str, key: str) -> int:
    digest = hashlib.blake2b(f"{url}\x00{key}".encode(errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def prefix_key(body: Mapping[str, Any], num_chars: int) -> str:
    """The part of a request that names its prefix: the first ``num_chars`` characters of a completion's
    prompt, or of a chat's messages as ``role: content`` lines. ``""`` when the body has neither.

    A token-id prompt gives its first ``num_chars // CHARS_PER_TOKEN`` ids. The body is not checked here
    (the replica does that); anything unexpected just gives a shorter key.
    """
    prompt = body.get("prompt") if isinstance(body, Mapping) else None
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt[:num_chars]
    if isinstance(prompt, list):
        return ",".join(str(token) for token in prompt[: max(1, num_chars // CHARS_PER_TOKEN)])
    messages = body.get("messages") if isinstance(body, Mapping) else None
    if not isinstance(messages, list):
        return ""
    key = ""
    for message in messages:  # stop as soon as there is enough: a long conversation is not rendered whole
        if len(key) >= num_chars:
            break
        if isinstance(message, Mapping):
            key += f"{message.get('role')}: {_text(message.get('content'))}\n"
    return key[:num_chars]


def _text(content: Any) -> str:
    """A message's content: a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    return ""


ROUTING_POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (RoundRobin, LeastOutstanding, PrefixAware)}


def make_routing_policy(
    policy: str | RoutingPolicy,
    prefix_chars: int = DEFAULT_PREFIX_CHARS,
    max_imbalance: int = DEFAULT_MAX_IMBALANCE,
) -> RoutingPolicy:
    """A policy from its name (the prefix-aware one with its two settings), or the object itself."""
    if isinstance(policy, RoutingPolicy):
        return policy
    if policy not in ROUTING_POLICIES:
        raise ValueError(f"policy must be one of {list(ROUTING_POLICIES)} or a RoutingPolicy, got {policy!r}")
    if policy == PrefixAware.name:
        return PrefixAware(prefix_chars, max_imbalance)
    return ROUTING_POLICIES[policy]()


@dataclass(frozen=True)
class RouterConfig:
    """The router in front of several servers (``minserve route``, :mod:`minserve.serve.router`). Times in
    seconds, sizes in bytes.

    ``policy`` picks each request's replica: ``round-robin``, ``least-outstanding`` (fewest requests in
    flight) or ``prefix-aware`` (the same first ``prefix_chars`` characters of the prompt, the same replica,
    unless it has more than ``max_imbalance`` requests in flight beyond the least loaded one); or a
    :class:`RoutingPolicy` object. Every ``health_interval_s`` each replica's ``/health`` is asked, waiting at
    most ``health_timeout_s``; ``unhealthy_after`` failures in a row, or one refused connection, take a
    replica out until it answers again. A request whose forward failed before any byte reached the client
    goes to up to ``max_retries`` other replicas. A forward waits at most ``request_timeout_s`` for the
    replica's next bytes. With no healthy replica the answer is 503 with ``Retry-After: retry_after_s``. A
    request body over ``max_body_bytes`` is refused (413).
    """

    host: str = option("127.0.0.1", "address to bind; 127.0.0.1 is loopback only")
    port: int = option(8000, "TCP port")
    policy: str | RoutingPolicy = option(
        "round-robin", "which replica serves a request", choices=list(ROUTING_POLICIES)
    )
    prefix_chars: int = option(DEFAULT_PREFIX_CHARS, "prefix-aware: the prompt's first characters that name its prefix")
    max_imbalance: int = option(
        DEFAULT_MAX_IMBALANCE, "prefix-aware: past this many more in flight than the least loaded, use that one"
    )
    health_interval_s: float = option(1.0, "seconds between health checks of each replica")
    health_timeout_s: float = option(2.0, "a health check unanswered this long failed")
    unhealthy_after: int = option(3, "failed health checks in a row that take a replica out")
    max_retries: int = option(1, "other replicas a request is tried on when its forward fails before any byte")
    request_timeout_s: float = option(600.0, "a forward waiting longer for the replica's next bytes fails (504)")
    retry_after_s: int = option(1, "the Retry-After of a 503 when no replica is healthy, seconds")
    max_body_bytes: int = option(4 * 2**20, "largest request body, bytes (413 past it)")

    def __post_init__(self) -> None:
        minimums = {"port": 0, "prefix_chars": 1, "max_imbalance": 0, "unhealthy_after": 1, "max_retries": 0,
                    "retry_after_s": 0, "max_body_bytes": 1}  # fmt: skip
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"RouterConfig.{name} must be an integer ≥ {minimum}, got {value!r}")
        for name in ("health_interval_s", "health_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RouterConfig.{name} must be > 0, got {getattr(self, name)!r}")
        make_routing_policy(self.policy)  # an unknown name fails here, saying which exist
