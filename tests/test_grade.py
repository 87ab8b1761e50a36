"""The grader can fail: the reference solutions score full marks, the untouched stubs score zero."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minserve import grade

EXERCISES = Path(__file__).resolve().parents[1] / "exercises"
CHAPTERS = {
    "ch01": "ch01_metrics.py",
    "ch02": "ch02_detokenizer.py",
    "ch03": "ch03_triton.py",
    "ch04": "ch04_kv_cache.py",
    "ch05": "ch05_scheduling.py",
    "ch08": "ch08_speculative.py",
    "ch10": "ch10_loadtest.py",
}


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "minserve.cli", "grade", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd)


def test_chapter_names():
    assert grade.normalize_chapter("ch01") == grade.normalize_chapter("1") == grade.normalize_chapter("01") == "ch01"
    with pytest.raises(grade.GradingError):
        grade.normalize_chapter("chapter one")


def test_finds_the_repository_exercises_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./exercises here: fall back to the one next to the package
    assert grade.exercises_root() == EXERCISES
    assert grade.find_exercise_file("ch01", EXERCISES).name == "ch01_metrics.py"
    with pytest.raises(FileNotFoundError):
        grade.exercises_root(tmp_path)
    with pytest.raises(FileNotFoundError):
        grade.find_test_files("ch99", EXERCISES / "tests")


def test_every_chapter_with_tests_has_a_stub_and_a_solution():
    chapters = {path.stem.removeprefix("test_")[:4] for path in (EXERCISES / "tests").glob("test_ch*.py")}
    assert chapters == set(CHAPTERS)
    for chapter, name in CHAPTERS.items():
        assert grade.find_exercise_file(chapter, EXERCISES).name == name
        assert grade.find_exercise_file(chapter, EXERCISES / "solutions").name == name


@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_every_stub_is_a_stub_and_every_solution_exists(chapter):
    stub = grade.load_exercise(EXERCISES / CHAPTERS[chapter])
    solution = grade.load_exercise(EXERCISES / "solutions" / CHAPTERS[chapter])
    # What the solution defines itself (not what it imports) is what the learner writes.
    public = [
        name
        for name, value in vars(solution).items()
        if callable(value) and not name.startswith("_") and getattr(value, "__module__", None) == solution.__name__
    ]
    assert public, f"{chapter}'s solution defines nothing"
    for name in public:
        assert callable(getattr(stub, name, None)), f"the stub lacks {name}"
        assert getattr(stub, name).__doc__, f"the stub's {name} has no docstring"


@pytest.mark.slow
@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_cli_stubs_score_zero_with_hints(chapter):
    done = _cli(chapter, cwd=EXERCISES.parent)
    assert done.returncode == 1, done.stderr
    total_line = done.stdout.strip().splitlines()[-1]
    assert total_line.split()[0] == "total" and total_line.split()[1].startswith("0/")
    assert "NotImplementedError" in done.stdout and "hint: " in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_cli_solutions_score_full_marks_as_json(chapter):
    done = _cli(chapter, "--solutions", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(result) == {"chapter", "file", "tests_dir", "score", "max_score", "tests"}
    assert result["chapter"] == chapter and result["file"].endswith(f"solutions/{CHAPTERS[chapter]}")
    assert result["max_score"] > 0 and result["score"] == result["max_score"]
    assert result["max_score"] == sum(t["max_points"] for t in result["tests"])
    assert len(result["tests"]) >= 10
    for test in result["tests"]:
        assert set(test) == {"name", "nodeid", "outcome", "points", "max_points", "hint", "message"}
        assert test["outcome"] == "passed" and test["points"] == test["max_points"] >= 1 and test["hint"]


@pytest.mark.slow
def test_hidden_tests_partial_credit_and_a_learners_file(tmp_path):
    """An instructor's own tests folder; a learner's file with one function right and one wrong."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_ch01_hidden.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.points(4)\n"
        "def test_e2e(exercise):\n"
        '    """E2E is finish minus arrival."""\n'
        "    assert exercise.e2e_s(1.0, 3.0) == 2.0\n\n"
        "def test_ttft(exercise):\n"
        '    """TTFT is first token minus arrival."""\n'
        "    assert exercise.ttft_s(1.0, [1.5]) == 0.5\n"
    )
    learner = tmp_path / "mine.py"
    learner.write_text("def e2e_s(a, f):\n    return f - a\n\ndef ttft_s(a, t):\n    return t[-1]\n")
    report, _ = grade.grade("ch01", file=learner, tests_dir=hidden)
    by_name = {t.name: t for t in report.tests}
    assert (report.score, report.max_score) == (4, 5)
    assert by_name["test_e2e"].outcome == "passed" and by_name["test_e2e"].points == 4
    assert by_name["test_ttft"].outcome == "failed" and by_name["test_ttft"].points == 0
    assert by_name["test_ttft"].hint == "TTFT is first token minus arrival."
    assert "assert 1.5 == 0.5" in by_name["test_ttft"].message
    table = grade.format_report(report)
    assert "hint: TTFT is first token minus arrival." in table and table.splitlines()[-1].split()[1] == "4/5"


@pytest.mark.slow
def test_a_broken_test_folder_is_a_grading_error(tmp_path):
    (tmp_path / "test_ch01_broken.py").write_text("import no_such_module_anywhere\n")
    with pytest.raises(grade.GradingError, match="could not be collected"):
        grade.grade("ch01", file=EXERCISES / "solutions" / "ch01_metrics.py", tests_dir=tmp_path)
