"""SLA under stress on the embedded default (issue #31): overload through the front door is shed at once, and a
prefill crash under load fails no request.

Runs on the stack tests/integration/test_local_stack.py brought up. The overload runs as the benchmark does
(bench/pd_overload.py, docs/faults.md): 3x the inventory's max rate (pd_frontdoor_max_rate, from a search with 30-s
points) under the inventory's limit, two keys at 2.7x and 0.3x, ~3000-token prompts. CI's 8-s search overstates the
rate and the limit (its points end before a queue builds: 11.3 req/s and M 17 where 30-s points give 8.72 and 6, CI
2026-12-07), and under its limit the admitted mean TPOT missed pd_sla once (21.4 ms, 1 CI run of 3, 2026-12-07: up
to 34 in flight with the reserve). test_sla_capacity_search.py checks that search and the limit it writes.
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
from ansible_collections.b300.pd.bench.pd_faults import Stack, run_scenario, wait_ready
from ansible_collections.b300.pd.bench.pd_overload import run_overload
from test_local_stack import INVENTORY, record, wait_until_routed
from test_local_stack import inventory as _inventory_fixture

inventory = _inventory_fixture  # the session fixture of test_local_stack.py (addresses from the inventory)

OVERLOAD_S = 30


def test_overload_is_shed_at_once_and_what_is_admitted_meets_the_sla(inventory):
    router = inventory["hostvars"][inventory["router_host"]]
    limit, max_rate = router["pd_frontdoor_max_inflight"], float(router["pd_frontdoor_max_rate"])
    assert limit > 0 and max_rate > 0, \
        "inventory/local sets no admission limit (pd_frontdoor_max_inflight, pd_frontdoor_max_rate)"
    wait_until_routed(inventory, 180, "overload")
    rep = run_overload(INVENTORY, max_rate, "heavy=2.7,light=0.3", duration=OVERLOAD_S, max_tokens=32, timeout=60)
    record("overload", {"max_rate": max_rate, "max_inflight": limit, "passed": rep["passed"],
                        "criteria": rep["criteria"], "keys": rep["keys"], "overall": rep["overall"]})
    # Goodput is recorded, not asserted here: the inventory's max rate was measured on another day's stack, not in
    # the same hour (the benchmark's bar, bench/pd_overload.py: 0.94-1.00x in 3 runs, docs/faults.md). Everything
    # else is the benchmark's criteria.
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
