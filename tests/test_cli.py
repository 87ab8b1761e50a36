"""The `minserve` command line, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from minserve import cli
from minserve.cli import build_parser, main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minserve.cli", *args], capture_output=True, text=True, timeout=300)


def test_every_subcommand_has_help(capsys):
    commands = build_parser()._subparsers._group_actions[0].choices  # argparse keeps them here
    assert {"generate", "chat", "demo", "serve", "bench", "models", "grade"} <= set(commands)
    result = _run("generate", "--help")  # one as a user types it, in a fresh interpreter
    assert result.returncode == 0 and "usage: minserve generate" in result.stdout
    # The rest through the same parser in this process: an interpreter per subcommand cost ~3 s each of start-up
    # (torch's import) for the same help text.
    for name in commands:
        with pytest.raises(SystemExit) as done:
            main([name, "--help"])
        assert done.value.code == 0 and "usage: minserve " + name in capsys.readouterr().out, name


def test_generate_prints_prompt_and_completion():
    result = _run("generate", "def fib(n):", "--max-tokens", "8", "--verbose", "--raw")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def fib(n):")
    assert "finish_reason=" in result.stderr and "TTFT" in result.stderr


def test_bad_arguments_exit_with_a_message(capsys):
    assert main(["generate", "x", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    assert main(["generate", "x", "--model", "/no/such/dir"]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_runs_the_tour(tmp_path):
    result = _run("demo", "--out", str(tmp_path / "tour"))
    assert result.returncode == 0, result.stderr
    for step in ("1. load", "2. generate", "3. stream", "4. measure", "5. serve", "6. load test", "7. chat"):
        assert step in result.stdout
    assert "smollm2-135m-instruct: The capital of France is Paris." in result.stdout  # a real chat model answered
    assert "tokens from http://127.0.0.1:" in result.stdout  # the openai client got its completion
    assert {p.name for p in (tmp_path / "tour").iterdir()} == {"records.jsonl", "summary.json", "report.html"}


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 2), (3, 3), (4, 3), (16, 15)])
def test_a_server_engine_takes_every_core_of_a_small_cpu_and_spares_one_on_a_larger(monkeypatch, cores, threads):
    # On two cores, one engine thread (the other core left to HTTP) gave twice the TPOT of two threads
    # (docs/benchmarks.md, "The engine's threads on two cores"); from four cores up one is spared.
    monkeypatch.setattr(cli.os, "cpu_count", lambda: cores)
    assert cli._default_server_threads("cpu") == threads
    assert cli._default_server_threads("cuda:0") is None
