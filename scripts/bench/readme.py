"""Write a benchmark's table into the README, between its two markers (``<!-- NAME-benchmark:start -->`` ...)."""

from __future__ import annotations

import os
import re


def replace_section(path: str, start: str, end: str, text: str) -> None:
    """Replace the text between the markers ``start`` and ``end`` in the file at ``path``. Relative link targets in
    ``text`` (relative to the working directory, the repository root) are rewritten relative to the file's folder."""
    to_cwd = os.path.relpath(os.getcwd(), os.path.dirname(os.path.abspath(path)))
    if to_cwd != ".":
        text = re.sub(r"\]\((?![a-z]+:|#|/)", lambda _: f"]({to_cwd}/", text)
    with open(path) as f:
        readme = f.read()
    if start not in readme or end not in readme:
        raise SystemExit(f"{path} has no {start} ... {end} section")
    readme = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: f"{start}\n{text}\n{end}", readme,
                    flags=re.S)
    with open(path, "w") as f:
        f.write(readme)


def add_report_arguments(parser, readme: bool = True) -> None:
    """A benchmark's --out (its results CSV), --report CSV (print the table instead) and, where the README has the
    table between markers, --readme (write it there too)."""
    parser.add_argument("--out")
    parser.add_argument("--report", metavar="CSV", help="print the table of a results CSV instead (any machine)")
    if readme:
        parser.add_argument("--readme", help="with --report: write the table between the README's markers")


def reported(parser, args, report, start: str | None = None, end: str | None = None) -> bool:
    """With --report: print ``report(CSV)`` (and write it between ``start`` and ``end`` of --readme), True.
    Otherwise the benchmark runs, which needs --out: False."""
    if args.report:
        table = report(args.report)
        print(table)
        if getattr(args, "readme", None):
            replace_section(args.readme, start, end, table)
        return True
    if not args.out:
        parser.error("--out is required to run the benchmark")
    return False
