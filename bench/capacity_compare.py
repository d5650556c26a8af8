#!/usr/bin/env python3
"""Compare a capacity search with a finer sweep from their report.json files, without measuring anything.

  .venv/bin/python bench/capacity_compare.py reports/capacity/<search>/report.json \\
      reports/capacity/<sweep>/report.json [--fit-window 1.3] [--json]

Prints the table that `bench/sla_capacity.py --finer-sweep --compare-with` writes into its report (the search's
max rate against the sweep's knee, and both SLA crossings fitted from their own points), so reports made apart, or
by an older version without fits, can be compared the same way. Exit 0, or 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from ansible_collections.b300.pd.bench.capacity_fit import compare
from ansible_collections.b300.pd.bench.capacity_plan import UsageError
from ansible_collections.b300.pd.bench.capacity_report import comparison_markdown, load_report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("search", help="report.json of the search")
    ap.add_argument("sweep", help="report.json of the sweep (--finer-sweep)")
    ap.add_argument("--fit-window", type=float, default=1.3, help="as bench/sla_capacity.py --fit-window")
    ap.add_argument("--json", action="store_true", help="the rows as JSON instead of a markdown table")
    a = ap.parse_args(argv)
    try:
        if a.fit_window <= 1:
            raise UsageError(f"--fit-window {a.fit_window:g}: must be > 1")
        search, sweep = load_report(a.search, "search"), load_report(a.sweep, "sweep")
    except UsageError as exc:
        print(f"capacity_compare: {exc}", file=sys.stderr)
        return 2
    rows = compare(search, sweep, a.fit_window)
    if not rows:
        print("capacity_compare: the two reports share no context length", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=2) if a.json else "\n".join(comparison_markdown(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
