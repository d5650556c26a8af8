#!/usr/bin/env python3
"""Times of a CI run (`bash .ci/run > ci.log 2>&1`), from the lines scripts/bootstrap and scripts/test print.

    bench/ci_stage_times.py ci.log [other.log ...]

One table per log: every bootstrap stage ("=== bootstrap: X done in N s"), the bootstrap's wall time ("=== bootstrap:
all N stages done in N s"; stages overlap, so it is less than their sum), every test stage ("=== stage X: passed in
N s" or "FAILED after N s"; a stage run in the background, e.g. molecule beside lint, sanity and unit, also has
the time the run waited for it, "stage/X:waited", which is what it added to the total) and the total. With two
logs, a last column per further log gives its difference to the first (e.g. before/after a CI speed-up).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

BOOTSTRAP_STAGE = re.compile(r"^=== bootstrap: (\S+) done in (\d+) s$")
BOOTSTRAP_ALL = re.compile(r"^=== bootstrap: all \d+ stages done in (\d+) s$")
TEST_STAGE = re.compile(r"^=== stage (\S+): (?:passed in|FAILED after) (\d+) s"
                        r"(?: \(in the background; the run waited (\d+) s for it\))?$")


def parse(text: str) -> dict[str, int]:
    """Ordered {row name: seconds}: bootstrap/<stage>, bootstrap (wall), stage/<name>, total."""
    rows: dict[str, int] = {}
    for raw in text.splitlines():
        line = raw.rstrip()
        if m := BOOTSTRAP_STAGE.match(line):
            rows[f"bootstrap/{m[1]}"] = int(m[2])
        elif m := BOOTSTRAP_ALL.match(line):
            rows["bootstrap"] = int(m[1])
        elif m := TEST_STAGE.match(line):
            rows[f"stage/{m[1]}"] = int(m[2])
            if m[3] is not None:
                rows[f"stage/{m[1]}:waited"] = int(m[3])
    steps = {k: v for k, v in rows.items() if k.startswith("bootstrap/")}
    stages = {k: v for k, v in rows.items() if k.startswith("stage/")}
    # A log of the one-by-one bootstrap has no "all ... done" line: its wall time is the sum of its stages.
    wall = rows.get("bootstrap", sum(steps.values()))
    # A background stage adds to the run only the time the run waited for it.
    added = sum(v for k, v in stages.items() if k.endswith(":waited") or f"{k}:waited" not in stages)
    return {**steps, "bootstrap": wall, **stages, "total": wall + added}


def table(logs: list[dict[str, int]], names: list[str]) -> str:
    keys = list(dict.fromkeys(k for rows in logs for k in rows))
    width = max(len(k) for k in keys)
    head = f"{'':{width}}" + "".join(f"{n[-18:]:>20}" for n in names)
    if len(logs) > 1:
        head += "".join(f"{'diff ' + str(i + 1):>12}" for i in range(1, len(logs)))
    out = [head]
    for k in keys:
        cells = [rows.get(k) for rows in logs]
        line = f"{k:{width}}" + "".join(f"{'-' if c is None else c:>20}" for c in cells)
        for c in cells[1:]:
            line += f"{'-' if c is None or cells[0] is None else f'{c - cells[0]:+d}':>12}"
        out.append(line)
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    logs = [parse(Path(p).read_text(errors="replace")) for p in argv]
    print(table(logs, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
