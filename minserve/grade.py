"""The exercise grader behind ``minserve grade ch01``.

Each chapter has a stub module the learner fills in (``exercises/ch01_metrics.py``), graded tests
(``exercises/tests/test_ch01.py``) and reference solutions (``exercises/solutions/ch01_metrics.py``). The
grader runs the chapter's tests with pytest in a child process, so a learner's module (or an infinite loop
in it) cannot disturb the grader, and every run starts from a clean interpreter. The child imports the
learner's file from the path in ``MINSERVE_EXERCISE_FILE`` and hands it to each test as the ``exercise``
fixture; a test is worth ``@pytest.mark.points(n)`` points (1 without the marker) and its docstring is the
hint shown when it fails; a report with at least :data:`PASS_FRACTION` of the points passes. Before a test
gets the module, :mod:`minserve.exercise_rules` checks that it imports only what its chapter allows (most
chapters: the standard library), so re-exporting minserve's own implementation scores nothing.
``--export-student`` writes the copy of the course learners are handed (:mod:`minserve.handout`).

Hidden tests: an instructor keeps a second set per chapter in :data:`HIDDEN_TESTS` (``exercises/solutions/
hidden/test_<chapter>*.py``), run with ``--hidden``: other shapes, seeds and workloads than the public tests,
so a file fitted to the public tests does not pass them. They sit under ``solutions/``, which the learner's
copy never holds.

The child writes one JSON file of results; the parent turns it into a score table or, with ``--json``,
passes it on for a gradebook.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

from minserve import exercise_rules
from minserve.handout import run_export_command

EXERCISE_FILE_ENV = "MINSERVE_EXERCISE_FILE"
EXERCISE_CHAPTER_ENV = "MINSERVE_EXERCISE_CHAPTER"  # whose import rule applies, in the grading child
SELECT_ENV = "MINSERVE_GRADE_SELECT"  # a pytest -k expression: grade only the tests it selects
REPO_EXERCISES = Path(__file__).resolve().parents[1] / "exercises"  # present in a clone, absent in a wheel
DEFAULT_TIMEOUT_S = 600.0  # the whole run; one test gets PER_TEST_TIMEOUT_S where pytest-timeout is installed
PER_TEST_TIMEOUT_S = 60
HIDDEN_TESTS = Path("solutions") / "hidden"  # inside the exercises folder: withheld with the solutions
PASS_FRACTION = 0.8  # a report passes with at least this share of the points


class GradingError(ValueError):
    """The grading itself could not run (no such chapter, broken test file, …), as opposed to a low score."""


@dataclass
class GradedTest:
    """One graded test: what it is worth, what it earned, and on failure why (``message``) and a ``hint``."""

    name: str
    nodeid: str
    # "passed", "failed" (assertion or exception in the test), "error" (in setup) or "deselected" (not run:
    # ``select`` left it out; 0 points of its max_points)
    outcome: str
    points: int
    max_points: int
    hint: str | None = None
    message: str | None = None


@dataclass
class GradeReport:
    """All the results of grading one file against one chapter's tests."""

    chapter: str
    file: str
    tests_dir: str
    tests: list[GradedTest] = field(default_factory=list)

    @property
    def score(self) -> int:
        return sum(t.points for t in self.tests)

    @property
    def max_score(self) -> int:
        return sum(t.max_points for t in self.tests)

    @property
    def passed(self) -> bool:
        """At or above the pass line: :data:`PASS_FRACTION` of the points (nothing passes with no points)."""
        return self.max_score > 0 and self.score >= PASS_FRACTION * self.max_score

    def to_dict(self) -> dict:
        """The ``--json`` shape: chapter, file, tests_dir, score, max_score, passed, and a list of tests."""
        return {
            "chapter": self.chapter,
            "file": self.file,
            "tests_dir": self.tests_dir,
            "score": self.score,
            "max_score": self.max_score,
            "passed": self.passed,
            "tests": [asdict(t) for t in self.tests],
        }


# --- finding the files -------------------------------------------------------------------------------------


def normalize_chapter(chapter: str) -> str:
    """``"ch01"``, ``"01"`` and ``"1"`` all name chapter 01."""
    match = re.fullmatch(r"(?:ch)?0*(\d{1,2})", chapter.strip().lower())
    if not match:
        raise GradingError(f"chapter {chapter!r} is not a chapter name like ch01")
    return f"ch{int(match.group(1)):02d}"


def exercises_root(root: str | Path | None = None) -> Path:
    """The ``exercises/`` folder: ``root`` if given, else ``./exercises``, else the one next to the package."""
    candidates = [Path(root)] if root is not None else [Path.cwd() / "exercises", REPO_EXERCISES]
    for candidate in candidates:
        if (candidate / "tests").is_dir():
            return candidate.resolve()
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"no exercises folder (with a tests/ folder inside) found; tried {tried}; use --root")


def find_exercise_file(chapter: str, directory: Path) -> Path:
    """The one ``<chapter>_*.py`` module in ``directory`` (``ch01_metrics.py`` for ch01)."""
    matches = sorted(directory.glob(f"{chapter}_*.py"))
    if len(matches) != 1:
        raise FileNotFoundError(f"expected one {chapter}_*.py in {directory}, found {len(matches)}; use --file")
    return matches[0]


def find_test_files(chapter: str, tests_dir: Path) -> list[Path]:
    """The chapter's graded test files: ``test_<chapter>*.py`` in ``tests_dir``."""
    matches = sorted(tests_dir.glob(f"test_{chapter}*.py"))
    if not matches:
        raise FileNotFoundError(f"no test_{chapter}*.py in {tests_dir}")
    return matches


def load_exercise(path: str | Path | None = None, chapter: str | None = None) -> ModuleType:
    """Import the module at ``path`` (default: ``$MINSERVE_EXERCISE_FILE``) fresh, under a private name.

    With a ``chapter`` (default: ``$MINSERVE_EXERCISE_CHAPTER``), the file must keep to that chapter's
    import rule, checked before it runs and again once loaded; else :class:`~minserve.exercise_rules.ForbiddenImport`.
    """
    path = path or os.environ.get(EXERCISE_FILE_ENV)
    chapter = chapter or os.environ.get(EXERCISE_CHAPTER_ENV)
    if not path:
        raise RuntimeError(f"set {EXERCISE_FILE_ENV} to the exercise file, or run the tests with `minserve grade`")
    path = Path(path)
    if chapter:
        exercise_rules.check_source(chapter, path)
    spec = importlib.util.spec_from_file_location(f"minserve_exercise_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not cached in sys.modules: each test gets the file as it is now
    if chapter:
        exercise_rules.check_module(chapter, module)
    return module


# --- grading -----------------------------------------------------------------------------------------------


def grade(
    chapter: str,
    file: str | Path | None = None,
    tests_dir: str | Path | None = None,
    root: str | Path | None = None,
    solutions: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    hidden: bool = False,
    select: str | None = None,
) -> tuple[GradeReport, str]:
    """Grade one exercise file; returns the report and pytest's own output (for ``--verbose``).

    ``file`` defaults to the chapter's stub in the exercises folder (or, with ``solutions``, the reference
    solution); ``tests_dir`` defaults to ``exercises/tests``, or with ``hidden`` to the instructor's hidden
    tests (:data:`HIDDEN_TESTS`); instructors may point it at a folder of their own. ``select`` (a pytest
    ``-k`` expression) runs only the tests it names; the others are listed as ``deselected`` with 0 points,
    so the score plus their points bounds the full score from above (how the repository's tests show that a
    wrong solution fails without grading every test).
    """
    chapter = normalize_chapter(chapter)
    if hidden and tests_dir is not None:
        raise GradingError("--hidden grades exercises/solutions/hidden; do not pass --tests too")
    needs_root = file is None or tests_dir is None
    base = exercises_root(root) if needs_root else None
    if file is None:
        file = find_exercise_file(chapter, base / "solutions" if solutions else base)
    file = Path(file).resolve()
    if not file.is_file():
        raise FileNotFoundError(f"exercise file {file} not found")
    if tests_dir is not None:
        tests = Path(tests_dir).resolve()
    else:
        tests = base / HIDDEN_TESTS if hidden else base / "tests"
        if hidden and not tests.is_dir():
            raise FileNotFoundError(f"no hidden tests in {tests}: a learner's copy of the course has none")
    test_files = find_test_files(chapter, tests)
    results, output = _run_pytest(chapter, file, tests, test_files, timeout_s, select)
    return GradeReport(chapter, str(file), str(tests), results), output


def _run_pytest(
    chapter: str, file: Path, tests: Path, test_files: list[Path], timeout_s: float, select: str | None = None
) -> tuple[list[GradedTest], str]:
    with tempfile.TemporaryDirectory(prefix="minserve-grade-") as scratch:
        results_path = Path(scratch) / "results.json"
        command = [sys.executable, "-m", "minserve.grade", str(results_path), str(tests), *map(str, test_files)]
        env = {
            **os.environ,
            EXERCISE_FILE_ENV: str(file),
            EXERCISE_CHAPTER_ENV: chapter,
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        env.pop(SELECT_ENV, None)
        if select is not None:
            env[SELECT_ENV] = select
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as error:
            raise GradingError(f"grading took longer than {timeout_s:.0f} s; is there an endless loop?") from error
        output = done.stdout + done.stderr
        if not results_path.exists():
            raise GradingError(f"the test run crashed (exit code {done.returncode}):\n{output[-2000:]}")
        payload = json.loads(results_path.read_text())
    if payload["collection_errors"]:
        raise GradingError("the graded tests could not be collected:\n" + "\n".join(payload["collection_errors"]))
    return [GradedTest(**t) for t in payload["tests"]], output


# --- the child process: pytest with a plugin that supplies `exercise` and records results -------------------


def _interpret_triton_without_a_gpu() -> None:
    """Chapter 03 grades Triton kernels: without a CUDA GPU they run under Triton's interpreter, which is
    chosen by an environment variable read when triton is first imported, so it is set before any test (or
    an instructor's hidden tests, or the learner's file) can import it. A value already set is kept."""
    if importlib.util.find_spec("triton") is None or "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _fail_property_tests_without_shrinking() -> None:
    """A failing property test is graded by its points and its hint, not by its smallest counterexample, so
    hypothesis skips shrinking (which reruns a failing test many times: most of a stub's grading time). The
    profile is loaded before the tests are imported, so their own ``settings(...)`` inherit it."""
    try:
        from hypothesis import Phase, settings
    except ImportError:
        return
    settings.register_profile("minserve-grade", phases=(Phase.explicit, Phase.reuse, Phase.generate))
    settings.load_profile("minserve-grade")


def _worker(results_path: str, rootdir: str, test_files: list[str]) -> int:
    """Run pytest on ``test_files`` and write the results as JSON to ``results_path``."""
    import pytest  # only the child needs pytest; `minserve --help` stays fast

    _interpret_triton_without_a_gpu()
    _fail_property_tests_without_shrinking()

    class GradePlugin:
        def __init__(self) -> None:
            self.tests: dict[str, dict] = {}
            self.collection_errors: list[str] = []

        def pytest_configure(self, config: pytest.Config) -> None:
            config.addinivalue_line("markers", "points(n): what the test is worth in the grade (default 1)")

        @pytest.fixture
        def exercise(self) -> ModuleType:
            """The learner's module, imported fresh for each test (after its chapter's import rule is checked)."""
            return load_exercise()

        @pytest.hookimpl(tryfirst=True)  # before -k deselects any: every test is listed with its points
        def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
            for item in items:
                marker = item.get_closest_marker("points")
                worth = int(marker.args[0]) if marker else 1
                doc = getattr(getattr(item, "obj", None), "__doc__", None)
                hint = " ".join(doc.strip().split("\n\n")[0].split()) if doc else None
                self.tests[item.nodeid] = asdict(GradedTest(item.name, item.nodeid, "passed", worth, worth, hint))

        def pytest_deselected(self, items: list[pytest.Item]) -> None:
            for item in items:
                self.tests[item.nodeid].update(outcome="deselected", points=0)

        def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
            test = self.tests.get(report.nodeid)
            if test is None or not report.failed or test["outcome"] != "passed":
                return  # keep the first failure of a test (a setup error, say, over its teardown)
            test["outcome"] = "error" if report.when == "setup" else "failed"
            test["points"] = 0
            test["message"] = _failure_message(report)

        def pytest_collectreport(self, report: pytest.CollectReport) -> None:
            if report.failed:
                self.collection_errors.append(f"{report.nodeid}: {_failure_message(report)}")

    plugin = GradePlugin()
    # No ini file (the repository's pytest settings are for its own tests), and no conftest.py from above
    # the tests folder: a grading run behaves the same wherever the folder sits.
    args = ["-q", "-c", os.devnull, "--rootdir", rootdir, "--confcutdir", rootdir, "-p", "no:cacheprovider"]
    args.append("--strict-markers")
    if importlib.util.find_spec("pytest_timeout") is not None:
        args.append(f"--timeout={PER_TEST_TIMEOUT_S}")
    if os.environ.get(SELECT_ENV):
        args += ["-k", os.environ[SELECT_ENV]]
    exit_code = pytest.main([*args, *test_files], plugins=[plugin])
    payload = {"tests": list(plugin.tests.values()), "collection_errors": plugin.collection_errors}
    Path(results_path).write_text(json.dumps(payload))
    return int(exit_code)


def _failure_message(report: object) -> str:
    """The one line pytest would put in its short summary: ``NotImplementedError``, ``assert 1 == 2``, …"""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    text = crash.message if crash is not None else str(getattr(report, "longrepr", ""))
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()] or ["failed"]
    if lines[0].startswith('File "'):  # a SyntaxError's message starts with its location; its name comes last
        return f"{lines[-1]} ({lines[0]})"[:200]
    return lines[0][:200]


# --- the score table and the command -----------------------------------------------------------------------


def format_report(report: GradeReport) -> str:
    """The score table a learner reads: one row per test, hints under the failures, the total."""
    width = max([len(t.name) for t in report.tests] + [len("total")]) + 2
    lines = [f"{report.chapter}: {report.file}", "", f"{'test':<{width}}{'points':>7}  result"]
    for t in report.tests:
        result = t.outcome if t.outcome in ("passed", "deselected") else f"{t.outcome}: {t.message}"
        lines.append(f"{t.name:<{width}}{f'{t.points}/{t.max_points}':>7}  {result}")
        if t.outcome not in ("passed", "deselected") and t.hint:
            lines.append(f"    hint: {t.hint}")
    verdict = "passed" if report.passed else f"below the pass line ({PASS_FRACTION:.0%})"
    lines += ["", f"{'total':<{width}}{f'{report.score}/{report.max_score}':>7}  {verdict}"]
    return "\n".join(lines)


def run_grade_command(args: argparse.Namespace) -> int:
    """``minserve grade``: exit code 0 for full marks, 1 for fewer, 2 when grading could not run."""
    if args.export_student:
        return run_export_command(args, exercises_root(args.root))
    if args.chapter is None:
        raise GradingError("name a chapter (minserve grade ch01), or --export-student DIR")
    report, output = grade(args.chapter, args.file, args.tests, args.root, args.solutions, args.timeout, args.hidden)
    if args.verbose:
        print(output, file=sys.stderr)
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.score == report.max_score else 1


def add_grade_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``grade`` to the ``minserve`` command's subcommands."""
    parser = subparsers.add_parser(
        "grade",
        help="grade a chapter's exercise",
        description="Run a chapter's graded tests against an exercise file and print the score.",
    )
    parser.add_argument("chapter", nargs="?", help="ch01, ch02, … (or 01, 1)")
    parser.add_argument("--file", help="the exercise file (default: exercises/<chapter>_*.py)")
    parser.add_argument("--solutions", action="store_true", help="grade the reference solutions instead")
    parser.add_argument("--tests", help="a folder of test_<chapter>*.py files (default: exercises/tests)")
    parser.add_argument(
        "--hidden", action="store_true", help="grade against the instructor's hidden tests (exercises/solutions/hidden)"
    )
    parser.add_argument("--root", help="the exercises folder (default: ./exercises, else the repository's)")
    parser.add_argument("--json", action="store_true", help="print machine-readable results")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds for the whole run")
    parser.add_argument("-v", "--verbose", action="store_true", help="also print pytest's output to stderr")
    parser.add_argument(
        "--export-student",
        metavar="DIR",
        help="instead of grading, copy the course to DIR for learners: no solutions, no --tests folder",
    )
    parser.set_defaults(run=run_grade_command)
    return parser


if __name__ == "__main__":
    # The child process of _run_pytest: python -m minserve.grade RESULTS_JSON ROOTDIR TEST_FILE...
    sys.exit(_worker(sys.argv[1], sys.argv[2], sys.argv[3:]))
