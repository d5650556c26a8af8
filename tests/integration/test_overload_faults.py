"""SLA under stress on the embedded default (issue #31): overload through the front door is shed at once, and a
prefill crash under load fails no request.

Runs after tests/integration/test_sla_capacity_search.py in the same session: the overload is 3x the max rate that
search measured at its longest context (~3000 prompt tokens), the same hour, on the same stack. The front door's
admission limit is the one that search wrote (reports/ci/admission.yml, bench/sla_capacity.py --admission-file),
deployed here over the inventory's: SLA first, the machine's own same-hour measurement. Its 8-s points end before
a queue builds, so its max rate reads high (CI 2026-12-07, distinct prompts: 11.3 req/s where 30-s points give 8.72)
and CI's goodput is not asserted; bench/pd_overload.py measures it against a 30-s search (docs/faults.md: 0.94-1.00x
in 3 runs once the search sent the overload's kind of request).
Shorter than the benchmark (bench/pd_overload.py: 60 s; here 30 s) so that CI stays within its bound; the criteria
are the same. The prefill kill is bench/pd_faults.py's kill-prefill (kill -9 of the main PID) under the closed loop of
2 clients, once. Of the two prefill kills it is the one that also checks the unit's own handling: systemd stops the
engine processes left behind (KillMode=mixed) before it restarts the instance; the cgroup SIGKILL (kill-prefill-unit)
leaves nothing behind and looks the same to the routers and the front door (connection refused). Each took ~90 s of CI;
both, with the decode and router kills, are repeated 5 times in closed and open loop by the crash matrix
(docs/faults.md: bench/pd_faults.py --repeats 5).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml
from ansible_collections.b300.pd.bench.pd_faults import Stack, run_scenario, wait_ready
from ansible_collections.b300.pd.bench.pd_overload import max_rate_from_report, run_overload
from test_local_stack import INVENTORY, REPORTS, playbook, record, wait_until_routed
from test_local_stack import inventory as _inventory_fixture

inventory = _inventory_fixture  # the session fixture of test_local_stack.py (addresses from the inventory)

CAPACITY_REPORT = REPORTS / "capacity" / "report.json"
ADMISSION_FILE = REPORTS / "admission.yml"
OVERLOAD_S = 30
PROMPT_TOKENS = 3000


def test_overload_is_shed_at_once_and_what_is_admitted_meets_the_sla(inventory):
    if not CAPACITY_REPORT.exists():
        pytest.fail(f"{CAPACITY_REPORT} is missing: run tests/integration/test_sla_capacity_search.py first "
                    "(scripts/test local)")
    max_rate, context = max_rate_from_report(str(CAPACITY_REPORT), PROMPT_TOKENS)
    assert max_rate > 0, f"the capacity search found no passing rate at {context} tokens"
    written = yaml.safe_load(ADMISSION_FILE.read_text())["pd_frontdoor_max_inflight"]
    assert written > 0, f"{ADMISSION_FILE}: the search wrote no admission limit"
    limit = inventory["hostvars"][inventory["router_host"]]["pd_frontdoor_max_inflight"]
    assert limit > 0, "inventory/local sets no admission limit (pd_frontdoor_max_inflight)"
    # the search ran with admission off: the limit it measured on (extra vars over the inventory's)
    playbook("site.yml", "--limit", "router_hosts", "--tags", "router", "-e", f"@{ADMISSION_FILE}", timeout=600)
    try:
        wait_until_routed(inventory, 180, "overload")
        rep = run_overload(INVENTORY, max_rate, "heavy=2.7,light=0.3", duration=OVERLOAD_S, max_tokens=32,
                           timeout=60)
    finally:
        # The inventory's limit back for what follows: the prefill kills are measured under it (the crash matrix,
        # docs/faults.md). Under a search's 3 (CI 2026-12-07) the kill's closed loop of 2 clients met one 429 1.6 s
        # after the kill: docs/faults.md says why a limit that close to a closed loop's clients can refuse one.
        playbook("site.yml", "--limit", "router_hosts", "--tags", "router", timeout=600)
        wait_until_routed(inventory, 180, "overload: the inventory's admission limit back")
    record("overload", {"max_rate": max_rate, "context": context, "max_inflight": written,
                        "max_inflight_inventory": limit, "passed": rep["passed"],
                        "criteria": rep["criteria"], "keys": rep["keys"], "overall": rep["overall"]})
    # Goodput is recorded, not asserted here: CI's search (8-s points, test_sla_capacity_search.py) is a smoke of the
    # method whose short points overstate the sustainable rate (measured 2026-12-07: 16 req/s on 12-s points, ~12
    # on 30-s points, same stack), so 0.8 x its max rate is not a fair bar. bench/pd_overload.py checks it against
    # a search with 30-s points (docs/faults.md). Everything else is the benchmark's criteria.
    # The light key's share: 0.95 is the benchmark's bar over 60 s (97.9 % measured, docs/faults.md); over these
    # 30 s it sends ~100 requests, so CI asks 0.9 (2 % refused in the benchmark would be 2 here; 0.95 allows 5).
    failed = [c for c in rep["criteria"] if not c["passed"] and c["name"] not in ("goodput", "light_admitted")]
    assert not failed, json.dumps(failed, indent=1)
    light = rep["keys"]["light"]["admitted_fraction"]
    assert light >= 0.9, f"the light key got {light:.1%} admitted (CI bar 90 %)"
    assert rep["overall"]["goodput_req_s"] > 0, rep["overall"]


@pytest.mark.parametrize("scenario", ["kill-prefill"])
def test_prefill_crash_under_load_fails_no_request(inventory, scenario):
    stack = Stack(INVENTORY)
    assert wait_ready(stack, 600, 5.0) is not None, "the stack did not recover from the previous test"
    args = SimpleNamespace(concurrency=2, rate=None, max_tokens=8, prompt_words=32, request_timeout=120, warm_s=10,
                           settle_s=10, recovery_timeout=600, router_down_s=10)
    res = run_scenario(stack, scenario, args)
    record(f"fault-{scenario}", {k: v for k, v in res.items() if k != "latency_s"})
    assert "error" not in res, res["error"]
    assert res["healthy_after_s"] is not None, f"{scenario}: the instance did not come back"
    req = res["requests"]
    assert req["failed"] == 0 and req["completed"] > 0, (req, res["error_samples"])
