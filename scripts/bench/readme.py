"""Write a benchmark's table into the README, between its two markers (``<!-- NAME-benchmark:start -->`` ...)."""

from __future__ import annotations

import re


def replace_section(path: str, start: str, end: str, text: str) -> None:
    """Replace the text between the markers ``start`` and ``end`` in the file at ``path``."""
    with open(path) as f:
        readme = f.read()
    if start not in readme or end not in readme:
        raise SystemExit(f"{path} has no {start} ... {end} section")
    readme = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: f"{start}\n{text}\n{end}", readme,
                    flags=re.S)
    with open(path, "w") as f:
        f.write(readme)
