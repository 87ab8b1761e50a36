"""scripts/build_site.py: what it changes in an executed chapter before the site renders it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_site.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("build_site", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_site"] = module
    spec.loader.exec_module(module)
    return module


build_site = _load_script()


def test_inline_and_display_math_become_mathml() -> None:
    html = build_site.tex_to_mathml("TTFT is $t_1 - t_a$, and\n\n$$\\frac{a}{b}$$")
    assert "$" not in html
    assert html.count("<math ") == 2
    assert 'display="inline"' in html and 'display="block"' in html


def test_code_and_escaped_dollars_are_left_alone() -> None:
    markdown = "run `echo $HOME $PATH`, then\n\n```bash\nexport X=$Y; echo $Z\n```\n\nit costs \\$5 and \\$6"
    assert build_site.tex_to_mathml(markdown) == markdown
