"""Alert delivery end to end on the embedded default: a stopped decode instance reaches a webhook as a firing
VllmInstanceDown notification, and as a resolved one once it runs again.

Needs the stack that tests/integration/test_local_stack.py brings up (site.yml deployed, Prometheus and
Alertmanager running): run it after that file in the same session (scripts/test local / upgrade). Every bound is
derived from the live configuration: the rule's `for:` and its group's evaluation interval (Prometheus rules API),
scrape interval and timeout (Prometheus config API), Alertmanager's group_wait / group_interval (its status API),
and the inventory's readiness budget for an instance coming back (pd_verify_ready_retries x pd_verify_ready_delay_s).
"""

from __future__ import annotations

import json
import shlex
import time
import urllib.parse

import pytest
import yaml
from alert_webhook import RECEIVER, duration_s, matching
from test_local_stack import cluster, host_cmd, http_json, record

ALERT = "VllmInstanceDown"
RECEIVER_UNIT = "pd-alert-webhook-test"
RECEIVED = "/tmp/pd-alert-webhook-test.jsonl"
POLL_S = 5
# Beyond the derived bounds: Prometheus' notifier queue, the webhook POST and one polling period of this test.
NOTIFY_SLACK_S = 4 * POLL_S


@pytest.fixture(scope="module")
def alerting() -> dict:
    view, groups, hostvars = cluster()
    monitor = groups["monitoring_hosts"][0]
    decode_host, decode = next((h, i) for h in sorted(groups["vllm_hosts"])
                               for i in hostvars[h]["pd_instances"] if i["pool"] == "decode")
    mon = hostvars[monitor]
    urls = [u for r in mon.get("observability_alertmanager_receivers", []) for u in r.get("webhook_urls", [])]
    local = [urllib.parse.urlsplit(u) for u in urls if urllib.parse.urlsplit(u).hostname in ("127.0.0.1", "localhost")]
    assert local, f"inventory/local has no webhook receiver on the monitoring host's loopback: {urls}"
    return {"monitor": monitor, "webhook": local[0], "decode_host": decode_host, "decode": decode,
            "prometheus_url": view["prometheus_url"],
            "ready_budget_s": int(mon["pd_verify_ready_retries"]) * float(mon["pd_verify_ready_delay_s"])}


def live_timings(alerting: dict) -> dict:
    """The bounds' inputs as the running Prometheus and Alertmanager have them."""
    prom = alerting["prometheus_url"]
    cfg = yaml.safe_load(http_json(f"{prom}/api/v1/status/config")["data"]["yaml"])
    vllm_job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "vllm")
    scrape_s = duration_s(vllm_job.get("scrape_interval", cfg["global"]["scrape_interval"]))
    scrape_timeout_s = duration_s(vllm_job.get("scrape_timeout", cfg["global"]["scrape_timeout"]))
    groups = http_json(f"{prom}/api/v1/rules?type=alert")["data"]["groups"]
    group, rule = next((g, r) for g in groups for r in g["rules"] if r["name"] == ALERT)
    ams = http_json(f"{prom}/api/v1/alertmanagers")["data"]["activeAlertmanagers"]
    assert ams, "Prometheus has no active Alertmanager (alerting: alertmanagers: in prometheus.yml)"
    am_base = ams[0]["url"].split("/api/")[0]
    status = json.loads(host_cmd(alerting["monitor"], shlex.join([
        "python3", "-c", "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read()"
                         ".decode())", f"{am_base}/api/v2/status"])))
    route = yaml.safe_load(status["config"]["original"])["route"]
    return {"scrape_s": scrape_s, "scrape_timeout_s": scrape_timeout_s, "eval_s": float(group["interval"]),
            "for_s": float(rule["duration"]), "severity": rule["labels"]["severity"],
            "group_wait_s": duration_s(route.get("group_wait", "30s")),
            "group_interval_s": duration_s(route.get("group_interval", "5m")), "alertmanager": am_base}


def received(alerting: dict) -> list[dict]:
    out = host_cmd(alerting["monitor"], f"cat {RECEIVED} 2>/dev/null || true")
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def wait_for(alerting: dict, status: str, labels: dict, since: float, bound_s: float) -> tuple[dict, float]:
    t0 = time.monotonic()
    while True:
        found = matching(received(alerting), status, labels, since)
        if found:
            return found[0], round(time.monotonic() - t0, 1)
        assert time.monotonic() - t0 < bound_s, (
            f"no {status} {labels} notification at the webhook within {bound_s:.0f} s; received: "
            f"{[(b.get('status'), b.get('groupLabels')) for b in received(alerting)]}")
        time.sleep(POLL_S)


def test_stopped_decode_instance_fires_then_resolves_at_the_webhook(alerting):
    t = live_timings(alerting)
    mon, hook, decode = alerting["monitor"], alerting["webhook"], alerting["decode"]
    unit = f"vllm-{decode['name']}.service"
    labels = {"alertname": ALERT, "instance_name": decode["name"], "pool": "decode"}
    # stop -> failed scrape -> pending at the next evaluation -> `for:` -> firing at the evaluation after ->
    # Alertmanager: group_wait for a new group (group_interval if the group already exists).
    fire_bound = (t["scrape_s"] + t["scrape_timeout_s"] + 2 * t["eval_s"] + t["for_s"]
                  + max(t["group_wait_s"], t["group_interval_s"]) + NOTIFY_SLACK_S)
    # up again -> inactive at the next evaluation -> sent at once -> the group's next group_interval flush.
    resolve_bound = t["scrape_s"] + t["eval_s"] + t["group_interval_s"] + NOTIFY_SLACK_S

    host_cmd(mon, f"systemctl stop {RECEIVER_UNIT} 2>/dev/null; systemctl reset-failed {RECEIVER_UNIT} 2>/dev/null;"
                  f" rm -f {RECEIVED}; true")
    host_cmd(mon, shlex.join(["systemd-run", f"--unit={RECEIVER_UNIT}", "--collect", "--quiet", "/usr/bin/python3",
                              "-c", RECEIVER, RECEIVED, hook.hostname, str(hook.port or 80), hook.path or "/"]))
    stopped = False
    try:
        probe = shlex.join(["python3", "-c", "import socket, sys\nfor _ in range(20):\n    try:\n"
                            "        socket.create_connection((sys.argv[1], int(sys.argv[2])), 1); break\n"
                            "    except OSError:\n        __import__('time').sleep(0.5)\nelse:\n    sys.exit(1)",
                            hook.hostname, str(hook.port or 80)])
        host_cmd(mon, probe)  # the receiver listens before anything is stopped
        since_stop = float(host_cmd(mon, "date +%s.%N").strip())
        host_cmd(alerting["decode_host"], f"systemctl stop {unit}", timeout=180)
        stopped = True
        firing, fired_after_s = wait_for(alerting, "firing", labels, since_stop, fire_bound)
        assert firing["labels"]["severity"] == t["severity"]

        since_start = float(host_cmd(mon, "date +%s.%N").strip())
        host_cmd(alerting["decode_host"], f"systemctl start {unit}", timeout=180)
        stopped = False
        query = urllib.parse.urlencode({"query": f'up{{job="vllm",instance_name="{decode["name"]}"}} == 1'})
        t0 = time.monotonic()
        while not http_json(f"{alerting['prometheus_url']}/api/v1/query?{query}")["data"]["result"]:
            assert time.monotonic() - t0 < alerting["ready_budget_s"], (
                f"{unit} not scraped up again within the inventory's readiness budget {alerting['ready_budget_s']} s")
            time.sleep(POLL_S)
        up_after_s = round(time.monotonic() - t0, 1)
        resolved, resolved_after_s = wait_for(alerting, "resolved", labels, since_start, resolve_bound)
        assert resolved["fingerprint"] == firing["fingerprint"]
    finally:
        if stopped:
            host_cmd(alerting["decode_host"], f"systemctl start {unit}", timeout=180, check=False)
        host_cmd(mon, f"systemctl stop {RECEIVER_UNIT}", check=False)
    record("alert-delivery", {"timings": t, "fire_bound_s": fire_bound, "fired_after_s": fired_after_s,
                              "up_again_after_s": up_after_s, "resolve_bound_s": resolve_bound,
                              "resolved_after_s": resolved_after_s})
