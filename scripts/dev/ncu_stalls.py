"""Summarise where a kernel's warps stall, from Nsight Compute's per-instruction source view (sm_90 SASS).

On a GPU machine where ncu reads the hardware counters (leave the clocks alone):

    ncu --clock-control none -k regex:attention_fp8_fwd_hopper_kernel -c 1 \\
        --section WarpStateStats --section SourceCounters -o /tmp/fwd python3 -P script_that_calls_the_op.py
    ncu -i /tmp/fwd.ncu-rep --page source --csv --print-source sass > /tmp/fwd.csv
    python3 scripts/ncu_stalls.py /tmp/fwd.csv 40

prints the sampled stall reasons overall, per opcode, and the hottest instructions with their index in the SASS
listing (to place them in the loops of ``nvdisasm``'s output). Samples cover every warp, a warp-specialised
kernel's idle producer warps included.
"""

from __future__ import annotations

import collections
import csv
import sys


ALL_SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:  # '-' for no value
        return 0.0


def _opcode(source: str) -> str:
    words = source.split()
    if words and words[0].startswith("@"):  # predicated instruction
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    path, hottest = argv[0], int(argv[1]) if len(argv) > 1 else 30
    rows = list(csv.reader(open(path, newline="")))
    header = next(row for row in rows if "Source" in row)
    column = {name: i for i, name in enumerate(header)}
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    body = rows[rows.index(header) + 1:]
    total, per_opcode, per_instruction = collections.Counter(), collections.defaultdict(collections.Counter), []
    for index, row in enumerate(body):
        source = row[column["Source"]].strip()
        counts = {reason: _number(row[column[reason]]) for reason in reasons}
        total.update(counts)
        per_opcode[_opcode(source)].update(counts)
        per_instruction.append((_number(row[column[ALL_SAMPLES]]), index, source, counts))
    samples = sum(total.values()) or 1.0

    def share(counter, n):
        return ", ".join(f"{reason[len('stall_'):]} {value / samples:.1%}" for reason, value in counter.most_common(n))

    print(f"samples: {samples:.0f}")
    print(f"by reason: {share(total, 10)}")
    for opcode, counts in sorted(per_opcode.items(), key=lambda item: -sum(item[1].values()))[:14]:
        print(f"  {opcode:10s} {sum(counts.values()) / samples:6.1%}  {share(counts, 3)}")
    print("hottest instructions (index in the SASS listing):")
    for count, index, source, counts in sorted(per_instruction, key=lambda item: -item[0])[:hottest]:
        print(f"  #{index:5d} {count / samples:6.2%}  {source[:60]:60s} {share(collections.Counter(counts), 2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
