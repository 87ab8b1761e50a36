"""Starting minserve's own processes (tensor-parallel ranks, the server's engine core) with ``spawn``."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def spawning_without_the_main_script() -> Iterator[None]:
    """Start spawned processes that do not run the user's script again.

    The spawn start method imports the parent's ``__main__`` again in every child, so that functions defined
    there can be unpickled. A script that builds ``LLM(tensor_parallel_size=2)`` or a server's engine at top
    level, with no ``if __name__ == "__main__":`` guard, would then build an engine in every child as it
    starts, which multiprocessing stops with its "bootstrapping phase" error. minserve's children (a rank, the
    engine core) run only minserve's code with an :class:`~minserve.config.EngineConfig` of plain values and
    need nothing from the script, so while they start, spawn is not told where the script is: its
    ``__file__`` and ``__spec__`` are hidden for the duration of ``Process.start()``, which reads them at once.
    """
    main = sys.modules["__main__"]
    saved_file, saved_spec = main.__dict__.pop("__file__", None), getattr(main, "__spec__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = saved_spec
        if saved_file is not None:
            main.__file__ = saved_file
