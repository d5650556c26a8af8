"""Alert delivery (roles/observability's Alertmanager): the config rendered from each inventory passes the real
`amtool check-config`, `amtool config routes test` proves where alerts go (a decode-down alert reaches the local
webhook), the inhibit rules name alerts and labels that exist in the rendered rule files, Prometheus is pointed
at the Alertmanager, and the SMTP password never lands in the config.

Rendering is the same as tests/unit/test_prometheus_rules.py's (role defaults resolved against the inventory).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from ansible_collections.b300.pd.tests.integration import alert_webhook
from ansible_collections.b300.pd.tests.unit.test_prometheus_rules import (
    ROLE,
    ROOT,
    alerts_of,
    load_inventory_full,
    promtool,
    render_role,
    render_template,
    role_vars,
)

AMTOOL = shutil.which("amtool") or "/usr/bin/amtool"
INVENTORIES = ("local", "b300")
B300_EXAMPLE = ROOT / "inventory" / "b300" / "group_vars" / "all" / "alerting.yml"


def amtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([AMTOOL, *args], capture_output=True, text=True, timeout=120, check=False)


def inventory_role_vars(inv: str, overrides: dict | None = None) -> dict:
    """role_vars with the inventory's observability_* settings winning over the role defaults (as in Ansible)."""
    own = {k: v for k, v in load_inventory_full(inv)["all_vars"].items() if k.startswith("observability_")}
    return role_vars(inv, overrides={**own, **(overrides or {})})


def render_alertmanager(inv: str, tmp_path: Path, overrides: dict | None = None) -> tuple[Path, dict]:
    ctx = inventory_role_vars(inv, overrides=overrides)
    path = tmp_path / f"alertmanager-{inv}.yml"
    path.write_text(render_template("alertmanager.yml.j2", ctx))
    return path, ctx


def b300_example() -> dict:
    """The commented example of inventory/b300/group_vars/all/alerting.yml, uncommented, vault values filled in."""
    text = B300_EXAMPLE.read_text()
    block = text[text.index("# observability_alertmanager_receivers:"):]
    lines = [ln[2:] for ln in block.splitlines() if ln.startswith(("# observability_", "#  "))]
    example = yaml.safe_load("\n".join(lines))
    assert example and "observability_alertmanager_receivers" in example, "the b300 example is gone"

    def fill(v):
        if isinstance(v, dict):
            return {k: fill(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fill(x) for x in v]
        if isinstance(v, str) and "{{" in v:
            name = re.fullmatch(r"\{\{\s*(vault_\w+)\s*\}\}", v)
            assert name, f"example value {v!r} should be a plain vault reference"
            return "https://hooks.example.org/T0KEN" if "url" in name.group(1) else "vault-s3cret"
        return v

    return fill(example)


def test_amtool_is_installed():
    r = amtool("--version")
    assert r.returncode == 0, "amtool missing: install Debian's prometheus-alertmanager (scripts/bootstrap does)"


def test_bootstrap_installs_alertmanager_on_the_control_node():
    text = (ROOT / "scripts" / "bootstrap.d" / "20-apt").read_text()
    pkgs = re.search(r"^pkgs=\((.*)\)$", text, re.M)
    assert pkgs and "prometheus-alertmanager" in pkgs.group(1).split()


@pytest.mark.parametrize("inv", INVENTORIES)
def test_rendered_config_passes_amtool(tmp_path, inv):
    path, ctx = render_alertmanager(inv, tmp_path)
    r = amtool("check-config", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = yaml.safe_load(path.read_text())
    assert cfg["route"]["group_by"] == ["alertname", "instance", "pool"]
    assert len(cfg["inhibit_rules"]) == len(ctx["observability_alertmanager_inhibit_rules"]) >= 2
    names = [r["name"] for r in cfg["receivers"]]
    assert cfg["route"]["receiver"] in names
    if inv == "local":
        assert cfg["receivers"] == [{"name": "local-webhook", "webhook_configs": [
            {"url": "http://127.0.0.1:9099/alerts", "send_resolved": True}]}]
    else:  # b300 ships the example commented out: a receiver without integrations, and the role warns
        assert names == ["nobody"]


def test_b300_example_is_a_valid_config_and_keeps_the_password_out(tmp_path):
    example = b300_example()
    path, ctx = render_alertmanager("b300", tmp_path, overrides=example)
    r = amtool("check-config", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    text = path.read_text()
    assert "vault-s3cret" not in text
    cfg = yaml.safe_load(text)
    assert cfg["global"]["smtp_auth_password_file"] == ctx["observability_alertmanager_smtp_password_file"]
    assert cfg["global"]["smtp_smarthost"] == example["observability_alertmanager_smtp"]["smarthost"]
    # severity routing: critical to the pager, the rest to the default receiver
    critical = amtool("config", "routes", "test", f"--config.file={path}", "--verify.receivers=oncall-pager",
                      "alertname=PdRouterDown", "severity=critical")
    assert critical.returncode == 0, critical.stdout + critical.stderr
    warning = amtool("config", "routes", "test", f"--config.file={path}", "--verify.receivers=ops-email",
                     "alertname=VllmKVCacheUsageHigh", "severity=warning")
    assert warning.returncode == 0, warning.stdout + warning.stderr


def test_password_file_task_is_no_log_and_0640():
    tasks = yaml.safe_load((ROLE / "tasks" / "alertmanager.yml").read_text())
    secret = [t for t in tasks if "auth_password" in yaml.safe_dump(t)]
    assert secret, "no task writes the SMTP password file"
    for t in secret:
        assert t.get("no_log") is True, t["name"]
        mod = t.get("ansible.builtin.copy") or t.get("ansible.builtin.template")
        assert mod["mode"] == "0640" and mod["owner"] == "root"
        assert mod["group"] == "{{ observability_alertmanager_group }}"
    config = next(t for t in tasks if (t.get("ansible.builtin.template") or {}).get("src") == "alertmanager.yml.j2")
    assert config["ansible.builtin.template"]["validate"] == "{{ observability_amtool }} check-config %s"
    assert config["ansible.builtin.template"]["mode"] == "0640"


def _decode_down_labels(inv: str, rules: dict) -> list[str]:
    """The labels VllmInstanceDown carries for the inventory's first decode instance (rule labels + target labels)."""
    data = load_inventory_full(inv)
    hv = data["hostvars"]
    host, inst = next((h, i) for h in data["groups"]["vllm_hosts"] for i in hv[h].get("pd_instances", [])
                      if i["pool"] == "decode")
    labels = {"alertname": "VllmInstanceDown", "job": "vllm", **rules["VllmInstanceDown"]["labels"],
              "instance": f"{hv[host]['ansible_host']}:{inst['http_port']}", "pool": "decode",
              "instance_name": inst["name"], "host": host, **data["all_vars"].get("observability_external_labels", {})}
    return [f"{k}={v}" for k, v in labels.items()]


def test_decode_down_alert_reaches_the_local_webhook(tmp_path):
    path, _cfg = render_alertmanager("local", tmp_path)
    rules = alerts_of(render_role("local", tmp_path)["pd-alerts.yml"])
    r = amtool("config", "routes", "test", f"--config.file={path}", "--verify.receivers=local-webhook",
               *_decode_down_labels("local", rules))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "local-webhook"
    # and the check can fail: the same alert does not resolve to another receiver
    wrong = amtool("config", "routes", "test", f"--config.file={path}", "--verify.receivers=somebody-else",
                   *_decode_down_labels("local", rules))
    assert wrong.returncode != 0


def _matchers(items: list[str]) -> list[tuple[str, str, str]]:
    out = []
    for m in items:
        parsed = re.fullmatch(r'\s*(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"\s*', m)
        assert parsed, f"matcher {m!r} is not label<op>\"value\""
        out.append(parsed.groups())
    return out


@pytest.mark.parametrize("inv", INVENTORIES)
def test_inhibit_rules_name_alerts_and_labels_that_exist(tmp_path, inv):
    files = render_role(inv, tmp_path)
    rules = alerts_of(files["pd-alerts.yml"])
    prom = yaml.safe_load(files["prometheus.yml"].read_text())
    path, _cfg = render_alertmanager(inv, tmp_path)
    cfg = yaml.safe_load(path.read_text())
    severities = {r["labels"]["severity"] for r in rules.values()}
    external = set(prom["global"]["external_labels"])
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    for rule in cfg["inhibit_rules"]:
        sources = set()
        for side in ("source_matchers", "target_matchers"):
            for label, op, value in _matchers(rule[side]):
                if label == "alertname":
                    assert op in ("=", "=~")
                    names = value.split("|") if op == "=~" else [value]
                    missing = [n for n in names if n not in rules]
                    assert not missing, f"{side} of {rule} names alerts that do not exist: {missing}"
                    if side == "source_matchers":
                        sources.update(names)
                elif label == "severity":
                    assert value in severities, f"{side} of {rule}: no alert has severity {value}"
        assert sources, f"inhibit rule {rule} has no alertname source"
        # every `equal` label is on the source alert: an external label, or a label of the targets it watches
        for name in sources:
            job = re.search(r'job="([^"]+)"', rules[name]["expr"])
            target_labels = set(external) | {"job", "instance"}
            if job:
                target_labels |= {k for sc in jobs[job.group(1)]["static_configs"] for k in sc.get("labels", {})}
            missing = set(rule["equal"]) - target_labels
            assert not missing, f"{name} never carries {missing}: inhibit rule {rule} could never match"


def test_inhibit_check_fails_on_an_unknown_alert_name(tmp_path):
    """The check above can fail: a renamed alert is caught."""
    ctx = inventory_role_vars("local")
    bad = copy.deepcopy(ctx["observability_alertmanager_inhibit_rules"])
    bad[0]["source_matchers"] = ['alertname="PdRouterGone"']
    path, _cfg = render_alertmanager("local", tmp_path, overrides={"observability_alertmanager_inhibit_rules": bad})
    cfg = yaml.safe_load(path.read_text())
    rules = alerts_of(render_role("local", tmp_path)["pd-alerts.yml"])
    names = {v for rule in cfg["inhibit_rules"] for label, _op, v in _matchers(rule["source_matchers"])
             if label == "alertname"}
    assert "PdRouterGone" in names and "PdRouterGone" not in rules


@pytest.mark.parametrize("inv", INVENTORIES)
def test_prometheus_sends_alerts_to_the_alertmanager(tmp_path, inv):
    files = render_role(inv, tmp_path)
    prom = yaml.safe_load(files["prometheus.yml"].read_text())
    ctx = inventory_role_vars(inv)
    want = f"{ctx['observability_alertmanager_listen_address']}:{ctx['observability_alertmanager_port']}"
    assert prom["alerting"]["alertmanagers"] == [{"static_configs": [{"targets": [want]}]}]
    r = promtool("check", "config", "--syntax-only", str(files["prometheus.yml"]))
    assert r.returncode == 0, r.stdout + r.stderr
    off = yaml.safe_load(render_role(inv, tmp_path, overrides={"observability_alertmanager_enabled": False})[
        "prometheus.yml"].read_text())
    assert "alerting" not in off


def test_listen_on_all_addresses_still_points_prometheus_at_loopback(tmp_path):
    ctx = inventory_role_vars("local", overrides={"observability_alertmanager_listen_address": "0.0.0.0"})  # noqa: S104
    assert ctx["observability_alertmanagers"] == [f"127.0.0.1:{ctx['observability_alertmanager_port']}"]
    args = render_template("alertmanager.default.j2", ctx)
    line = next(ln for ln in args.splitlines() if ln.startswith("ARGS="))
    assert f"--web.listen-address=0.0.0.0:{ctx['observability_alertmanager_port']}" in line
    assert "--cluster.listen-address= " in line or line.endswith('--cluster.listen-address="')
    assert f"--config.file={ctx['observability_alertmanager_config_path']}" in line


def _post(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_e2e_webhook_receiver_records_alertmanager_payloads(tmp_path):
    """Dry run of the end-to-end test's receiver on 127.0.0.1 with Alertmanager's webhook payload (version 4)."""
    out = tmp_path / "received.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", alert_webhook.RECEIVER, str(out), "127.0.0.1", "0", "/alerts"],  # noqa: S603
                            stdout=subprocess.PIPE, text=True)
    try:
        word, port = proc.stdout.readline().split()
        assert word == "listening"
        labels = {"alertname": "VllmInstanceDown", "instance_name": "decode-0", "pool": "decode",
                  "severity": "critical"}
        alert = {"status": "firing", "labels": labels, "annotations": {}, "fingerprint": "0123abcd",
                 "startsAt": "2026-12-05T10:20:30.123456789Z", "endsAt": "0001-01-01T00:00:00Z"}
        body = {"version": "4", "status": "firing", "receiver": "local-webhook", "groupKey": "{}:{}",
                "groupLabels": {"alertname": "VllmInstanceDown"}, "commonLabels": labels, "alerts": [alert]}
        resolved = {**body, "status": "resolved", "alerts": [
            {**alert, "status": "resolved", "endsAt": "2026-12-05T10:25:00.5Z"}]}
        base = f"http://127.0.0.1:{port}"
        assert _post(f"{base}/alerts", json.dumps(body).encode()) == 200
        assert _post(f"{base}/alerts", json.dumps(resolved).encode()) == 200
        assert _post(f"{base}/other", b"{}") == 404
        assert _post(f"{base}/alerts", b"not json") == 400
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert got == [body, resolved]
    want = {"alertname": "VllmInstanceDown", "instance_name": "decode-0"}
    started = alert_webhook.timestamp("2026-12-05T10:20:30Z")
    assert alert_webhook.matching(got, "firing", want, started) == [alert]
    assert alert_webhook.matching(got, "firing", want, started + 1) == []  # an older firing alert does not count
    assert alert_webhook.matching(got, "resolved", want, started) == resolved["alerts"]
    assert alert_webhook.matching(got, "firing", {**want, "instance_name": "prefill-0"}, started) == []
    assert alert_webhook.duration_s("1m30s") == 90 and alert_webhook.duration_s("500ms") == 0.5
