"""Every query of the shipped Grafana dashboard returns a series on the live embedded default.

roles/observability/files/dashboards/b300-pd.json is what operators look at; a panel whose query names a metric,
label or recording rule that the running stack does not have stays empty without any error. This test reads the
dashboard as shipped, takes every panel's target expressions (rows' nested panels included), puts values that
match everything in place of the dashboard's template variables (and of Grafana's interval variables), runs each
as an instant query against the live Prometheus of the inventory's cluster view, and fails naming every panel
(title, refId, expression) that returned no series. A series whose value is NaN (a mean over a window without
requests) counts: the panel has its line.

Needs the stack that tests/integration/test_local_stack.py brings up, and must run after the tests that make the
event-only series exist: the front door's 429s (pd_frontdoor_shed_requests_total, from the overload test) and
retries (pd_frontdoor_retried_requests_total, from the decode kill or the fault tests). mtail keeps a counter
once it has seen its label set, so the rate() panels keep a (0-valued) series after the event.
"""

from __future__ import annotations

import json
import re
import time
import urllib.parse

from test_local_stack import ROOT, cluster, http_json, record

DASHBOARD = ROOT / "roles" / "observability" / "files" / "dashboards" / "b300-pd.json"
# Grafana's own interval variables: a window long enough for rate() to see several scrapes (the dashboard's fixed
# windows are 5m too, the recording rules' observability_sla_window).
INTERVAL_VARS = ("__rate_interval", "__interval", "__range", "__range_s", "__interval_ms")
WINDOW = "5m"
# Recording rules are evaluated every evaluation_interval (15 s): a query empty at first is asked again for this
# long before the test fails (a rule group loaded a moment ago has not written its first sample yet).
SETTLE_S = 60
# Panels the embedded default cannot fill, with the reason: for these the test checks instead that the recording
# rule behind the query is loaded and healthy in the live Prometheus (so the panel fills on b300).
NO_DATA_ON_LOCAL = {
    "pool:vllm_spec_decode_acceptance:ratio": (
        "the tiny model has no MTP head: no speculative decoding, no vllm:spec_decode_* counters on the embedded "
        "default"),
}


def panels(dashboard: dict) -> list[dict]:
    """Every panel of the dashboard, the panels nested in (collapsed) rows included."""
    out = []
    for p in dashboard.get("panels", []):
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def _var_pattern(name: str) -> str:
    """$name, ${name}, ${name:format} and [[name]], Grafana's spellings of a variable."""
    n = re.escape(name)
    return rf"\$\{{{n}(?::[^}}]*)?\}}|\$(?:{n})\b|\[\[{n}\]\]"


def substitute(expr: str, variables: list[str]) -> str:
    """The expression with every template variable replaced by a value that matches everything: an equality
    matcher on a variable (label="$v") becomes label=~".*"; a negated one (label!="$v") becomes label!~"" (any
    series with that label: "not everything" would select nothing); a variable elsewhere (label=~"$v", a regex)
    becomes ".*"; Grafana's interval variables become WINDOW."""
    for name in INTERVAL_VARS:
        expr = re.sub(_var_pattern(name), WINDOW, expr)
    for name in variables:
        var = _var_pattern(name)
        expr = re.sub(rf'(\w+)\s*=\s*"(?:{var})"', r'\1=~".*"', expr)
        expr = re.sub(rf'(\w+)\s*!=\s*"(?:{var})"', r'\1!~""', expr)
        expr = re.sub(var, ".*", expr)
    return expr


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, refId, expression with its variables substituted) of every target of the shipped dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    variables = [v["name"] for v in dash.get("templating", {}).get("list", [])]
    out = []
    for p in panels(dash):
        for t in p.get("targets", []):
            if t.get("hide") or not t.get("expr", "").strip():
                continue
            out.append((p.get("title", "?"), t.get("refId", "?"), substitute(t["expr"], variables)))
    return out


def instant(prometheus_url: str, expr: str) -> list[dict]:
    url = f"{prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = http_json(url, timeout=30)
    assert body.get("status") == "success", f"{expr}: {body}"
    return body["data"]["result"]


def test_substitution_matches_everything():
    """The substitution itself (no stack needed): equality, negation, regex and interval spellings."""
    expr = 'sum(rate(x{pool="$pool", host!="${host}", i=~"[[inst]]"}[$__rate_interval])) by (pool)'
    assert substitute(expr, ["pool", "host", "inst"]) == \
        'sum(rate(x{pool=~".*", host!~"", i=~".*"}[5m])) by (pool)'
    assert substitute("up{job=~\"${job:regex}\"}", ["job"]) == 'up{job=~".*"}'
    assert substitute("pool:vllm_ttft_seconds:mean", []) == "pool:vllm_ttft_seconds:mean"


def test_every_dashboard_panel_query_returns_a_series():
    view = cluster()[0]
    prometheus_url = view["prometheus_url"]
    queries = dashboard_queries()
    assert len(queries) >= 20, f"the dashboard has only {len(queries)} queries"
    for _title, _ref, expr in queries:
        assert "$" not in expr and "[[" not in expr, f"a variable left in {expr!r}"
    results: dict[tuple[str, str, str], int] = {}
    deadline = time.monotonic() + SETTLE_S
    pending = list(queries)
    while True:
        for q in pending:
            results[q] = len(instant(prometheus_url, q[2]))
        pending = [q for q in queries if results[q] == 0]
        # the excused ones stay empty on this stack: no reason to wait for them
        if all(q[2].strip() in NO_DATA_ON_LOCAL for q in pending) or time.monotonic() > deadline:
            break
        time.sleep(15)
    record("dashboard_queries", {"queries": len(queries), "empty": len(pending),
                                 "series": {f"{t} [{r}]": n for (t, r, _e), n in results.items()}})
    rules = {r["name"]: r.get("health") for g in http_json(f"{prometheus_url}/api/v1/rules")["data"]["groups"]
             for r in g["rules"]}
    excused = [q for q in pending if q[2].strip() in NO_DATA_ON_LOCAL]
    for _title, _ref, expr in excused:
        assert rules.get(expr.strip()) == "ok", f"{expr}: recording rule not loaded or unhealthy ({rules.get(expr)})"
    empty = [q for q in pending if q not in excused]
    assert not empty, "dashboard panels whose query returned no series on the live stack:\n" + "\n".join(
        f"  {title} [{ref}]: {expr}" for title, ref, expr in empty)
