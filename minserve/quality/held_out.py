"""A held-out English text that ships with Python: the interactive help's topics (``pydoc_data.topics``).

It is technical English prose (the language reference's sections on statements, operators, types…), about
465,000 characters on Python 3.11, and it is on every machine that has Python, so a perplexity measured on
it can be reproduced offline anywhere. No model in this course was trained on it by us; the embedded models
were trained on the standard library's ``.py`` files, which do not include it.
"""

from __future__ import annotations

from pydoc_data.topics import topics

SEPARATOR = "\n\n"


def held_out_text(max_chars: int | None = None) -> str:
    """The topics' texts in the order of their names, joined by blank lines (deterministic for a given
    Python), cut to the first ``max_chars`` characters when given."""
    text = SEPARATOR.join(topics[name].strip() for name in sorted(topics))
    return text if max_chars is None else text[:max_chars]
