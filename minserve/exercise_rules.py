"""What an exercise file may import, so that a learner's module cannot pass by re-exporting minserve.

Most chapters ask for the idea rebuilt from scratch: "use only the standard library". minserve itself holds a
working answer to nearly every exercise (``minserve.slo.percentile``, the engine's detokenizer and block
manager, its Triton kernels), so without a rule ``from minserve.slo import percentile`` would score the
points. :data:`ALLOWED_IMPORTS` says, per chapter, which modules the learner's file may import; the grader
checks a file twice before the tests use it:

* statically (:func:`forbidden_imports`): every ``import`` and ``from … import`` in the file, at any depth
  (inside functions too), names an allowed module; relative imports and dynamic imports (``__import__``,
  ``importlib``, ``runpy``) are refused outright, since no exercise needs them;
* on the loaded module (:func:`foreign_names`): every module-level name is defined in the file itself or
  comes from an allowed module, which catches a re-export that slipped past the first check.

An allowance names a module (and so its submodules), or one name inside a module: chapter 09 allows
``minserve.admission.AdmissionPolicy``, the interface a learner's policy plugs into, and not the
module's own policies beside it, which are the answer.

This is a guard against the honest shortcut, not a sandbox: the learner's code runs with full rights.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import ModuleType

STDLIB = "stdlib"  # in an allowance: any module of this Python's standard library (sys.stdlib_module_names)
# Modules that load other modules by name or path: a way around the static check, and no exercise needs one.
DYNAMIC_IMPORTERS = frozenset({"importlib", "runpy", "imp", "pkgutil", "zipimport"})

ADMISSION_INTERFACE = ("AdmissionPolicy", "QueueState", "Refusal", "RequestFacts")  # what ch09's policy reads
# Per chapter: the modules (and their submodules) a learner's file may import. A chapter not listed here
# (an instructor's own) has no rule.
ALLOWED_IMPORTS: dict[str, frozenset[str]] = {
    "ch01": frozenset({STDLIB}),
    "ch02": frozenset({STDLIB}),  # the tokenizer is handed in by the tests; nothing of minserve is needed
    "ch03": frozenset({STDLIB, "torch", "triton"}),  # not minserve.kernels, whose decode attention is an answer
    "ch04": frozenset({STDLIB}),
    # The policy and the scheduler plug into the real engine: the policy's base class, the sequence type, the
    # block manager that owns KV memory and the batch type the core consumes; not the engine's Scheduler.
    "ch05": frozenset(
        {
            STDLIB,
            "minserve.engine.policies",
            "minserve.engine.sequence",
            "minserve.engine.block_manager",
            "minserve.engine.batch",
        }
    ),
    "ch06": frozenset({STDLIB, "torch"}),  # not minserve.parallel, whose sharding is an answer
    "ch07": frozenset({STDLIB, "torch"}),  # not minserve.quant, whose formats.quantize_int4 is an answer
    # The proposer plugs into the real engine: the sequence type it reads and the engine's Proposer protocol,
    # by name; not the rest of minserve.engine.speculative, whose NgramProposer and verify are the answer.
    "ch08": frozenset({STDLIB, "torch", "minserve.engine.sequence", "minserve.engine.speculative.proposer.Proposer"}),
    # The server's admission interface, name by name: not minserve.admission whole (its DeadlineAware
    # is the answer).
    "ch09": frozenset({STDLIB} | {f"minserve.admission.{name}" for name in ADMISSION_INTERFACE}),
    "ch10": frozenset({STDLIB}),
}


class ForbiddenImport(ImportError):
    """The exercise file imports (or re-exports) a module its chapter does not allow."""


def is_allowed(module: str, allowed: frozenset[str]) -> bool:
    """Whether the dotted ``module`` is allowed: a standard-library module (under ``STDLIB``), or equal to
    or inside one of the ``allowed`` names (``minserve.engine.policies`` allows ``minserve.engine.policies.x``)."""
    top = module.split(".")[0]
    if top in DYNAMIC_IMPORTERS:
        return False
    if STDLIB in allowed and (top in sys.stdlib_module_names or top == "__future__"):
        return True
    return any(module == name or module.startswith(name + ".") for name in allowed if name != STDLIB)


def describe(allowed: frozenset[str]) -> str:
    """``"the standard library, torch and triton"``: what a chapter allows, for a message."""
    names = (["the standard library"] if STDLIB in allowed else []) + sorted(n for n in allowed if n != STDLIB)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def forbidden_imports(source: str, allowed: frozenset[str]) -> list[str]:
    """Each import in ``source`` (Python code) that ``allowed`` refuses, as ``"minserve.slo (line 3)"``.

    Raises ``SyntaxError`` for code that does not parse (the grader reports it as the module failing to
    import). ``from pkg import name`` is allowed when ``pkg`` is, or when ``pkg.name`` is.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if not is_allowed(alias.name, allowed)]
        elif isinstance(node, ast.ImportFrom):
            if node.level > 0:
                found.append((node.lineno, "a relative import " + "." * node.level + (node.module or "")))
            elif not is_allowed(node.module or "", allowed) and not all(
                is_allowed(f"{node.module}.{alias.name}", allowed) for alias in node.names
            ):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and _called_name(node.func) in {"__import__", "import_module"}:
            found.append((node.lineno, f"a dynamic import {_called_name(node.func)}(…)"))
    return [f"{name} (line {line})" for line, name in sorted(found)]


def _called_name(func: ast.expr) -> str | None:
    """``f`` for ``f(…)`` and ``m.f(…)``; None for anything else called."""
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def foreign_names(module: ModuleType, allowed: frozenset[str]) -> list[str]:
    """Module-level names of a loaded exercise that come from a module ``allowed`` refuses, as
    ``"percentile (from minserve.slo)"``. A function or class counts by its ``__module__`` (and is allowed
    by its module or by its own dotted name), a module by its name, any other value by its type's; what
    the file defines itself is always fine."""
    found = []
    for name, value in vars(module).items():
        if name.startswith("__"):
            continue
        origin, qualname = _origin(value)
        if not origin or origin == module.__name__ or is_allowed(origin, allowed):
            continue
        if qualname is None or not is_allowed(f"{origin}.{qualname}", allowed):
            found.append(f"{name} (from {origin})")
    return found


def _origin(value: object) -> tuple[str | None, str | None]:
    """The module ``value`` comes from, and its name there (None for a module)."""
    if isinstance(value, ModuleType):
        return value.__name__, None
    defined = value if callable(value) else type(value)
    origin, qualname = getattr(defined, "__module__", None), getattr(defined, "__qualname__", None)
    return (origin if isinstance(origin, str) else None), (qualname if isinstance(qualname, str) else None)


def check_source(chapter: str, path: str | Path) -> None:
    """Raise :class:`ForbiddenImport` when the file at ``path`` imports what ``chapter`` does not allow."""
    allowed = ALLOWED_IMPORTS.get(chapter)
    if allowed is None:
        return
    found = forbidden_imports(Path(path).read_text(encoding="utf-8"), allowed)
    if found:
        raise ForbiddenImport(
            f"{chapter} may import only {describe(allowed)}; {Path(path).name} imports " + _list(found)
        )


def check_module(chapter: str, module: ModuleType) -> None:
    """Raise :class:`ForbiddenImport` when the loaded exercise holds names from a module not allowed."""
    allowed = ALLOWED_IMPORTS.get(chapter)
    found = foreign_names(module, allowed) if allowed is not None else []
    if found:
        raise ForbiddenImport(f"{chapter} may use only {describe(allowed)}; the module holds " + _list(found))


def _list(items: list[str], most: int = 3) -> str:
    return "; ".join(items[:most]) + (f"; and {len(items) - most} more" if len(items) > most else "")
