"""The learner's copy of the course, without the reference solutions and hidden tests.

A clone of this repository hands a learner ``exercises/solutions/`` and, in its git history, every version
of it. An instructor hands out this copy instead::

    minserve grade --export-student handout/                   # the course, less exercises/solutions/
    minserve grade --export-student handout/ --tests hidden/   # …and less an instructor's hidden tests

It copies the course's files (in a git clone, the files git tracks, so nothing untracked is taken; elsewhere
every file but build outputs and caches) into a new folder, leaves out the withheld folders, writes
:data:`MARKER` there (the repository's own tests read it to skip what needs the solutions), and then checks
that no copied file has the bytes of a withheld one, wherever it sits. The copy has no git history: make it
a new repository, never a fork of this one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

MARKER = ".minserve-handout.json"  # at the top of a learner's copy: what was withheld
# Never copied when the course is not a git clone: environments, caches and what a build or a demo writes.
SKIPPED_ANYWHERE = frozenset(
    {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", ".import_linter_cache"}
)
SKIPPED_AT_TOP = frozenset({"build", "dist", "site", "test-artifacts", "minserve-tour", "bench-out"})


class HandoutLeak(ValueError):
    """A file of the learner's copy has the same bytes as a reference solution or a hidden test."""


@dataclass
class Handout:
    """What an export wrote: the folder, how many files it copied, each withheld folder's file count, and
    how many files a git clone holds that git does not track (not copied: commit them if learners need them)."""

    target: Path
    num_files: int
    withheld: dict[str, int]
    num_untracked: int = 0


def course_files(root: Path) -> list[Path]:
    """The course's files, relative to ``root``: what git tracks in a clone, else every file but
    :data:`SKIPPED_ANYWHERE` and :data:`SKIPPED_AT_TOP`."""
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True)
        tracked = sorted(Path(p) for p in listed.stdout.decode().split("\0") if p and (root / p).is_file())
        if tracked:
            return tracked
    except (OSError, subprocess.CalledProcessError):  # no git, or not a clone
        pass
    files = []
    for folder, dirs, names in os.walk(root):
        here = Path(folder).relative_to(root)
        dirs[:] = sorted(d for d in dirs if not _skipped(d, at_top=here == Path(".")))
        files += [here / name for name in names]
    return sorted(files)


def untracked_files(root: Path) -> list[str]:
    """Files of a git clone that git neither tracks nor ignores (none outside a clone)."""
    command = ["git", "-C", str(root), "ls-files", "-z", "--others", "--exclude-standard"]
    try:
        listed = subprocess.run(command, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return []
    return [p for p in listed.stdout.decode().split("\0") if p]


def _skipped(name: str, at_top: bool) -> bool:
    """Whether a folder called ``name`` holds no course files (an environment, a cache, a build output)."""
    return (
        name in SKIPPED_ANYWHERE
        or name.endswith((".egg-info", ".ipynb_checkpoints"))
        or (at_top and name in SKIPPED_AT_TOP)
    )


def export_student(exercises: Path, target: Path, hidden_tests: Path | None = None) -> Handout:
    """Copy the course that holds ``exercises/`` to ``target`` (new, or an empty folder), without
    ``exercises/solutions/`` and without ``hidden_tests`` when it lies inside the course; then check it."""
    root, target = exercises.resolve().parent, target.resolve()
    if target.exists() and any(target.iterdir()):
        raise ValueError(f"{target} is not empty; export into a new folder")
    withheld = [exercises.resolve() / "solutions"] + ([hidden_tests.resolve()] if hidden_tests else [])
    inside = [folder for folder in withheld if folder.is_relative_to(root)]  # the others are never copied
    counts = {f"{folder.relative_to(root)}/": 0 for folder in inside}
    num_files = 0
    for relative in course_files(root):
        source = (root / relative).resolve()
        holder = next((folder for folder in inside if source.is_relative_to(folder)), None)
        if holder is not None:
            counts[f"{holder.relative_to(root)}/"] += 1
        elif not source.is_relative_to(target):  # an export kept inside the course is not copied into itself
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / relative)
            num_files += 1
    target.mkdir(parents=True, exist_ok=True)
    marker = {"made_by": "minserve grade --export-student", "withheld": sorted(counts)}
    (target / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    check_no_leak(target, withheld)
    return Handout(target, num_files, counts, len(untracked_files(root)))


def check_no_leak(target: Path, withheld: list[Path]) -> None:
    """Raise :class:`HandoutLeak` if any file under ``target`` has the bytes of a (non-empty) withheld file,
    and remove ``target``: a solution copied under another name is still a solution."""
    secret = {_digest(path): path for folder in withheld if folder.is_dir() for path in _files(folder)}
    secret.pop(_digest(None), None)  # an empty __init__.py is no secret
    digests = {path: _digest(path) for path in _files(target)}
    leaks = [f"{path.relative_to(target)} is {secret[digest]}" for path, digest in digests.items() if digest in secret]
    if leaks:
        shutil.rmtree(target)
        raise HandoutLeak("the learner's copy would hold withheld files, so it was removed: " + "; ".join(leaks))


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def _digest(path: Path | None) -> str:
    """SHA-256 of a file's bytes (of no bytes for ``None``)."""
    return hashlib.sha256(path.read_bytes() if path is not None else b"").hexdigest()


def run_export_command(args: argparse.Namespace, exercises: Path) -> int:
    """``minserve grade --export-student DIR [--tests HIDDEN]``: write the copy, say what was withheld."""
    hidden = Path(args.tests) if args.tests else None
    handout = export_student(exercises, Path(args.export_student), hidden)
    withheld = [f"{label} ({n} file{'s' if n != 1 else ''})" for label, n in handout.withheld.items()]
    if hidden is not None and not hidden.resolve().is_relative_to(exercises.resolve().parent):
        withheld.append(f"{hidden} (outside the course: never copied)")
    print(f"wrote a learner's copy of the course to {handout.target} ({handout.num_files} files)")
    print(f"withheld: {', '.join(withheld)}; no copied file has the bytes of a withheld one")
    if handout.num_untracked:
        print(f"not copied: {handout.num_untracked} files git does not track (`git status`); commit what learners need")
    print("hand it out as a new repository (git init there): this repository's history holds the solutions")
    return 0
