"""bench/pd_faults.py: a scenario that cannot finish is recorded in the report, not raised.

The fault bench's scenarios run on a live stack (docs/faults.md); here only its bookkeeping is checked, with the
real load generator against a port where nothing listens.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace

from ansible_collections.b300.pd.bench import pd_faults

ROOT = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args() -> argparse.Namespace:
    return argparse.Namespace(concurrency=1, max_tokens=1, prompt_words=4, request_timeout=2, warm_s=0.3,
                              settle_s=0, router_down_s=0, recovery_timeout=1)


def test_a_scenario_that_times_out_is_recorded_with_its_load(monkeypatch):
    def timed_out(stack, timeout):
        raise subprocess.TimeoutExpired(["ansible-playbook", "playbooks/provision.yml"], timeout)

    monkeypatch.setattr(pd_faults, "disk_full", timed_out)
    stack = SimpleNamespace(router_url=f"http://127.0.0.1:{_closed_port()}", model="tiny-pd")
    res = pd_faults.run_scenario(stack, "disk-full", _args())
    assert res["scenario"] == "disk-full"
    assert res["error"].startswith("TimeoutExpired: Command '['ansible-playbook'")
    # The load ran and was stopped: every request was refused (nothing listens), none left running.
    assert res["requests"]["sent"] > 0
    assert res["requests"]["failures"] == {"conn_refused": res["requests"]["sent"]}
    assert res["requests"]["unfinished"] == 0


def test_a_scenario_that_finishes_has_no_error(monkeypatch):
    monkeypatch.setattr(pd_faults, "stop_router", lambda stack, down_s, timeout: {"down_s": down_s})
    stack = SimpleNamespace(router_url=f"http://127.0.0.1:{_closed_port()}", model="tiny-pd")
    res = pd_faults.run_scenario(stack, "stop-router", _args())
    assert "error" not in res and res["down_s"] == 0
