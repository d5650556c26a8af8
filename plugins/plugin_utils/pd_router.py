"""Filters of the pd_router role: the vllm-router command line, derived from the topology.

``pd_router_workers(cluster, hosts)`` -> ``{"prefill": [...], "decode": [...]}``: one entry (``name``, ``host``,
``url``) per instance of the cluster view (``pd_cluster``, playbooks/validate.yml) on ``hosts``, in inventory order.
The view is validated once there (names, pools, ports); this only selects.

``pd_router_argv(workers, settings)`` -> the argument list after the ``vllm-router`` executable. ``settings``
holds the role's knobs (see defaults/main.yml); ``extra_args`` uses the bundle's flag convention
(true = bare flag, false/None = omitted, dict/list = compact JSON, anything else ``--flag value``).
With ``settings["igw"]`` true it adds ``--enable-igw`` (dynamic worker registry; see docs/upgrades.md).

``pd_router_units(units, workers, settings)`` -> the router units of one router host (``pd_router_units``, inventory
data): each ``{"name", "mode", "port", "metrics_port", "argv"}``, checked (names, modes, ports unique and distinct
from the client port). ``mode: pd`` is a P/D router over the whole topology; ``mode: colocated`` a regular router
over the prefill pool: the front door's backup path when no P/D router can serve (e.g. the decode is down).

``pd_router_registry(workers, model_id)`` -> the worker list ``files/pd_router_workers.py set`` registers in IGW
mode: ``[{"url", "worker_type", "model_id", "name"}]``, prefill then decode, in inventory order.

Errors name the host, the instance, the field and the fix (contributing.md).
"""

from __future__ import annotations

import json

from ansible_collections.b300.pd.plugins.module_utils.pd_input_rules import check_host, check_strings, check_text
from ansible_collections.b300.pd.plugins.module_utils.pd_inventory_rules import (
    ROUTER_OWNED_FLAGS,
    check_router_extra_args,
)
from ansible_collections.b300.pd.plugins.plugin_utils.pd_filter_errors import fail

POOLS = ("prefill", "decode")

# Flags the role renders itself; extra_args must not set them (two sources of truth). One list, in module_utils:
# playbooks/validate.yml refuses them too (pd_inventory_rules.check_router_extra_args).
_OWNED_FLAGS = ROUTER_OWNED_FLAGS


def pd_router_workers(cluster, hosts=None):
    """Prefill and decode workers of the cluster view's instances on ``hosts`` (default: every vLLM host)."""
    if not isinstance(cluster, dict) or not isinstance(cluster.get("instances"), list):
        fail("pd_router: pd_cluster (the cluster view) is not defined; run the role through a playbook that imports "
             "playbooks/validate.yml first (site.yml, playbooks/deploy.yml): it validates the topology and "
             "publishes pd_cluster to every host")
    out = {pool: [] for pool in POOLS}
    for inst in cluster["instances"]:
        if hosts is None or inst["host"] in hosts:
            out[inst["pool"]].append({"name": inst["name"], "host": inst["host"], "url": inst["url"]})
    for pool in POOLS:
        if not out[pool]:
            fail(f"pd_router: no {pool} instance on the hosts of pd_router_worker_group ({', '.join(hosts or [])}); "
                 f"P/D needs at least one (set pd_router_worker_group to a group with {pool} instances)")
    return out


def _flag_args(flag, value):
    if value is None or value is False:
        return []
    if value is True:
        return [f"--{flag}"]
    if isinstance(value, dict | list):
        return [f"--{flag}", json.dumps(value, separators=(",", ":"), sort_keys=True)]
    return [f"--{flag}", str(value)]


# The settings written into ExecStart as text (settings key -> the inventory var), checked with the shared rules
# (plugins/module_utils/pd_input_rules.py) even when playbooks/validate.yml did not run: an InputError names the var.
_TEXT_SETTINGS = {
    "kv_connector": "pd_router_kv_connector", "policy": "pd_router_policy",
    "prefill_policy": "pd_router_prefill_policy", "decode_policy": "pd_router_decode_policy",
    "health_check_endpoint": "pd_router_health_check_endpoint", "log_level": "pd_router_log_level",
}
_HOST_SETTINGS = {"host": "pd_router_bind_host", "metrics_host": "pd_router_metrics_bind_host"}


def _check_settings(s):
    for key, var in _HOST_SETTINGS.items():
        if key in s:
            check_host(var, str(s[key]))
    for key, var in _TEXT_SETTINGS.items():
        if s.get(key) is not None:
            check_text(var, str(s[key]))
    if s.get("extra_args"):
        check_router_extra_args("pd_router_extra_args", s["extra_args"])


def pd_router_argv(workers, settings):
    """The vllm-router arguments for P/D mode (the part of ExecStart after the executable)."""
    s = dict(settings or {})
    _check_settings(s)
    igw = bool(s.get("igw"))
    if igw:
        # vllm-router 0.1.17 in IGW mode ignores --prefill-policy/--decode-policy: its P/D router selects prefill
        # AND decode workers with --policy (measured, docs/upgrades.md). The prefill choice is the one that matters
        # (cache reuse across prefill instances), so --policy carries the prefill policy.
        s["policy"] = s.get("prefill_policy") or s.get("policy")
    argv = ["--vllm-pd-disaggregation", "--kv-connector", str(s.get("kv_connector", "nixl"))]
    if igw:
        # The router then starts with an empty registry and ignores the --prefill/--decode below (kept: they are
        # parsed, so validated, and they document the topology); ExecStartPost registers the same workers.
        argv.insert(0, "--enable-igw")
    for w in workers["prefill"]:
        # NIXL needs no bootstrap port; 'none' says so explicitly rather than by omission.
        argv += ["--prefill", w["url"], "none"]
    for w in workers["decode"]:
        argv += ["--decode", w["url"]]
    argv += ["--host", str(s["host"]), "--port", str(s["port"])]
    argv += ["--prometheus-host", str(s["metrics_host"]), "--prometheus-port", str(s["metrics_port"])]
    if s["port"] == s["metrics_port"]:
        fail(f"pd_router: port and metrics_port are both {s['port']}; give them different ports")
    for key, flag in (("policy", "policy"), ("prefill_policy", "prefill-policy"), ("decode_policy", "decode-policy")):
        if s.get(key):
            argv += [f"--{flag}", str(s[key])]
    numeric = (
        ("health_failure_threshold", "health-failure-threshold"),
        ("health_success_threshold", "health-success-threshold"),
        ("health_check_timeout_secs", "health-check-timeout-secs"),
        ("health_check_interval_secs", "health-check-interval-secs"),
        ("retry_max_retries", "retry-max-retries"),
        ("retry_initial_backoff_ms", "retry-initial-backoff-ms"),
        ("retry_max_backoff_ms", "retry-max-backoff-ms"),
        ("request_timeout_secs", "request-timeout-secs"),
        ("queue_timeout_secs", "queue-timeout-secs"),
        ("worker_startup_timeout_secs", "worker-startup-timeout-secs"),
        ("worker_startup_check_interval", "worker-startup-check-interval"),
    )
    for key, flag in numeric:
        val = s.get(key)
        if val is None or val == "":
            continue
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            fail(f"pd_router: pd_router_{key} is {val!r}; set a non-negative integer")
        argv += [f"--{flag}", str(val)]
    if s.get("health_check_endpoint"):
        argv += ["--health-check-endpoint", str(s["health_check_endpoint"])]
    if s.get("log_level"):
        argv += ["--log-level", str(s["log_level"])]
    for raw_flag, value in (s.get("extra_args") or {}).items():
        flag = str(raw_flag).lstrip("-")
        if flag in _OWNED_FLAGS:
            fail(f"pd_router: pd_router_extra_args sets '--{flag}', which the role renders from its own "
                 f"variable; remove it from pd_router_extra_args and set the pd_router_ variable instead")
        argv += _flag_args(flag, value)
    return argv


_UNIT_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789-")
UNIT_MODES = ("pd", "colocated")


def _port(value, field):
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        fail(f"pd_router: {field} is {value!r}; set an integer port 1-65535")
    return value


def pd_router_colocated_argv(workers, settings):
    """vllm-router arguments for regular mode over the prefill pool (the backup path while P/D cannot serve).

    Regular mode, unlike the vLLM P/D path, applies --retry-* and the circuit breaker: a request whose prefill
    instance died is retried on another one.
    """
    s = dict(settings or {})
    argv = ["--worker-urls", *[w["url"] for w in workers["prefill"]]]
    argv += ["--host", str(s["host"]), "--port", str(s["port"])]
    argv += ["--prometheus-host", str(s["metrics_host"]), "--prometheus-port", str(s["metrics_port"])]
    policy = s.get("prefill_policy") or s.get("policy")
    if policy:
        argv += ["--policy", str(policy)]
    pd_argv = pd_router_argv(workers, {**s, "igw": False, "policy": None, "prefill_policy": None,
                                       "decode_policy": None})
    # The shared knobs (health checks, retries, timeouts, log level, extra args) as the P/D router renders them.
    start = pd_argv.index("--prometheus-port") + 2
    argv += pd_argv[start:]
    return argv


def pd_router_units(units, workers, settings):
    """The router units of one host, each with its argv (see the module docstring)."""
    if not isinstance(units, list) or not units:
        fail("pd_router: pd_router_units is empty or not a list; list the router units of a router host, e.g. "
             "[{name: vllm-router, mode: pd, port: 8001, metrics_port: 29000}, "
             "{name: vllm-router-colocated, mode: colocated, port: 8002, metrics_port: 29001}]")
    client_port = settings.get("client_port")
    out, names, ports = [], {}, {}
    for idx, unit in enumerate(units):
        if not isinstance(unit, dict):
            fail(f"pd_router: pd_router_units[{idx}] is {unit!r}; give a mapping with name, mode, port, metrics_port")
        name = unit.get("name")
        where = f"pd_router_units[{idx}] ({name or 'no name'})"
        if not isinstance(name, str) or not name.startswith("vllm-router") or not set(name) <= _UNIT_NAME_CHARS:
            fail(f"pd_router: {where}: field 'name' is {name!r}; use a systemd unit name starting with "
                 "'vllm-router' made of a-z, 0-9 and '-' (e.g. vllm-router-2)")
        mode = unit.get("mode")
        if mode not in UNIT_MODES:
            fail(f"pd_router: {where}: field 'mode' is {mode!r}; set 'pd' (P/D router) or 'colocated' "
                 "(regular router over the prefill pool, the backup path)")
        port = _port(unit.get("port"), f"{where}: field 'port'")
        metrics_port = _port(unit.get("metrics_port"), f"{where}: field 'metrics_port'")
        if name in names:
            fail(f"pd_router: {where}: name '{name}' is also pd_router_units[{names[name]}]; names must be unique")
        for p, field in ((port, "port"), (metrics_port, "metrics_port")):
            if p in ports:
                fail(f"pd_router: {where}: {field} {p} is also used by {ports[p]}; give every unit its own ports")
            if p == client_port:
                fail(f"pd_router: {where}: {field} {p} is the client port (pd_router_port), where the front door "
                     "listens; give the unit another port")
            ports[p] = f"{name} {field}"
        names[name] = idx
        unit_settings = {**settings, "port": port, "metrics_port": metrics_port}
        argv = (pd_router_argv(workers, unit_settings) if mode == "pd"
                else pd_router_colocated_argv(workers, unit_settings))
        out.append({"name": name, "mode": mode, "port": port, "metrics_port": metrics_port, "argv": argv})
    if not any(u["mode"] == "pd" for u in out):
        fail("pd_router: pd_router_units has no unit with mode: pd; a router host needs at least one P/D router")
    return out


def pd_router_registry(workers, model_id):
    """The IGW registry entries of the topology: every prefill and decode instance of ``workers``."""
    if not model_id or not isinstance(model_id, str):
        fail(f"pd_router: pd_router_model_id is {model_id!r}; set it to the served model name "
             "(pd_served_model_name): IGW mode routes a request by its model")
    return [{"url": w["url"], "worker_type": pool, "model_id": model_id, "name": w["name"]}
            for pool in POOLS for w in workers[pool]]


def pd_router_quote(argv):
    """Join argv for a systemd ExecStart= line (double quotes where needed; ${VAR} stays expandable)."""
    out = []
    for idx, arg in enumerate(argv):
        # A control character ends the ExecStart= line (a newline starts a new directive): refused whatever the
        # argument's source (the filters above name the inventory var; this is the last line of defence).
        a = check_strings(f"pd_router_quote: vllm-router argument {idx}", str(arg))
        if a and all(c.isalnum() or c in "-_./:,=@+${}" for c in a):
            out.append(a)
        else:
            out.append('"' + a.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$") + '"')
    return " ".join(out)
