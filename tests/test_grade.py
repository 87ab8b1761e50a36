"""The grader can fail: the reference solutions score full marks, the untouched stubs score zero, a file that
re-exports minserve scores nothing, a deliberately wrong solution scores below the pass line (public and
hidden tests), and the learner's copy of the course holds no solution and no hidden test."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from minserve import exercise_rules, grade, handout, slo

EXERCISES = Path(__file__).resolve().parents[1] / "exercises"
# In a learner's copy (minserve grade --export-student) there are no solutions to grade.
SOLUTIONS_HERE = not (EXERCISES.parent / handout.MARKER).is_file()
needs_solutions = pytest.mark.skipif(not SOLUTIONS_HERE, reason="a learner's copy of the course has no solutions")
CHAPTERS = {
    "ch01": "ch01_metrics.py",
    "ch02": "ch02_detokenizer.py",
    "ch03": "ch03_triton.py",
    "ch04": "ch04_kv_cache.py",
    "ch05": "ch05_scheduling.py",
    "ch06": "ch06_parallel.py",
    "ch07": "ch07_quantization.py",
    "ch08": "ch08_speculative.py",
    "ch09": "ch09_admission.py",
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


@needs_solutions
def test_every_chapter_with_tests_has_a_stub_and_a_solution():
    chapters = {path.stem.removeprefix("test_")[:4] for path in (EXERCISES / "tests").glob("test_ch*.py")}
    assert chapters == set(CHAPTERS)
    for chapter, name in CHAPTERS.items():
        assert grade.find_exercise_file(chapter, EXERCISES).name == name
        assert grade.find_exercise_file(chapter, EXERCISES / "solutions").name == name


@needs_solutions
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


# The command line grades ch01; the other chapters are graded in this process (grade.grade, whose report the
# command prints): the same grading child runs their tests, without ~3 s of a second interpreter's start-up each.
THROUGH_THE_CLI = "ch01"


def _public_and_hidden(chapter: str, folder: Path) -> Path:
    """A tests folder holding the chapter's public tests and, where it has them, its hidden ones: one grading
    run judges both sets (each chapter's child process, model loads and fixtures paid once, not twice)."""
    folder.mkdir()
    shutil.copy(EXERCISES / "tests" / f"test_{chapter}.py", folder)
    if chapter in HIDDEN:
        shutil.copy(EXERCISES / grade.HIDDEN_TESTS / f"test_{chapter}_hidden.py", folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_stubs_score_zero_with_hints(chapter, tmp_path):
    if chapter == THROUGH_THE_CLI:
        done = _cli(chapter, cwd=EXERCISES.parent)
        assert done.returncode == 1, done.stderr
        table = done.stdout
    else:
        tests = _public_and_hidden(chapter, tmp_path / "tests") if SOLUTIONS_HERE else None
        report, output = grade.grade(chapter, tests_dir=tests)
        assert report.score < report.max_score, output  # the command's exit code 1
        table = grade.format_report(report)
    total_line = table.strip().splitlines()[-1]
    assert total_line.split()[0] == "total" and total_line.split()[1].startswith("0/")
    assert "NotImplementedError" in table and "hint: " in table


@needs_solutions
@pytest.mark.slow
@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_solutions_score_full_marks_as_json(chapter, tmp_path):
    """Public and hidden tests at once: the reference scores full marks on both."""
    if chapter == THROUGH_THE_CLI:
        done = _cli(chapter, "--solutions", "--json")
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
    else:
        report, output = grade.grade(chapter, solutions=True, tests_dir=_public_and_hidden(chapter, tmp_path / "t"))
        assert report.score == report.max_score, output  # the command's exit code 0
        result = json.loads(json.dumps(report.to_dict()))  # what --json prints
    assert set(result) == {"chapter", "file", "tests_dir", "score", "max_score", "passed", "tests"}
    assert result["passed"] is True
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
        grade.grade("ch01", file=EXERCISES / "ch01_metrics.py", tests_dir=tmp_path)


# --- hidden tests, the pass line and wrong solutions ----------------------------------------------------------

# The chapters whose exercises have hidden tests (exercises/solutions/hidden/test_<chapter>_hidden.py).
HIDDEN = ("ch01", "ch02", "ch03", "ch04", "ch05", "ch06", "ch07", "ch08", "ch09", "ch10")
# Per chapter, a deliberately wrong solution: the reference with one line changed, and the tests it fails (a
# pytest -k expression for the public and one for the hidden tests). Only those are run; every other test is
# counted as passed, so the score bounds the full score from above, and the bound must be below the pass line.
MISTAKES = {
    "ch01 divides TPOT by every token": (
        "ch01",
        ("ttft_s(arrival_s, token_times_s)) / (n - 1)", "ttft_s(arrival_s, token_times_s)) / n"),
        {"public": "tpot_curriculum or tpot_counts or goodput_agrees", "hidden": "metric_agrees"},
    ),
    "ch02 releases half a character": (
        "ch02",
        ("if len(window) <= len(before) or is_incomplete(window):", "if len(window) <= len(before):"),
        {"public": "emoji or cjk or deltas_join", "hidden": "other_scripts or stays_bounded"},
    ),
    "ch03 reads slots past the context": (
        "ch03",
        ("in_context = block * BLOCK_SIZE + slots < context_len", "in_context = slots < BLOCK_SIZE"),
        {"public": "matches_float64 or grouped or block_sizes or 16bit", "hidden": "paged_shapes or bfloat16"},
    ),
    "ch04 shares a cached block without taking a reference": (
        "ch04",
        ("            self.ref_counts[block_id] += 1\n            shared.append(block_id)",
         "            shared.append(block_id)"),
        {"public": "shared_prefix or stay_cached or eviction_is_lru or random_workloads", "hidden": "larger_caches"},
    ),
    "ch05 prefills every prompt whole": (
        "ch05",
        ("return min(num_uncomputed, budget) if self.enable_chunked_prefill else num_uncomputed",
         "return num_uncomputed"),
        {"public": "token_budget or chunked or itl", "hidden": "budget_seats or itl"},
    ),
    "ch06 adds the bias on every rank": (
        "ch06",
        ("    if bias is not None and rank == 0:", "    if bias is not None:"),
        {"public": "partial_sums or row_parallel_over_gloo or mlp_over_gloo", "hidden": "mlp_of_other_widths"},
    ),
    "ch07 rounds down, not to nearest": (
        "ch07",
        ("codes = torch.round(", "codes = torch.floor("),
        {"public": "gaussian or outliers or off_centre", "hidden": "budgets or outliers or below_zero"},
    ),
    "ch08 resamples from p, not the residual": (
        "ch08",
        ("_residual(p_next, q_next)", "p_next"),
        {"public": "emitted_tokens_follow", "hidden": "exactness_on or own_distributions"},
    ),
    "ch09 aims at the SLO itself": (
        "ch09",
        ("self.ttft_slo_s, self.headroom = ttft_slo_s, headroom", "self.ttft_slo_s, self.headroom = ttft_slo_s, 1.0"),
        {"public": "admitted_requests_meet_the_slo or refuses_fast", "hidden": "meet_other_slos"},
    ),
    "ch10 times the pool's requests from its late sends": (
        "ch10",
        ('    start = record["intended_s"]', '    start = record["sent_s"]'),
        {"public": "pool_of_workers", "hidden": "workers"},
    ),
}  # fmt: skip


def test_the_pass_line():
    def report(*points: tuple[int, int]) -> grade.GradeReport:
        tests = [grade.GradedTest(f"t{i}", f"t{i}", "passed", got, worth) for i, (got, worth) in enumerate(points)]
        return grade.GradeReport("ch01", "mine.py", "tests", tests)

    assert report((4, 4), (0, 1)).passed and not report((3, 4), (0, 1)).passed  # 80 % passes, 60 % does not
    assert not report().passed
    assert "below the pass line (80%)" in grade.format_report(report((0, 5))).splitlines()[-1]
    with pytest.raises(grade.GradingError, match="--hidden"):
        grade.grade("ch05", tests_dir=EXERCISES / "tests", hidden=True)


@needs_solutions
def test_every_hidden_test_file_names_a_chapter_with_an_exercise():
    hidden = sorted(path.name for path in (EXERCISES / grade.HIDDEN_TESTS).glob("test_ch*.py"))
    assert hidden == [f"test_{chapter}_hidden.py" for chapter in HIDDEN]


@needs_solutions
@pytest.mark.slow
def test_hidden_grades_the_instructors_folder():
    """``hidden=True`` (``minserve grade --hidden``) runs exercises/solutions/hidden; that each hidden set gives
    the reference full marks and the stub zero is checked with the public tests above, in one run each."""
    solution, _ = grade.grade("ch08", solutions=True, hidden=True, select="contract_and_continuations")
    assert solution.tests_dir.endswith("solutions/hidden")
    assert solution.tests and all("test_ch08_hidden.py::" in t.nodeid for t in solution.tests)
    ran = [t for t in solution.tests if t.outcome != "deselected"]
    assert ran and all(t.points == t.max_points for t in ran), grade.format_report(solution)


@needs_solutions
@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_wrong_solution_scores_below_the_pass_line(mistake, tmp_path):
    """Public and hidden tests in one grading run (a folder holding both), each set judged on its own."""
    chapter, (right, wrong), selects = MISTAKES[mistake]
    source = (EXERCISES / "solutions" / CHAPTERS[chapter]).read_text()
    assert right in source, "the reference solution changed: update the mistake"
    wrong_file = tmp_path / CHAPTERS[chapter]
    wrong_file.write_text(source.replace(right, wrong))
    both = tmp_path / "tests"
    both.mkdir()
    shutil.copy(EXERCISES / "tests" / f"test_{chapter}.py", both)
    shutil.copy(EXERCISES / grade.HIDDEN_TESTS / f"test_{chapter}_hidden.py", both)
    select = " or ".join(f"({expression})" for expression in selects.values())
    report, _ = grade.grade(chapter, file=wrong_file, tests_dir=both, select=select)
    for tests in selects:
        in_set = [t for t in report.tests if ("_hidden.py" in t.nodeid) == (tests == "hidden")]
        ran = [t for t in in_set if t.outcome != "deselected"]
        assert ran and all(t.points == 0 for t in ran), f"a solution that {mistake} kept points: {ran}"
        max_score = sum(t.max_points for t in in_set)
        best_possible = max_score - sum(t.max_points for t in ran)  # every test not run, passed
        assert best_possible < grade.PASS_FRACTION * max_score, (tests, best_possible, max_score)


# --- what an exercise may import -----------------------------------------------------------------------------

STDLIB_ONLY = exercise_rules.ALLOWED_IMPORTS["ch01"]


def test_every_chapter_says_what_its_exercise_may_import():
    assert set(exercise_rules.ALLOWED_IMPORTS) == set(CHAPTERS)
    for chapter in ("ch01", "ch02", "ch04", "ch10"):  # their stubs say "standard library only"
        assert exercise_rules.ALLOWED_IMPORTS[chapter] == {exercise_rules.STDLIB}


def test_the_standard_library_is_allowed_and_nothing_else():
    allowed = "from __future__ import annotations\nimport math, itertools\nfrom collections import OrderedDict\n"
    assert exercise_rules.forbidden_imports(allowed, STDLIB_ONLY) == []
    refused = (
        "import numpy as np\n"
        "from minserve.slo import percentile\n"
        "def f():\n    import minserve.engine.detokenizer\n"  # inside a function, too
        "from minserve import slo\n"
        "from . import helpers\n"
        "m = __import__('minserve')\n"
        "import importlib\n"
        "s = importlib.import_module('minserve.slo')\n"
    )
    found = exercise_rules.forbidden_imports(refused, STDLIB_ONLY)
    assert found == [
        "numpy (line 1)",
        "minserve.slo (line 2)",
        "minserve.engine.detokenizer (line 4)",
        "minserve (line 5)",
        "a relative import . (line 6)",
        "a dynamic import __import__(…) (line 7)",
        "importlib (line 8)",
        "a dynamic import import_module(…) (line 9)",
    ]


def test_chapter_03_and_05_allow_what_they_build_on_and_no_answer():
    ch03, ch05 = exercise_rules.ALLOWED_IMPORTS["ch03"], exercise_rules.ALLOWED_IMPORTS["ch05"]
    assert exercise_rules.forbidden_imports("import torch\nimport triton.language as tl\n", ch03) == []
    assert exercise_rules.forbidden_imports("from minserve.kernels import rmsnorm\n", ch03) == [
        "minserve.kernels (line 1)"
    ]
    plug_in = (
        "from minserve.engine.policies import Policy\nfrom minserve.engine import sequence\n"
        "from minserve.engine.block_manager import BlockManager\nfrom minserve.engine.batch import ScheduledBatch\n"
    )
    assert exercise_rules.forbidden_imports(plug_in, ch05) == []
    assert exercise_rules.forbidden_imports("from minserve.engine.scheduler import Scheduler\n", ch05) == [
        "minserve.engine.scheduler (line 1)"  # the engine's own scheduler is the answer to part 3
    ]
    answer = "from minserve.capacity.simulator import Simulator\nfrom minserve.engine import scheduler, policies\n"
    assert exercise_rules.forbidden_imports(answer, ch05) == [
        "minserve.capacity.simulator (line 1)",
        "minserve.engine (line 2)",
    ]


def test_chapter_08_allows_the_sequence_and_the_proposer_protocol_and_not_the_engines_speculation():
    ch08 = exercise_rules.ALLOWED_IMPORTS["ch08"]
    plug_in = (
        "import torch\nfrom minserve.engine.sequence import Sequence\n"
        "from minserve.engine.speculative.proposer import Proposer\n"
    )
    assert exercise_rules.forbidden_imports(plug_in, ch08) == []
    answer = (
        "from minserve.engine.speculative.proposer import NgramProposer\n"
        "from minserve.engine.speculative.rejection import verify\nfrom minserve.engine import speculative\n"
    )
    assert exercise_rules.forbidden_imports(answer, ch08) == [
        "minserve.engine.speculative.proposer (line 1)",
        "minserve.engine.speculative.rejection (line 2)",
        "minserve.engine (line 3)",
    ]


def test_chapter_09_allows_the_admission_interface_name_by_name_and_not_its_policies():
    ch09 = exercise_rules.ALLOWED_IMPORTS["ch09"]
    interface = "from minserve.admission import AdmissionPolicy, QueueState, Refusal, RequestFacts\n"
    assert exercise_rules.forbidden_imports(interface, ch09) == []
    answer = "from minserve.admission import AdmissionPolicy, DeadlineAware\nimport minserve.admission\n"
    assert exercise_rules.forbidden_imports(answer, ch09) == [
        "minserve.admission (line 1)",
        "minserve.admission (line 2)",
    ]


def test_a_loaded_module_holding_minserve_names_is_refused():
    """The second check: what the module holds, however it got there (here: without any import statement)."""
    module = types.ModuleType("minserve_exercise_mine")
    module.percentile = slo.percentile
    module.slo = slo
    module.record = slo.RequestRecord(0.0, [0.1], 0.1, "ok")

    def ttft_s(arrival_s, token_times_s):  # written by the learner: defined in the module itself
        return token_times_s[0] - arrival_s

    ttft_s.__module__ = module.__name__
    module.ttft_s, module.math = ttft_s, __import__("math")
    assert exercise_rules.foreign_names(module, STDLIB_ONLY) == [
        "percentile (from minserve.slo)",
        "slo (from minserve.slo)",
        "record (from minserve.request_record)",
    ]
    with pytest.raises(exercise_rules.ForbiddenImport, match="may use only the standard library"):
        exercise_rules.check_module("ch01", module)


@needs_solutions
@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_every_solution_and_stub_keeps_to_its_chapters_rule(chapter):
    if chapter == "ch03":
        pytest.importorskip("triton")
    for path in (EXERCISES / CHAPTERS[chapter], EXERCISES / "solutions" / CHAPTERS[chapter]):
        grade.load_exercise(path, chapter=chapter)  # raises ForbiddenImport if not


@pytest.mark.slow
def test_a_file_that_re_exports_minserve_scores_nothing(tmp_path):
    """ch01 is the standard library only: minserve.slo's own functions would pass its tests, and score 0."""
    learner = tmp_path / "mine.py"
    learner.write_text("from minserve.slo import itl_s, percentile, tpot_s, ttft_s  # noqa: F401\n")
    module = grade.load_exercise(learner)  # without the rule: minserve's answers are right answers
    assert module.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5 and module.ttft_s(10.0, [10.25]) == 0.25
    report, _ = grade.grade("ch01", file=learner)
    assert report.max_score == 28 and report.score == 0
    for test in report.tests:
        assert test.outcome == "error" and "ForbiddenImport" in test.message, test
        assert "may import only the standard library; mine.py imports minserve.slo (line 1)" in test.message


# --- the learner's copy of the course -------------------------------------------------------------------------


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def _course(tmp_path: Path, git: bool) -> Path:
    """A small course: the real exercises (stubs, tests, solutions), a README, an instructor's hidden tests
    folder inside it and, in a git clone, an untracked note."""
    course = tmp_path / "course"
    shutil.copytree(EXERCISES, course / "exercises", ignore=shutil.ignore_patterns("__pycache__", ".hypothesis"))
    (course / "README.md").write_text("# the course\n")
    (course / "hidden").mkdir()
    (course / "hidden" / "test_ch01_hidden.py").write_text(
        "def test_e2e(exercise):\n    assert exercise.e2e_s(1, 3) == 2\n"
    )
    (course / "site").mkdir()
    (course / "site" / "index.html").write_text("<p>a build output</p>")
    if git:
        subprocess.run(["git", "init", "-q", str(course)], check=True)
        subprocess.run(["git", "-C", str(course), "add", "exercises", "README.md", "hidden"], check=True)
        (course / "untracked-notes.md").write_text("the instructor's own notes\n")
    return course


@needs_solutions
@pytest.mark.parametrize("git", [True, False], ids=["git-clone", "plain-folder"])
def test_export_student_withholds_solutions_and_hidden_tests(tmp_path, git):
    course = _course(tmp_path, git)
    out = tmp_path / "handout"
    done = _cli("--export-student", str(out), "--tests", str(course / "hidden"), "--root", str(course / "exercises"))
    assert done.returncode == 0, done.stderr
    num_withheld = len(_files(course / "exercises" / "solutions"))  # the solutions and the hidden tests
    assert f"withheld: exercises/solutions/ ({num_withheld} files), hidden/ (1 file);" in done.stdout
    copied = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert copied == sorted(
        [handout.MARKER, "README.md"]
        + [f"exercises/{name}" for name in CHAPTERS.values()]
        + [f"exercises/tests/test_{chapter}.py" for chapter in CHAPTERS]
    )
    assert json.loads((out / handout.MARKER).read_text())["withheld"] == ["exercises/solutions/", "hidden/"]
    assert ("files git does not track" in done.stdout) == git  # the untracked note and site/ are counted
    no_solutions = _cli("ch01", "--solutions", "--root", str(out / "exercises"))
    assert no_solutions.returncode == 2 and "solutions" in no_solutions.stderr
    assert not any("hidden" in name for name in copied if name.startswith("exercises/"))
    no_hidden = _cli("ch05", "--hidden", "--root", str(out / "exercises"))
    assert no_hidden.returncode == 2 and "no hidden tests" in no_hidden.stderr


@needs_solutions
def test_export_student_refuses_a_copied_solution_and_a_used_folder(tmp_path):
    course = _course(tmp_path, git=False)
    (course / "notes").mkdir()
    shutil.copy(course / "exercises" / "solutions" / "ch04_kv_cache.py", course / "notes" / "allocator.py")
    out = tmp_path / "handout"
    with pytest.raises(handout.HandoutLeak, match="notes/allocator.py is .*solutions/ch04_kv_cache.py"):
        handout.export_student(course / "exercises", out)
    assert not out.exists()
    out.mkdir()
    (out / "old.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        handout.export_student(course / "exercises", out)


@pytest.mark.slow
def test_the_learners_copy_grades_its_stubs(tmp_path):
    course = _course(tmp_path, git=True)
    out = tmp_path / "handout"
    handout.export_student(course / "exercises", out)
    done = _cli("ch01", "--root", str(out / "exercises"), "--json")
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)
    assert (result["score"], result["max_score"]) == (0, 28)
