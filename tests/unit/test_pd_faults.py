"""bench/pd_faults.py: a scenario that cannot finish is recorded in the report, not raised.

The fault bench's scenarios run on a live stack (docs/faults.md); here only its bookkeeping is checked, with the
real load generator against a port where nothing listens.
"""

from __future__ import annotations

import argparse
import json
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


class _FakeHosts:
    """A stack whose hosts answer systemctl/curl as a healthy, restarted unit would; records every command."""

    def __init__(self, health="200"):
        self.commands: list[tuple[str, str]] = []
        self.health = health
        self.instances = [{"name": "prefill-0", "pool": "prefill", "host": "h1", "http_port": 8100},
                          {"name": "decode-0", "pool": "decode", "host": "h2", "http_port": 8200}]
        self.cluster = {"routers": [{"host": "h3", "units": [{"name": "r0", "mode": "pd", "port": 8001},
                                                             {"name": "r1", "mode": "pd", "port": 8002},
                                                             {"name": "rc", "mode": "colocated", "port": 8009}]}]}
        self.router_url = "http://127.0.0.1:1"
        self.completions = 0

    def first(self, pool):
        return next(i for i in self.instances if i["pool"] == pool)

    def run(self, host, command, timeout=120, check=True):
        self.commands.append((host, command))
        if command.startswith("systemctl show -p NRestarts"):
            return "0"
        if command.startswith("systemctl show -p MainPID"):
            return "1234"
        if command.startswith("echo $(systemctl show"):
            return "1 200"
        if command.startswith("echo $(curl"):
            return " ".join([self.health] * command.count("curl"))
        return ""

    def completion_ok(self):
        self.completions += 1
        return True


def test_kill_prefill_unit_kills_the_whole_cgroup():
    stack = _FakeHosts()
    res = pd_faults.kill_instance(stack, "prefill", 5, whole_unit=True)
    cmds = [c for h, c in stack.commands if h == "h1"]
    assert "systemctl kill -s KILL vllm-prefill-0.service" in cmds and not any(c.startswith("kill ") for c in cmds)
    assert res["killed"] == "cgroup" and res["healthy_after_s"] == 0.0 and res["routing_after_s"] is not None
    stack = _FakeHosts()
    res = pd_faults.kill_instance(stack, "prefill", 5)
    cmds = [c for h, c in stack.commands if h == "h1"]
    assert "kill -9 1234" in cmds and not any("systemctl kill" in c for c in cmds) and res["killed"] == "main_pid"


def test_kill_prefill_unit_scenario_is_dispatched(monkeypatch):
    calls = []
    monkeypatch.setattr(pd_faults, "kill_instance",
                        lambda stack, pool, timeout, whole_unit=False: calls.append((pool, whole_unit)) or {})
    stack = SimpleNamespace(router_url=f"http://127.0.0.1:{_closed_port()}", model="tiny-pd")
    res = pd_faults.run_scenario(stack, "kill-prefill-unit", _args())
    assert calls == [("prefill", True)] and "error" not in res and res["load_mode"] == "closed"
    assert "kill-prefill-unit" in pd_faults.SCENARIOS


def test_stack_ready_needs_every_instance_router_and_a_completion():
    stack = _FakeHosts()
    assert pd_faults.stack_ready(stack) is True and stack.completions == 1
    by_host = dict(stack.commands)
    assert "127.0.0.1:8100/health" in by_host["h1"] and "127.0.0.1:8200/health" in by_host["h2"]
    assert "127.0.0.1:8001/health" in by_host["h3"] and "127.0.0.1:8002/health" in by_host["h3"]
    assert "8009" not in by_host["h3"]  # the colocated router is not part of the P/D path
    stack = _FakeHosts(health="503")
    assert pd_faults.stack_ready(stack) is False and stack.completions == 0


def test_open_loop_scenario(monkeypatch):
    monkeypatch.setattr(pd_faults, "stop_router", lambda stack, down_s, timeout: {"down_s": down_s})
    stack = SimpleNamespace(router_url=f"http://127.0.0.1:{_closed_port()}", model="tiny-pd")
    args = _args()
    args.rate, args.concurrency, args.warm_s = 20.0, None, 0.5
    res = pd_faults.run_scenario(stack, "stop-router", args)
    assert res["load_mode"] == "open" and res["rate"] == 20.0 and res["concurrency"] == 64
    # open loop: ~rate x 0.5 s sent whatever the answers (all refused at once here)
    assert 5 <= res["requests"]["sent"] <= 15
    assert res["requests"]["failures"] == {"conn_refused": res["requests"]["sent"]}


def _fake_runs(monkeypatch, failed_by_run):
    """run_scenario stubbed: run r of scenario s fails failed_by_run.get((r, s), 0) requests."""
    seen = []
    monkeypatch.setattr(pd_faults, "wait_ready", lambda stack, timeout, settle_s: seen.append("ready") or 0.0)

    def fake(stack, name, args):
        run = sum(1 for x in seen if x == name) + 1
        seen.append(name)
        failed = failed_by_run.get((run, name), 0)
        return {"scenario": name, "load_mode": pd_faults.load_mode(args),
                "requests": {"sent": 10, "completed": 10 - failed, "failed": failed, "failures": {}, "unfinished": 0}}

    monkeypatch.setattr(pd_faults, "run_scenario", fake)
    return seen


def test_repeats_wait_for_recovery_and_sum_failures(monkeypatch, tmp_path):
    seen = _fake_runs(monkeypatch, {(2, "kill-decode"): 3})
    args = argparse.Namespace(concurrency=2, rate=None, repeats=3, max_failed=0, recovery_timeout=1,
                              ready_settle_s=0, inventory="inv")
    out = tmp_path / "f.json"
    rep = pd_faults.run_all(SimpleNamespace(router_url="http://x"), ["kill-prefill", "kill-decode"], args, out,
                            log=lambda m: None)
    assert seen == ["ready", "kill-prefill", "ready", "kill-decode"] * 3  # recovered before every run
    assert [(r["run"], r["scenario"]) for r in rep["results"]] == [
        (1, "kill-prefill"), (1, "kill-decode"), (2, "kill-prefill"), (2, "kill-decode"), (3, "kill-prefill"),
        (3, "kill-decode")]
    s = rep["summary"]
    assert s["failed_total"] == 3 and s["runs"] == 6 and s["runs_with_failures"] == 1 and s["passed"] is False
    assert s["by_scenario"]["kill-decode/closed"] == {
        "runs": 3, "failed": 3, "sent": 30, "failed_per_run": [0, 3, 0], "shed": 0, "shed_per_run": [0, 0, 0]}
    assert s["by_scenario"]["kill-prefill/closed"]["failed"] == 0
    saved = json.loads(out.read_text())
    assert saved["results"] == rep["results"] and saved["concurrency"] == 2 and saved["router"] == "http://x"
    assert pd_faults.summarize(rep["results"], max_failed=3)["passed"] is True


def test_main_exit_code_follows_max_failed(monkeypatch, tmp_path, capsys):
    _fake_runs(monkeypatch, {(1, "kill-router"): 2})
    monkeypatch.setattr(pd_faults, "Stack", lambda inv: SimpleNamespace(router_url="http://x"))
    out = tmp_path / "faults.json"
    argv = ["--scenarios", "kill-router", "--rate", "3", "--repeats", "2", "--out", str(out)]
    assert pd_faults.main(argv) == 1
    text = capsys.readouterr().out
    assert "kill-router/open: 2 runs, failed 2 of 20 (per run [2, 0])" in text and "FAIL" in text
    rep = json.loads(out.read_text())
    assert rep["load_mode"] == "open" and rep["rate"] == 3.0 and rep["repeats"] == 2
    _fake_runs(monkeypatch, {(1, "kill-router"): 2})
    assert pd_faults.main([*argv, "--max-failed", "2"]) == 0
    assert "PASS" in capsys.readouterr().out


def _result(scenario, failures, retry_after_missing=0, sent=100):
    failed = sum(failures.values())
    return {"scenario": scenario, "load_mode": "open", "run": 1,
            "requests": {"sent": sent, "completed": sent - failed, "failed": failed, "failures": failures,
                         "unfinished": 0, "retry_after_missing": retry_after_missing}}


def test_a_429_with_retry_after_is_shed_only_when_asked_and_always_reported():
    results = [_result("kill-prefill", {"http_429": 7}), _result("kill-decode", {})]
    strict = pd_faults.summarize(results)
    assert (strict["failed_total"], strict["shed_total"], strict["passed"]) == (7, 7, False)
    lenient = pd_faults.summarize(results, shed_ok=True)
    assert (lenient["failed_total"], lenient["shed_total"], lenient["passed"]) == (0, 7, True)
    assert lenient["by_scenario"]["kill-prefill/open"]["shed_per_run"] == [7]


def test_a_429_without_retry_after_or_a_5xx_stays_a_failure_with_shed_ok():
    results = [_result("kill-prefill", {"http_429": 5, "http_502": 2}, retry_after_missing=3)]
    summary = pd_faults.summarize(results, shed_ok=True)
    # 2 of the 429s carried Retry-After (shed); the 3 without it and the two 502s failed.
    assert (summary["failed_total"], summary["shed_total"], summary["passed"]) == (5, 2, False)
    assert summary["runs_with_failures"] == 1
