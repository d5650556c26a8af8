"""Prometheus rules of roles/observability: rendered from the real inventories, checked and unit-tested by promtool.

The rule templates are rendered with jinja2 exactly as Ansible's template module would (same `#jinja2:` header
override, trim_blocks) with the role defaults resolved against each inventory (pd_sla, pd_router_metrics_port, the
topology). Then `promtool check rules` and `promtool test rules` run on the result. The synthetic series below are
derived from the inventory SLA (TTFT/TPOT just under and just over it) and from the role's thresholds, so a changed
threshold or a broken expression makes these tests fail. A mutation test proves the promtool tests can fail.

Helpers here are also used by tests/unit/test_observability.py.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import jinja2
import jinja2.nativetypes
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "observability"
from ansible_collections.b300.pd.bench.pd_cluster import view_from  # noqa: E402
from ansible_collections.b300.pd.plugins.plugin_utils import pd_inputs  # noqa: E402

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
INVENTORIES = ("local", "b300")


def needs_promtool(fn):
    """promtool is required, not optional: scripts/bootstrap installs Debian's prometheus. Missing -> the tests fail."""
    return fn


def test_promtool_is_installed():
    r = subprocess.run([PROMTOOL, "--version"], capture_output=True, text=True, check=False)
    assert r.returncode == 0, "promtool missing: install Debian's prometheus package (scripts/bootstrap does)"


# ---------------------------------------------------------------- inventory + role rendering (shared helpers)


def load_inventory_full(name: str) -> dict:
    """groups and hostvars of inventory/<name>, from its YAML files (group_vars/all, host_vars, hosts.yml)."""
    inv = ROOT / "inventory" / name
    all_vars: dict = {}
    for f in sorted((inv / "group_vars" / "all").glob("*.yml")):
        all_vars.update(yaml.safe_load(f.read_text()) or {})
    tree = yaml.safe_load((inv / "hosts.yml").read_text())
    groups: dict[str, list[str]] = {"all": []}
    inline: dict[str, dict] = {}

    def walk(gname: str, node: dict) -> list[str]:
        members: list[str] = []
        for h, hv in ((node or {}).get("hosts") or {}).items():
            members.append(h)
            inline.setdefault(h, {}).update(hv or {})
        for child, cnode in ((node or {}).get("children") or {}).items():
            members += walk(child, cnode)
        groups[gname] = list(dict.fromkeys(groups.get(gname, []) + members))
        return members

    for top, node in tree.items():
        walk(top, node)
    groups["all"] = list(dict.fromkeys(h for g, hs in groups.items() if g != "all" for h in hs))
    hostvars = {}
    for h in groups["all"]:
        hv = dict(all_vars)
        f = inv / "host_vars" / f"{h}.yml"
        if f.exists():
            hv.update(yaml.safe_load(f.read_text()) or {})
        hv.update(inline.get(h, {}))
        hv["inventory_hostname"] = h
        hostvars[h] = hv
    return {"groups": groups, "hostvars": hostvars, "all_vars": all_vars}


def _filters(env: jinja2.Environment) -> None:
    env.filters["to_json"] = json.dumps
    env.filters["b300.pd.pd_listen_address"] = pd_inputs.pd_listen_address
    env.filters["bool"] = lambda v: v if isinstance(v, bool) else str(v).lower() in ("true", "yes", "1", "on")


def role_vars(inv_name: str, host: str | None = None, overrides: dict | None = None,
              host_overrides: dict | None = None) -> dict:
    """Template context of the role on `host` (default: the first monitoring host): hostvars + resolved defaults,
    and pd_cluster as playbooks/validate.yml publishes it (bench/pd_cluster.py; host_overrides: inventory vars set
    on every host first)."""
    inv = load_inventory_full(inv_name)
    for hv in inv["hostvars"].values():
        hv.update(host_overrides or {})
    host = host or inv["groups"]["monitoring_hosts"][0]
    ctx = dict(inv["hostvars"][host])
    ctx.update(groups=inv["groups"], hostvars=inv["hostvars"], ansible_managed="Ansible managed",
               pd_cluster=view_from(inv["groups"], inv["hostvars"]))
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    defaults.update(overrides or {})
    env = jinja2.nativetypes.NativeEnvironment(undefined=jinja2.StrictUndefined)
    _filters(env)
    pending = dict(defaults)
    for _round in range(len(pending) + 1):
        progress = False
        for k, v in list(pending.items()):
            if isinstance(v, str) and "{{" in v:
                try:
                    ctx[k] = env.from_string(v).render(ctx)
                except jinja2.UndefinedError:
                    continue
            else:
                ctx[k] = v
            del pending[k]
            progress = True
        if not pending or not progress:
            break
    assert not pending, f"role defaults that do not resolve against inventory/{inv_name}: {sorted(pending)}"
    return ctx


def render_template(name: str, ctx: dict) -> str:
    """Render roles/observability/templates/<name> like ansible.builtin.template (honours a `#jinja2:` header)."""
    src = (ROLE / "templates" / name).read_text()
    opts: dict = {}
    first, _sep, rest = src.partition("\n")
    if first.startswith("#jinja2:"):
        for m in re.finditer(r'(\w+)\s*:\s*"([^"]*)"', first[len("#jinja2:"):]):
            opts[m.group(1)] = m.group(2)
        src = rest
    # YAML out, not HTML: no autoescape (same as Ansible's template module)
    env = jinja2.Environment(  # noqa: S701
        undefined=jinja2.StrictUndefined, trim_blocks=True, keep_trailing_newline=True, **opts)
    _filters(env)
    return env.from_string(src).render(ctx)


def render_role(inv_name: str, outdir: Path, overrides: dict | None = None,
                host_overrides: dict | None = None) -> dict[str, Path]:
    """Render prometheus.yml and the rule files into outdir (rule_files then point into outdir)."""
    ctx = role_vars(inv_name, overrides={"observability_prometheus_rules_dir": str(outdir), **(overrides or {})},
                    host_overrides=host_overrides)
    out = {}
    for tpl, fname in (("pd-recording.yml.j2", "pd-recording.yml"), ("pd-alerts.yml.j2", "pd-alerts.yml"),
                       ("prometheus.yml.j2", "prometheus.yml")):
        p = outdir / fname
        p.write_text(render_template(tpl, ctx))
        out[fname] = p
    return out


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=cwd, timeout=300, check=False)


def alerts_of(path: Path) -> dict[str, dict]:
    return {r["alert"]: r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"] if "alert" in r}


def records_of(path: Path) -> dict[str, dict]:
    return {r["record"]: r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"] if "record" in r}


def kebab(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "-", name).lower()


# ---------------------------------------------------------------- synthetic series (promtool test rules)

VLLM = {"job": "vllm"}
DEC0 = {**VLLM, "instance": "10.237.0.12:8200", "pool": "decode", "instance_name": "decode-0", "host": "pd-decode-0"}
DEC1 = {**VLLM, "instance": "10.237.0.12:8201", "pool": "decode", "instance_name": "decode-1", "host": "pd-decode-0"}
PRE0 = {**VLLM, "instance": "10.237.0.11:8100", "pool": "prefill", "instance_name": "prefill-0", "host": "pd-prefill-0"}
ROUTER = {"job": "pd-router", "instance": "10.237.0.13:29000", "host": "pd-router-0"}


def s(metric: str, labels: dict, values: str) -> dict:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{metric}{{{inner}}}", "values": values}


def counter(start: float, step: float, n: int = 60) -> str:
    """start, start+step, ... (n+1 samples, 1 per minute): promtool's expanding notation."""
    return f"{start}+{step}x{n}"


def explicit(values) -> str:
    return " ".join(repr(float(v)) for v in values)


def build_tests(ctx: dict) -> list[dict]:
    """promtool test groups, with values derived from the rendered role's thresholds (inventory SLA)."""
    ttft = float(ctx["observability_sla_ttft_mean_s"])
    tpot = float(ctx["observability_sla_tpot_mean_ms"]) / 1000.0
    mtp_min = float(ctx["observability_mtp_acceptance_min"])
    nixl_max = float(ctx["observability_nixl_xfer_p99_max_s"])
    kv_max = float(ctx["observability_kv_cache_usage_max"])
    q_max = int(ctx["observability_queue_waiting_max"])
    err_max = float(ctx["observability_router_error_ratio_max"])
    rss_thr = int(ctx["observability_rss_growth_bytes_per_hour"])
    min_age = int(ctx["observability_rss_min_age_s"])
    crit = {"severity": "critical"}
    warn = {"severity": "warning"}
    tests = []

    # TTFT mean: decode 0.125 s over the SLA (fires), prefill 0.125 s under (quiet); per-pool p50 from buckets.
    over, under = ttft + 0.125, ttft - 0.125
    tests.append({
        "name": "TTFT mean just over vs just under the SLA",
        "interval": "1m",
        "input_series": [
            s("vllm:time_to_first_token_seconds_sum", DEC0, counter(0, over)),
            s("vllm:time_to_first_token_seconds_count", DEC0, counter(0, 1)),
            s("vllm:time_to_first_token_seconds_sum", PRE0, counter(0, under)),
            s("vllm:time_to_first_token_seconds_count", PRE0, counter(0, 1)),
            s("vllm:time_to_first_token_seconds_bucket", {**DEC0, "le": "1"}, counter(0, 0)),
            s("vllm:time_to_first_token_seconds_bucket", {**DEC0, "le": "2"}, counter(0, 10)),
            s("vllm:time_to_first_token_seconds_bucket", {**DEC0, "le": "+Inf"}, counter(0, 10)),
        ],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "VllmTTFTMeanOverSLA", "exp_alerts": []},  # pending: `for` not elapsed
            {"eval_time": "30m", "alertname": "VllmTTFTMeanOverSLA",
             "exp_alerts": [{"exp_labels": {**crit, "pool": "decode"}}]},
        ],
        "promql_expr_test": [
            {"expr": "round(pool:vllm_ttft_seconds:mean * 1000)", "eval_time": "30m",
             "exp_samples": [{"labels": '{pool="decode"}', "value": round(over * 1000)},
                             {"labels": '{pool="prefill"}', "value": round(under * 1000)}]},
            {"expr": "pool:vllm_ttft_seconds:p50", "eval_time": "30m",
             "exp_samples": [{"labels": 'pool:vllm_ttft_seconds:p50{pool="decode"}', "value": 1.5}]},
        ],
    })
    tests.append({
        "name": "TTFT mean under the SLA in both pools: quiet",
        "interval": "1m",
        "input_series": [
            s("vllm:time_to_first_token_seconds_sum", DEC0, counter(0, under)),
            s("vllm:time_to_first_token_seconds_count", DEC0, counter(0, 1)),
            s("vllm:time_to_first_token_seconds_sum", PRE0, counter(0, under)),
            s("vllm:time_to_first_token_seconds_count", PRE0, counter(0, 1)),
        ],
        "alert_rule_test": [{"eval_time": "50m", "alertname": "VllmTTFTMeanOverSLA", "exp_alerts": []}],
    })

    # TPOT mean: judged on the decode pool only (prefill's TPOT is not the user's).
    tests.append({
        "name": "TPOT mean over the SLA on decode fires, on prefill does not",
        "interval": "1m",
        "input_series": [
            s("vllm:request_time_per_output_token_seconds_sum", DEC0, counter(0, tpot * 1.05 * 4)),
            s("vllm:request_time_per_output_token_seconds_count", DEC0, counter(0, 4)),
            s("vllm:request_time_per_output_token_seconds_sum", PRE0, counter(0, tpot * 3)),
            s("vllm:request_time_per_output_token_seconds_count", PRE0, counter(0, 1)),
        ],
        "alert_rule_test": [
            {"eval_time": "30m", "alertname": "VllmTPOTMeanOverSLA",
             "exp_alerts": [{"exp_labels": {**crit, "pool": "decode"}}]},
        ],
    })
    tests.append({
        "name": "TPOT mean just under the SLA: quiet",
        "interval": "1m",
        "input_series": [
            s("vllm:request_time_per_output_token_seconds_sum", DEC0, counter(0, tpot * 0.95 * 4)),
            s("vllm:request_time_per_output_token_seconds_count", DEC0, counter(0, 4)),
        ],
        "alert_rule_test": [{"eval_time": "50m", "alertname": "VllmTPOTMeanOverSLA", "exp_alerts": []}],
    })

    # MTP acceptance: decode below the floor fires after 15m, prefill above it stays quiet.
    tests.append({
        "name": "MTP acceptance low vs healthy",
        "interval": "1m",
        "input_series": [
            s("vllm:spec_decode_num_accepted_tokens_total", DEC0, counter(0, 30 * (mtp_min * 0.8))),
            s("vllm:spec_decode_num_draft_tokens_total", DEC0, counter(0, 30)),
            s("vllm:spec_decode_num_accepted_tokens_total", PRE0, counter(0, 30 * min(1.0, mtp_min * 1.2))),
            s("vllm:spec_decode_num_draft_tokens_total", PRE0, counter(0, 30)),
        ],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "VllmMTPAcceptanceLow", "exp_alerts": []},
            {"eval_time": "40m", "alertname": "VllmMTPAcceptanceLow",
             "exp_alerts": [{"exp_labels": {**warn, "pool": "decode"}}]},
        ],
    })

    # NIXL transfer time p99: all transfers in the bucket above the threshold vs all well below it.
    slow_le, fast_le = nixl_max * 2.5, nixl_max / 10
    tests.append({
        "name": "NIXL transfers slow (decode) vs fast (second decode pool label set)",
        "interval": "1m",
        "input_series": [
            s("vllm:nixl_xfer_time_seconds_bucket", {**DEC0, "le": str(nixl_max)}, counter(0, 0)),
            s("vllm:nixl_xfer_time_seconds_bucket", {**DEC0, "le": str(slow_le)}, counter(0, 10)),
            s("vllm:nixl_xfer_time_seconds_bucket", {**DEC0, "le": "+Inf"}, counter(0, 10)),
        ],
        "alert_rule_test": [
            {"eval_time": "30m", "alertname": "VllmNixlTransferSlow",
             "exp_alerts": [{"exp_labels": {**warn, "pool": "decode"}}]},
        ],
    })
    tests.append({
        "name": "NIXL transfers fast: quiet",
        "interval": "1m",
        "input_series": [
            s("vllm:nixl_xfer_time_seconds_bucket", {**DEC0, "le": str(fast_le)}, counter(0, 10)),
            s("vllm:nixl_xfer_time_seconds_bucket", {**DEC0, "le": str(nixl_max)}, counter(0, 10)),
            s("vllm:nixl_xfer_time_seconds_bucket", {**DEC0, "le": "+Inf"}, counter(0, 10)),
        ],
        "alert_rule_test": [{"eval_time": "30m", "alertname": "VllmNixlTransferSlow", "exp_alerts": []}],
    })

    # NIXL failures: a counter that rises fires; a counter that is high but flat (old failures) does not.
    tests.append({
        "name": "NIXL failed transfers rising vs flat",
        "interval": "1m",
        "input_series": [
            s("vllm:nixl_num_failed_transfers_total", DEC0, explicit([0] * 10 + [1] * 5 + [3] * 16)),
            s("vllm:nixl_num_failed_transfers_total", DEC1, counter(5, 0, 30)),
        ],
        "alert_rule_test": [
            {"eval_time": "8m", "alertname": "VllmNixlTransferFailures", "exp_alerts": []},
            {"eval_time": "13m", "alertname": "VllmNixlTransferFailures",
             "exp_alerts": [{"exp_labels": {**crit, "pool": "decode", "instance_name": "decode-0",
                                            "host": "pd-decode-0"}}]},
            {"eval_time": "28m", "alertname": "VllmNixlTransferFailures", "exp_alerts": []},  # no new failures
        ],
    })

    # KV cache usage: the fullest DP rank counts.
    tests.append({
        "name": "KV cache usage high on one DP rank vs below the threshold",
        "interval": "1m",
        "input_series": [
            s("vllm:kv_cache_usage_perc", {**DEC0, "engine": "0"}, counter(0.5, 0, 30)),
            s("vllm:kv_cache_usage_perc", {**DEC0, "engine": "1"}, counter(min(1.0, kv_max + 0.02), 0, 30)),
            s("vllm:kv_cache_usage_perc", {**PRE0, "engine": "0"}, counter(kv_max - 0.02, 0, 30)),
        ],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "VllmKVCacheUsageHigh", "exp_alerts": []},
            {"eval_time": "20m", "alertname": "VllmKVCacheUsageHigh",
             "exp_alerts": [{"exp_labels": {**warn, "pool": "decode", "instance_name": "decode-0",
                                            "host": "pd-decode-0"}}]},
        ],
    })

    # Queue depth: summed over DP ranks of an instance.
    half = q_max // 2 + 2
    tests.append({
        "name": "Queue depth over the threshold summed over DP ranks vs under",
        "interval": "1m",
        "input_series": [
            s("vllm:num_requests_waiting", {**DEC0, "engine": "0"}, counter(half, 0, 30)),
            s("vllm:num_requests_waiting", {**DEC0, "engine": "1"}, counter(half, 0, 30)),
            s("vllm:num_requests_waiting", {**PRE0, "engine": "0"}, counter(q_max, 0, 30)),
        ],
        "alert_rule_test": [
            {"eval_time": "3m", "alertname": "VllmQueueDepthHigh", "exp_alerts": []},
            {"eval_time": "15m", "alertname": "VllmQueueDepthHigh",
             "exp_alerts": [{"exp_labels": {**warn, "pool": "decode", "instance_name": "decode-0",
                                            "host": "pd-decode-0"}}]},
        ],
    })

    # Router error ratio: (prefill + decode errors) / P/D requests.
    bad = err_max * 1.2 * 100 / 2
    good = err_max * 0.8 * 100
    tests.append({
        "name": "Router errors over the ratio",
        "interval": "1m",
        "input_series": [
            s("vllm_router_pd_requests_total", {**ROUTER, "route": "/v1/completions"}, counter(0, 60)),
            s("vllm_router_pd_requests_total", {**ROUTER, "route": "/v1/chat/completions"}, counter(0, 40)),
            s("vllm_router_pd_prefill_errors_total", {**ROUTER, "worker": "http://10.237.0.11:8100"}, counter(0, bad)),
            s("vllm_router_pd_decode_errors_total", {**ROUTER, "worker": "http://10.237.0.12:8200"}, counter(0, bad)),
        ],
        "alert_rule_test": [
            {"eval_time": "20m", "alertname": "PdRouterErrorRatioHigh", "exp_alerts": [{"exp_labels": crit}]},
        ],
    })
    tests.append({
        "name": "Router errors under the ratio, and no prefill error series at all: quiet",
        "interval": "1m",
        "input_series": [
            s("vllm_router_pd_requests_total", {**ROUTER, "route": "/v1/completions"}, counter(0, 100)),
            s("vllm_router_pd_decode_errors_total", {**ROUTER, "worker": "http://10.237.0.12:8200"}, counter(0, good)),
        ],
        "alert_rule_test": [{"eval_time": "30m", "alertname": "PdRouterErrorRatioHigh", "exp_alerts": []}],
        "promql_expr_test": [
            {"expr": "round(pd:router_error:ratio * 1000)", "eval_time": "30m",
             "exp_samples": [{"labels": "{}", "value": round(good * 10)}]},
        ],
    })

    # Availability: up == 0 for the scrape jobs; router worker health.
    node = {"job": "node", "instance": "10.237.0.12:9100", "host": "pd-decode-0", "vllm_host": "true"}
    node_ok = {"job": "node", "instance": "10.237.0.11:9100", "host": "pd-prefill-0", "vllm_host": "true"}
    dcgm = {"job": "dcgm", "instance": "10.0.0.1:9400", "host": "b300-01"}
    dcgm_ok = {"job": "dcgm", "instance": "10.0.0.2:9400", "host": "b300-02"}
    tests.append({
        "name": "Targets down vs up",
        "interval": "1m",
        "input_series": [
            s("up", DEC0, "1 1 0x20"),
            s("up", PRE0, "1x22"),
            s("up", ROUTER, "1 1 0x20"),
            s("up", node, "1 1 0x20"),
            s("up", node_ok, "1x22"),
            s("up", dcgm, "1 1 0x20"),
            s("up", dcgm_ok, "1x22"),
            s("vllm_router_worker_health", {**ROUTER, "worker": "http://10.237.0.12:8200"}, "1 1 0x20"),
            s("vllm_router_worker_health", {**ROUTER, "worker": "http://10.237.0.11:8100"}, "1x22"),
        ],
        "alert_rule_test": [
            {"eval_time": "3m", "alertname": "VllmInstanceDown", "exp_alerts": []},
            {"eval_time": "6m", "alertname": "VllmInstanceDown",
             "exp_alerts": [{"exp_labels": {**crit, **DEC0}}]},
            {"eval_time": "3m", "alertname": "PdRouterDown", "exp_alerts": []},
            {"eval_time": "6m", "alertname": "PdRouterDown", "exp_alerts": [{"exp_labels": {**crit, **ROUTER}}]},
            {"eval_time": "4m", "alertname": "NodeExporterDown", "exp_alerts": []},
            {"eval_time": "10m", "alertname": "NodeExporterDown", "exp_alerts": [{"exp_labels": {**warn, **node}}]},
            {"eval_time": "4m", "alertname": "DcgmExporterDown", "exp_alerts": []},
            {"eval_time": "10m", "alertname": "DcgmExporterDown", "exp_alerts": [{"exp_labels": {**warn, **dcgm}}]},
            {"eval_time": "3m", "alertname": "PdRouterWorkerUnhealthy", "exp_alerts": []},
            {"eval_time": "6m", "alertname": "PdRouterWorkerUnhealthy",
             "exp_alerts": [{"exp_labels": {**warn, **ROUTER, "worker": "http://10.237.0.12:8200"}}]},
        ],
    })

    # The front door: its metrics endpoint down vs up; requests served colocated (backup path) vs only P/D.
    door = {"job": "pd-frontdoor", "instance": "10.237.0.13:3903", "host": "pd-router-0"}
    door_ok = {"job": "pd-frontdoor", "instance": "10.237.0.14:3903", "host": "pd-router-1"}
    served = {"job": "pd-frontdoor", "instance": "10.237.0.13:3903", "host": "pd-router-0", "status": "200",
              "backend": "pd-router-0/vllm-router-colocated"}
    served_pd = {"job": "pd-frontdoor", "instance": "10.237.0.14:3903", "host": "pd-router-1", "status": "200",
                 "backend": "pd-router-1/vllm-router"}
    tests.append({
        "name": "Front door down vs up; serving colocated vs P/D",
        "interval": "1m",
        "input_series": [
            s("up", door, "1 1 0x20"),
            s("up", door_ok, "1x22"),
            # 0 colocated requests for 5 minutes, then 60 a minute (the decode died); the other host only P/D.
            s("pd_frontdoor_requests_total", {**served, "path": "colocated"}, "0x5 60+60x16"),
            s("pd_frontdoor_requests_total", {**served_pd, "path": "pd"}, "0+60x22"),
        ],
        "alert_rule_test": [
            {"eval_time": "3m", "alertname": "PdFrontdoorDown", "exp_alerts": []},
            {"eval_time": "6m", "alertname": "PdFrontdoorDown", "exp_alerts": [{"exp_labels": {**crit, **door}}]},
            {"eval_time": "5m", "alertname": "PdServingColocated", "exp_alerts": []},
            {"eval_time": "9m", "alertname": "PdServingColocated",
             "exp_alerts": [{"exp_labels": {**warn, "host": "pd-router-0"}}]},
        ],
    })

    # The front doors' admission: shed share (429) and the retry budget over all front doors, from the mtail
    # counters per client key; requests answered 5xx without a router (no live router) per host.
    shed_max = float(ctx["observability_frontdoor_shed_ratio_max"])
    retry_max = float(ctx["observability_frontdoor_retry_ratio_max"])
    down_for = int(str(ctx["observability_down_for"]).rstrip("m"))
    door0 = {"job": "pd-frontdoor", "instance": "10.237.0.13:3903", "host": "pd-router-0"}
    door1 = {"job": "pd-frontdoor", "instance": "10.237.0.14:3903", "host": "pd-router-1"}
    heavy, light = {"client": "k1a2b3c4d"}, {"client": "k99887766"}

    def shed_per_min(share: float, admitted: float) -> float:
        """Shed requests a minute that make `share` of all (admitted + shed) requests."""
        return admitted * share / (1 - share)

    # 150 admitted requests a minute over two keys and two doors; the heavy key is shed at twice the threshold's
    # share of all requests from minute 10 on.
    tests.append({
        "name": "Front doors shedding over the threshold vs under it",
        "interval": "1m",
        "input_series": [
            s("pd_frontdoor_admitted_requests_total", {**door0, **heavy}, counter(0, 100, 40)),
            s("pd_frontdoor_admitted_requests_total", {**door1, **light}, counter(0, 50, 40)),
            s("pd_frontdoor_shed_requests_total", {**door0, **heavy},
              f"0x10 {counter(0, shed_per_min(shed_max * 2, 150), 30)}"),
        ],
        "alert_rule_test": [
            {"eval_time": "9m", "alertname": "PdFrontdoorShedding", "exp_alerts": []},
            {"eval_time": "13m", "alertname": "PdFrontdoorShedding", "exp_alerts": []},  # pending: `for` 5m
            {"eval_time": "25m", "alertname": "PdFrontdoorShedding", "exp_alerts": [{"exp_labels": warn}]},
        ],
        "promql_expr_test": [
            {"expr": "round(pd_frontdoor:shed:ratio * 1000)", "eval_time": "25m",
             "exp_samples": [{"labels": "{}", "value": round(shed_max * 2 * 1000)}]},
            {"expr": "pd_frontdoor:shed:ratio", "eval_time": "9m",
             "exp_samples": [{"labels": "pd_frontdoor:shed:ratio", "value": 0}]},
            {"expr": "round(client:pd_frontdoor_admitted_requests:rate * 60)", "eval_time": "25m",
             "exp_samples": [{"labels": '{client="k1a2b3c4d"}', "value": 100},
                             {"labels": '{client="k99887766"}', "value": 50}]},
        ],
    })
    tests.append({
        "name": "Front doors shedding under the threshold, or never: quiet",
        "interval": "1m",
        "input_series": [
            s("pd_frontdoor_admitted_requests_total", {**door0, **heavy}, counter(0, 100, 40)),
            s("pd_frontdoor_shed_requests_total", {**door0, **heavy},
              counter(0, shed_per_min(shed_max / 2, 100), 40)),
        ],
        "alert_rule_test": [{"eval_time": "35m", "alertname": "PdFrontdoorShedding", "exp_alerts": []}],
    })
    tests.append({
        "name": "Retries over the budget vs under it",
        "interval": "1m",
        "input_series": [
            s("pd_frontdoor_admitted_requests_total", {**door0, **heavy}, counter(0, 60, 40)),
            s("pd_frontdoor_admitted_requests_total", {**door1, **light}, counter(0, 40, 40)),
            s("pd_frontdoor_retried_requests_total", {**door0, "first_backend": "pd-router-0/vllm-router",
                                                      "first_status": "502"},
              f"0x10 {counter(0, retry_max * 2 * 100, 30)}"),
        ],
        "alert_rule_test": [
            {"eval_time": "9m", "alertname": "PdFrontdoorRetryBudgetExceeded", "exp_alerts": []},
            {"eval_time": "13m", "alertname": "PdFrontdoorRetryBudgetExceeded", "exp_alerts": []},
            {"eval_time": "25m", "alertname": "PdFrontdoorRetryBudgetExceeded", "exp_alerts": [{"exp_labels": warn}]},
        ],
        "promql_expr_test": [
            {"expr": "round(pd_frontdoor:retried:ratio * 1000)", "eval_time": "25m",
             "exp_samples": [{"labels": "{}", "value": round(retry_max * 2 * 1000)}]},
        ],
    })
    tests.append({
        "name": "Retries within the budget: quiet",
        "interval": "1m",
        "input_series": [
            s("pd_frontdoor_admitted_requests_total", {**door0, **heavy}, counter(0, 100, 40)),
            s("pd_frontdoor_retried_requests_total", {**door0, "first_backend": "pd-router-0/vllm-router",
                                                      "first_status": "500"}, counter(0, retry_max / 2 * 100, 40)),
        ],
        "alert_rule_test": [{"eval_time": "35m", "alertname": "PdFrontdoorRetryBudgetExceeded", "exp_alerts": []}],
    })
    # No live router: 502 without a path on pd-router-0 from minute 5 to 25; pd-router-1 answers 401 (no key) and
    # a router's own 503 (path pd), neither of which is the front door finding no router.
    tests.append({
        "name": "Front door without a live router vs refusals and routers' own errors",
        "interval": "1m",
        "input_series": [
            s("pd_frontdoor_requests_total", {**door0, "status": "502", "path": "none", "backend": "none",
                                              "client": "k1a2b3c4d"}, "0x5 10+10x20 210x15"),
            s("pd_frontdoor_requests_total", {**door1, "status": "401", "path": "none", "backend": "none",
                                              "client": "-"}, counter(0, 10, 40)),
            s("pd_frontdoor_requests_total", {**door1, "status": "503", "path": "pd",
                                              "backend": "pd-router-1/vllm-router", "client": "k99887766"},
              counter(0, 10, 40)),
        ],
        "alert_rule_test": [
            {"eval_time": "4m", "alertname": "PdFrontdoorNoLiveRouter", "exp_alerts": []},
            {"eval_time": f"{8 + down_for}m", "alertname": "PdFrontdoorNoLiveRouter",
             "exp_alerts": [{"exp_labels": {**crit, "host": "pd-router-0"}}]},
            {"eval_time": "35m", "alertname": "PdFrontdoorNoLiveRouter", "exp_alerts": []},  # routers back
        ],
    })
    # Engine queue time: decode's mean at 1.5x the threshold (half the SLA's TTFT) fires, prefill's at half stays quiet.
    qt_max = float(ctx["observability_queue_time_mean_max_s"])
    tests.append({
        "name": "Engine queue time over half the TTFT target vs under",
        "interval": "1m",
        "input_series": [
            s("vllm:request_queue_time_seconds_sum", DEC0, counter(0, qt_max * 1.5 * 4, 40)),
            s("vllm:request_queue_time_seconds_count", DEC0, counter(0, 4, 40)),
            s("vllm:request_queue_time_seconds_sum", PRE0, counter(0, qt_max * 0.5 * 4, 40)),
            s("vllm:request_queue_time_seconds_count", PRE0, counter(0, 4, 40)),
        ],
        "alert_rule_test": [
            {"eval_time": "4m", "alertname": "PdEngineQueueTimeHigh", "exp_alerts": []},
            {"eval_time": "20m", "alertname": "PdEngineQueueTimeHigh",
             "exp_alerts": [{"exp_labels": {**warn, "pool": "decode"}}]},
        ],
        "promql_expr_test": [
            {"expr": "round(pool:vllm_request_queue_time_seconds:mean * 1000)", "eval_time": "20m",
             "exp_samples": [{"labels": '{pool="decode"}', "value": round(qt_max * 1.5 * 1000)},
                             {"labels": '{pool="prefill"}', "value": round(qt_max * 0.5 * 1000)}]},
        ],
    })
    tests.append({
        "name": "Engine queue time under the threshold in both pools: quiet",
        "interval": "1m",
        "input_series": [
            s("vllm:request_queue_time_seconds_sum", DEC0, counter(0, qt_max * 0.9 * 4, 40)),
            s("vllm:request_queue_time_seconds_count", DEC0, counter(0, 4, 40)),
        ],
        "alert_rule_test": [{"eval_time": "35m", "alertname": "PdEngineQueueTimeHigh", "exp_alerts": []}],
    })

    # RSS growth (the recipe's leak): 10 h at 1-minute samples.
    n = 600
    gib = 1024**3
    per_min_leak = rss_thr * 2 / 60  # twice the threshold
    per_min_ok = rss_thr * 0.2 / 60  # a fifth of it: slow legitimate growth
    node_dec = {"job": "node", "instance": "10.237.0.12:9100", "host": "pd-decode-0",
                "instance_name": "decode-0", "unit": "vllm-decode-0.service"}
    core = {**node_dec, "process": "EngineCore_DP0"}
    api = {**node_dec, "process": "api_server"}
    young = {**node_dec, "instance_name": "decode-1", "unit": "vllm-decode-1.service", "process": "EngineCore_DP0"}
    # noise: +-64 MiB sawtooth (GC, allocator) on top of the slow growth
    api_values = [gib + per_min_ok * i + ((i % 7) - 3) * 22 * 1024**2 for i in range(n + 1)]
    tests.append({
        "name": "RSS of the engine core growing linearly vs flat-with-noise API server vs a young process",
        "interval": "1m",
        "input_series": [
            s("pd_vllm_process_resident_memory_bytes", core, f"{2 * gib}+{per_min_leak}x{n}"),
            s("pd_vllm_process_start_time_seconds", core, counter(-10 * 3600, 0, n)),
            s("pd_vllm_process_resident_memory_bytes", api, explicit(api_values)),
            s("pd_vllm_process_start_time_seconds", api, counter(-10 * 3600, 0, n)),
            # warm-up growth right after a (re)start: steep but young; judged only after observability_rss_min_age_s
            s("pd_vllm_process_resident_memory_bytes", young,
              explicit([gib] * 450 + [gib + per_min_leak * 3 * i for i in range(n + 1 - 450)])),
            s("pd_vllm_process_start_time_seconds", young, counter(450 * 60, 0, n)),
        ],
        "alert_rule_test": [
            {"eval_time": "30m", "alertname": "VllmProcessRSSGrowing", "exp_alerts": []},  # `for: 1h` not elapsed
            {"eval_time": "2h", "alertname": "VllmProcessRSSGrowing",
             "exp_alerts": [{"exp_labels": {**warn, **core}}]},
            {"eval_time": f"{(450 * 60 + min_age) // 60 - 5}m", "alertname": "VllmProcessRSSGrowing",
             "exp_alerts": [{"exp_labels": {**warn, **core}}]},
        ],
    })
    tests.append({
        "name": "RSS flat: quiet",
        "interval": "1m",
        "input_series": [
            s("pd_vllm_process_resident_memory_bytes", core, f"{2 * gib}+0x{n}"),
            s("pd_vllm_process_start_time_seconds", core, counter(-10 * 3600, 0, n)),
        ],
        "alert_rule_test": [{"eval_time": "9h", "alertname": "VllmProcessRSSGrowing", "exp_alerts": []}],
        "promql_expr_test": [
            {"expr": "instance_name:vllm_process_rss_bytes:deriv_per_hour", "eval_time": "9h",
             "exp_samples": [{"labels": "instance_name:vllm_process_rss_bytes:deriv_per_hour"
                                        + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(core.items())) + "}",
                              "value": 0}]},
        ],
    })

    # RSS collector: a stale file, a vLLM host without the file (fires); fresh file, router host (quiet).
    nv = {"job": "node", "host": "pd-router-0", "instance": "10.237.0.13:9100", "vllm_host": "false"}
    nmiss = {"job": "node", "host": "pd-decode-0", "instance": "10.237.0.12:9100", "vllm_host": "true"}
    nstale = {"job": "node", "host": "pd-prefill-0", "instance": "10.237.0.11:9100", "vllm_host": "true"}
    nfresh = {"job": "node", "host": "pd-prefill-1", "instance": "10.237.0.14:9100", "vllm_host": "true"}
    tests.append({
        "name": "RSS collector stale or missing vs fresh",
        "interval": "1m",
        "input_series": [
            s("up", nv, "1x40"),
            s("up", nmiss, "1x40"),
            s("up", nstale, "1x40"),
            s("up", nfresh, "1x40"),
            s("pd_vllm_rss_collector_last_run_timestamp_seconds", nstale, "0+60x10 600x30"),
            s("pd_vllm_rss_collector_last_run_timestamp_seconds", nfresh, "0+60x40"),
        ],
        "alert_rule_test": [
            {"eval_time": "4m", "alertname": "VllmRSSCollectorStale", "exp_alerts": []},
            {"eval_time": "25m", "alertname": "VllmRSSCollectorStale",
             "exp_alerts": [{"exp_labels": {**warn, **nmiss}},
                            {"exp_labels": {**warn, **dict(nstale)}}]},
        ],
    })
    return tests


def write_promtool_test(tmp: Path, rule_files: list[Path], tests: list[dict], name: str = "pd-rules-test.yml") -> Path:
    p = tmp / name
    p.write_text(yaml.safe_dump({
        "rule_files": [str(f) for f in rule_files],
        "evaluation_interval": "1m",
        "tests": tests,
    }, sort_keys=False))
    return p


def strip_annotations(rule_file: Path, dest: Path) -> Path:
    """Same rules without annotations (promtool compares annotations exactly; those are tested separately)."""
    doc = yaml.safe_load(rule_file.read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            r.pop("annotations", None)
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return dest


# ---------------------------------------------------------------- tests


@needs_promtool
@pytest.mark.parametrize("inv", INVENTORIES)
def test_rules_render_and_pass_promtool_check(tmp_path, inv):
    files = render_role(inv, tmp_path)
    for f in ("pd-recording.yml", "pd-alerts.yml"):
        r = promtool("check", "rules", str(files[f]))
        assert r.returncode == 0, f"promtool check rules {f} ({inv}):\n{r.stdout}\n{r.stderr}"
    r = promtool("check", "config", str(files["prometheus.yml"]))
    assert r.returncode == 0, f"promtool check config ({inv}):\n{r.stdout}\n{r.stderr}"
    assert "SUCCESS: 2 rule files found" in r.stdout + r.stderr


@pytest.mark.parametrize("inv", INVENTORIES)
def test_sla_thresholds_come_from_the_inventory(tmp_path, inv):
    files = render_role(inv, tmp_path)
    sla = load_inventory_full(inv)["all_vars"]["pd_sla"]
    alerts = alerts_of(files["pd-alerts.yml"])
    ttft = re.fullmatch(r"pool:vllm_ttft_seconds:mean > ([0-9.]+)", alerts["VllmTTFTMeanOverSLA"]["expr"].strip())
    tpot = re.fullmatch(r'pool:vllm_tpot_seconds:mean\{pool="decode"\} > ([0-9.]+)',
                        alerts["VllmTPOTMeanOverSLA"]["expr"].strip())
    assert ttft and float(ttft.group(1)) == pytest.approx(sla["ttft_mean_s"])
    assert tpot and float(tpot.group(1)) == pytest.approx(sla["tpot_mean_ms"] / 1000)
    # and a different SLA renders a different threshold (nothing hard-coded in the template)
    files2 = render_role(inv, tmp_path, overrides={"observability_sla_ttft_mean_s": 1.25})
    assert alerts_of(files2["pd-alerts.yml"])["VllmTTFTMeanOverSLA"]["expr"].strip().endswith("> 1.25")


@pytest.mark.parametrize("inv", INVENTORIES)
def test_every_alert_has_severity_summary_description_with_value_and_runbook(tmp_path, inv):
    alerts = alerts_of(render_role(inv, tmp_path)["pd-alerts.yml"])
    assert len(alerts) >= 15
    for name, r in alerts.items():
        assert r["labels"]["severity"] in ("critical", "warning"), name
        ann = r["annotations"]
        assert ann["summary"].strip(), name
        assert "$value" in ann["description"], f"{name}: description must show the value"
        assert ann["runbook_url"] == f"docs/runbooks/{kebab(name)}.md", name
        assert "[%" not in json.dumps(r) and "%]" not in json.dumps(r), f"{name}: unrendered Ansible variable"


@needs_promtool
@pytest.mark.parametrize("inv", INVENTORIES)
def test_promtool_unit_tests_fire_and_stay_quiet(tmp_path, inv):
    files = render_role(inv, tmp_path)
    ctx = role_vars(inv)
    rec = files["pd-recording.yml"]
    alerts = strip_annotations(files["pd-alerts.yml"], tmp_path / "pd-alerts-noann.yml")
    t = write_promtool_test(tmp_path, [rec, alerts], build_tests(ctx))
    r = promtool("test", "rules", str(t))
    assert r.returncode == 0, f"promtool test rules ({inv}):\n{r.stdout}\n{r.stderr}"
    assert "SUCCESS" in r.stdout + r.stderr


def test_every_alert_is_tested_firing_and_quiet(tmp_path):
    files = render_role("local", tmp_path)
    names = set(alerts_of(files["pd-alerts.yml"]))
    fired, quiet = set(), set()
    for t in build_tests(role_vars("local")):
        for a in t.get("alert_rule_test", []):
            (fired if a["exp_alerts"] else quiet).add(a["alertname"])
    assert names - fired == set(), f"alerts never shown to fire: {sorted(names - fired)}"
    assert names - quiet == set(), f"alerts never shown to stay quiet: {sorted(names - quiet)}"
    assert (fired | quiet) - names == set(), f"tests name alerts that do not exist: {sorted((fired | quiet) - names)}"


@needs_promtool
@pytest.mark.parametrize(
    ("alert", "old", "new"),
    [
        ("VllmTTFTMeanOverSLA", ">", "<"),  # inverted comparison
        ("VllmProcessRSSGrowing", "deriv_per_hour >", "deriv_per_hour > 1e12 *"),  # threshold far too high
        ("VllmInstanceDown", "== 0", "== 2"),
        ("PdFrontdoorShedding", ">", "<"),
        ("PdFrontdoorRetryBudgetExceeded", "ratio >", "ratio > 10 *"),
        ("PdFrontdoorNoLiveRouter", 'status=~"5.."', 'status=~"4.."'),
        ("PdEngineQueueTimeHigh", "mean >", "mean > 2 *"),
    ],
)
def test_promtool_tests_catch_a_broken_rule(tmp_path, alert, old, new):
    files = render_role("local", tmp_path)
    doc = yaml.safe_load(strip_annotations(files["pd-alerts.yml"], tmp_path / "a.yml").read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            if r.get("alert") == alert:
                assert old in r["expr"]
                r["expr"] = r["expr"].replace(old, new, 1)
    broken = tmp_path / "broken.yml"
    broken.write_text(yaml.safe_dump(doc, sort_keys=False))
    relevant = [t for t in build_tests(role_vars("local"))
                if any(a["alertname"] == alert for a in t["alert_rule_test"])]
    t = write_promtool_test(tmp_path, [files["pd-recording.yml"], broken], relevant)
    r = promtool("test", "rules", str(t))
    assert r.returncode != 0, f"promtool test rules passed with a broken {alert}: the tests cannot catch it"
    assert alert in r.stdout + r.stderr


@needs_promtool
def test_annotations_render_the_value(tmp_path):
    """Full rules (with annotations): the TTFT alert's text shows the measured mean and the inventory SLA."""
    files = render_role("local", tmp_path)
    ctx = role_vars("local")
    sla = float(ctx["observability_sla_ttft_mean_s"])
    over = sla + 0.125
    test = copy.deepcopy(build_tests(ctx)[0])
    test["alert_rule_test"] = [{
        "eval_time": "30m", "alertname": "VllmTTFTMeanOverSLA",
        "exp_alerts": [{
            "exp_labels": {"severity": "critical", "pool": "decode"},
            "exp_annotations": {
                "summary": f"Mean TTFT of the decode pool is over the SLA ({sla} s)",
                "description": (
                    f"Mean time to first token of the decode pool over the last {ctx['observability_sla_window']} is "
                    f"{over:g}s (SLA: mean TTFT <= {sla} s) for {ctx['observability_sla_for']}. "
                    "Per instance: instance_name:vllm_ttft_seconds:mean."),
                "runbook_url": "docs/runbooks/vllm-ttft-mean-over-sla.md",
            },
        }],
    }]
    test.pop("promql_expr_test")
    t = write_promtool_test(tmp_path, [files["pd-recording.yml"], files["pd-alerts.yml"]], [test])
    r = promtool("test", "rules", str(t))
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
