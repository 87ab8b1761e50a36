"""minserve.lab.overload and overload_figures: the simulator's policies as server flags (the server builds the
same policy from them), and chapter 09's figures and accounting table drawn from tables of the experiments'
columns. No server is started here: tests/test_overload.py runs the experiments against real ones.
"""

from __future__ import annotations

import argparse

import pandas as pd
import pytest

from minserve.admission import DeadlineAware, FirstRefusal, QueueLength, TokenBudget, make_admission
from minserve.bench.overload import StormShape
from minserve.cli import SERVE_OVERLOAD_FIELDS, SERVE_SERVER_FIELDS
from minserve.config import ServerConfig
from minserve.flags import add_config_flags, config_options
from minserve.lab import overload, overload_figures


def server_policy(args: list[str]):
    """The admission policy a server started with ``args`` builds (the command line's own parsing)."""
    fields = SERVE_SERVER_FIELDS + SERVE_OVERLOAD_FIELDS
    parser = argparse.ArgumentParser()
    add_config_flags(parser, ServerConfig, fields)
    return make_admission(ServerConfig(**config_options(parser.parse_args(args), ServerConfig, fields)))


def test_the_server_builds_the_policy_its_flags_name():
    queue = server_policy(overload.server_args(QueueLength(7)))
    assert isinstance(queue, QueueLength) and queue.max_waiting_requests == 7
    deadline = server_policy(overload.server_args(DeadlineAware(0.35, headroom=0.6)))
    assert isinstance(deadline, FirstRefusal)  # behind the default queue-length limit
    assert [type(p) for p in deadline.policies] == [QueueLength, DeadlineAware]
    assert deadline.policies[1].ttft_slo_s == pytest.approx(0.35) and deadline.policies[1].headroom == 0.6
    assert overload.server_args(None) == []
    with pytest.raises(ValueError, match="no command-line form"):
        overload.server_args(TokenBudget(100))


def overload_rows(side: str) -> pd.DataFrame:
    rows = []
    for policy, refused in (("no admission", (0, 0, 0)), ("deadline-aware", (1, 40, 60))):
        for load, r in zip((1.0, 2.0, 3.0), refused):
            row = {
                "policy": policy,
                "load_multiple": load,
                "sent": 100,
                "refused": r,
                "attainment_admitted": 0.9,
                "attainment_all": 0.9 * (100 - r) / 100,
                "ttft_p99_s": 0.4 * load,
            }
            if side == "simulator":
                row["refusal_share"] = r / 100
            rows.append(row)
    return pd.DataFrame(rows)


def test_overload_figure_draws_both_sides_with_one_colour_per_policy():
    fig = overload_figures.overload_figure(
        {"simulator": overload_rows("simulator"), "server": overload_rows("server")}, slo_ttft_s=1.0
    )
    assert [a.text for a in fig.layout.annotations][:2] == ["simulator", "server"]
    # Four traces per policy and side: attainment of admitted and of all, refusals, p99 TTFT.
    assert len(fig.data) == 2 * 2 * 4
    refusals = [t for t in fig.data if t.hovertemplate and "refused" in t.hovertemplate]
    assert [list(t.y) for t in refusals if t.name == "deadline-aware"] == [[0.01, 0.4, 0.6]] * 2
    colors = {t.name: t.line.color for t in fig.data if t.showlegend is not False}
    assert len(set(colors.values())) == 2
    assert sum(s.type == "line" and s.y0 == 1.0 for s in fig.layout.shapes) == 2  # the SLO, on each side
    labels = [a.text for a in fig.layout.annotations]
    assert labels[:2] == ["simulator", "server"] and "new text" not in labels and len(labels) == 3  # and the key


def test_storm_figure_marks_the_spike_the_capacity_and_the_users_own_load():
    storm = pd.DataFrame(
        [(s, t, a, a / 2, a / 2) for s in ("naive", "jitter+budget") for t, a in ((0.0, 4), (0.5, 40), (1.0, 6))],
        columns=["strategy", "t_s", "attempts_per_s", "successes_per_s", "refusals_per_s"],
    )
    shape = StormShape(10.0, spike_multiple=4.0, spike_s=0.5, calm_multiple=0.5, before_s=0.5, after_s=1.0)
    users = overload.users_load(shape)
    assert users == [(0.0, 5.0), (0.5, 40.0), (1.0, 5.0), (2.0, 5.0)]
    fig = overload_figures.storm_figure(storm, (0.5, 1.0), capacity_rps=10.0, users_rps=users)
    names = [t.name for t in fig.data]
    assert names == ["naive", "naive", "jitter+budget", "jitter+budget", "the users' own requests"]
    assert sum(s.type == "rect" and (s.x0, s.x1) == (0.5, 1.0) for s in fig.layout.shapes) == 2
    assert sum(s.type == "line" and s.y0 == 10.0 for s in fig.layout.shapes) == 2
    labels = [a.text for a in fig.layout.annotations]
    assert labels.count("spike") == labels.count("capacity") == 1 and "new text" not in labels


def test_accounting_table_shows_a_lost_request():
    served = pd.DataFrame(
        {
            "policy": ["a", "b"],
            "load_multiple": [3.0, 3.0],
            "sent": [10, 10],
            "succeeded": [6, 5],
            "refused": [4, 4],
            "timed_out": [0, 0],
            "failed": [0, 0],
            "server_accounted": [True, False],
        }
    )
    table = overload_figures.accounting_table(served)
    assert list(table["unaccounted"]) == [0, 1]
    assert list(table.columns) == [
        "sent",
        "succeeded",
        "refused",
        "timed_out",
        "failed",
        "unaccounted",
        "server_accounted",
    ]
