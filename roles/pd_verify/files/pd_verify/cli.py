"""pd_verify's command line: run the checks from a config, or merge a step run elsewhere into a report."""

from __future__ import annotations

import argparse
import json
import sys

from .report import STEPS, merge_steps, render_markdown, run_all


def _read_json(path, what):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:
        raise ValueError(f"{what} {path} is not JSON: {e}") from e


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m pd_verify",
                                 description="Verify a vLLM P/D deployment from a cluster peer (the router host).")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="JSON config (written by roles/pd_verify): run the checks")
    src.add_argument("--merge", metavar="REPORT", help="a JSON report of this script: merge --step-result into it")
    ap.add_argument("--step-result", action="append", default=[], metavar="STEP=FILE",
                    help="with --merge: a step's result (JSON) run elsewhere, e.g. accuracy=accuracy.json")
    ap.add_argument("--json", required=True, help="where to write the JSON report")
    ap.add_argument("--markdown", help="where to write the Markdown report")
    ap.add_argument("--steps", help="comma-separated subset of " + ",".join(STEPS))
    a = ap.parse_args(argv)
    try:
        if a.merge:
            results = {}
            for spec in a.step_result:
                name, sep, path = spec.partition("=")
                if not sep or not path:
                    raise ValueError(f"--step-result {spec!r}: give STEP=FILE, e.g. accuracy=accuracy.json")
                results[name] = _read_json(path, f"--step-result {name}")
            rep = merge_steps(_read_json(a.merge, "--merge report"), results)
        else:
            with open(a.config, encoding="utf-8") as f:
                cfg = json.load(f)
            steps = tuple(a.steps.split(",")) if a.steps else STEPS
            rep = run_all(cfg, steps)
    except (OSError, ValueError, KeyError) as e:
        print(f"pd_verify: bad {'input' if a.merge else 'config'}: {e}", file=sys.stderr)
        return 2
    with open(a.json, "w", encoding="utf-8") as f:
        json.dump(rep, f, indent=2, sort_keys=True)
    if a.markdown:
        with open(a.markdown, "w", encoding="utf-8") as f:
            f.write(render_markdown(rep))
    print(json.dumps({"ok": rep["ok"], "failures": rep["failures"]}))
    return 0 if rep["ok"] else 1
