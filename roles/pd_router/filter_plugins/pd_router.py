"""Filters of the pd_router role: the vllm-router command line, derived from the topology.

``pd_router_workers(groups, hostvars, group)`` -> ``{"prefill": [...], "decode": [...]}``: one entry per
``pd_instances`` item of every host in ``group`` (``name``, ``host``, ``url``), in inventory order.

``pd_router_argv(workers, settings)`` -> the argument list after the ``vllm-router`` executable. ``settings``
holds the role's knobs (see defaults/main.yml); ``extra_args`` uses the bundle's flag convention
(true = bare flag, false/None = omitted, dict/list = compact JSON, anything else ``--flag value``).
With ``settings["igw"]`` true it adds ``--enable-igw`` (dynamic worker registry; see docs/upgrades.md).

``pd_router_registry(workers, model_id)`` -> the worker list ``files/pd_router_workers.py set`` registers in IGW
mode: ``[{"url", "worker_type", "model_id", "name"}]``, prefill then decode, in inventory order.

Errors name the host, the instance, the field and the fix (contributing.md).
"""

from __future__ import annotations

import json

POOLS = ("prefill", "decode")

# Flags the role renders itself; extra_args must not set them (two sources of truth).
_OWNED_FLAGS = {
    "vllm-pd-disaggregation", "prefill", "decode", "host", "port", "prometheus-host", "prometheus-port",
    "policy", "prefill-policy", "decode-policy", "kv-connector", "api-key", "health-failure-threshold",
    "health-success-threshold", "health-check-timeout-secs", "health-check-interval-secs",
    "health-check-endpoint", "retry-max-retries", "retry-initial-backoff-ms", "retry-max-backoff-ms",
    "request-timeout-secs", "queue-timeout-secs", "worker-startup-timeout-secs",
    "worker-startup-check-interval", "log-level", "worker-urls", "enable-igw",
}


class PdRouterError(ValueError):
    """Bad topology or settings; the message says where and how to fix it."""


def _fail(msg):
    # AnsibleFilterError when running under Ansible, a plain ValueError subclass in unit tests.
    try:
        from ansible.errors import AnsibleFilterError
    except ImportError:  # pragma: no cover - Ansible is always importable in the control venv
        raise PdRouterError(msg) from None
    raise AnsibleFilterError(msg)


def pd_router_workers(groups, hostvars, group="vllm_hosts"):
    """Prefill and decode worker URLs of every instance of ``group``."""
    hosts = list((groups or {}).get(group) or [])
    if not hosts:
        _fail(f"pd_router: group '{group}' is empty or missing; the router needs vLLM hosts "
              "(add hosts to it in the inventory's hosts.yml)")
    out = {pool: [] for pool in POOLS}
    seen_names, seen_urls = {}, {}
    for host in hosts:
        hv = hostvars[host]
        addr = hv.get("ansible_host") or host
        instances = hv.get("pd_instances")
        if not isinstance(instances, list) or not instances:
            _fail(f"pd_router: host '{host}': pd_instances is missing or empty "
                  f"(define it in host_vars/{host}.yml, see docs/architecture.md)")
        for idx, inst in enumerate(instances):
            name = inst.get("name") if isinstance(inst, dict) else None
            where = f"host '{host}', instance '{name or idx}'"
            if not name:
                _fail(f"pd_router: {where}: field 'name' is missing (give every pd_instances entry a unique name)")
            pool = inst.get("pool")
            if pool not in POOLS:
                _fail(f"pd_router: {where}: field 'pool' is {pool!r}; set it to 'prefill' or 'decode'")
            port = inst.get("http_port")
            if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
                _fail(f"pd_router: {where}: field 'http_port' is {port!r}; set an integer port 1-65535")
            url = f"http://{addr}:{port}"
            if name in seen_names:
                _fail(f"pd_router: {where}: name '{name}' is also used on host '{seen_names[name]}'; "
                      "instance names must be unique in the cluster")
            if url in seen_urls:
                _fail(f"pd_router: {where}: URL {url} is also instance '{seen_urls[url]}'; give it another http_port")
            seen_names[name], seen_urls[url] = host, name
            out[pool].append({"name": name, "host": host, "url": url})
    for pool in POOLS:
        if not out[pool]:
            _fail(f"pd_router: no {pool} instance in group '{group}'; P/D needs at least one "
                  f"(add an entry with pool: {pool} to some host's pd_instances)")
    return out


def _flag_args(flag, value):
    if value is None or value is False:
        return []
    if value is True:
        return [f"--{flag}"]
    if isinstance(value, dict | list):
        return [f"--{flag}", json.dumps(value, separators=(",", ":"), sort_keys=True)]
    return [f"--{flag}", str(value)]


def pd_router_argv(workers, settings):
    """The vllm-router arguments for P/D mode (the part of ExecStart after the executable)."""
    s = dict(settings or {})
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
        _fail(f"pd_router: pd_router_port and pd_router_metrics_port are both {s['port']}; give them different ports")
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
            _fail(f"pd_router: pd_router_{key} is {val!r}; set a non-negative integer")
        argv += [f"--{flag}", str(val)]
    if s.get("health_check_endpoint"):
        argv += ["--health-check-endpoint", str(s["health_check_endpoint"])]
    if s.get("log_level"):
        argv += ["--log-level", str(s["log_level"])]
    for raw_flag, value in (s.get("extra_args") or {}).items():
        flag = str(raw_flag).lstrip("-")
        if flag in _OWNED_FLAGS:
            _fail(f"pd_router: pd_router_extra_args sets '--{flag}', which the role renders from its own "
                  f"variable; remove it from pd_router_extra_args and set the pd_router_ variable instead")
        argv += _flag_args(flag, value)
    if s.get("api_key_env"):
        # systemd expands ${VAR} from EnvironmentFile=; the key never lands in the unit file.
        argv += ["--api-key", "${" + str(s["api_key_env"]) + "}"]
    return argv


def pd_router_registry(workers, model_id):
    """The IGW registry entries of the topology: every prefill and decode instance of ``workers``."""
    if not model_id or not isinstance(model_id, str):
        _fail(f"pd_router: pd_router_model_id is {model_id!r}; set it to the served model name "
              "(pd_served_model_name): IGW mode routes a request by its model")
    return [{"url": w["url"], "worker_type": pool, "model_id": model_id, "name": w["name"]}
            for pool in POOLS for w in workers[pool]]


def pd_router_quote(argv):
    """Join argv for a systemd ExecStart= line (double quotes where needed; ${VAR} stays expandable)."""
    out = []
    for arg in argv:
        a = str(arg)
        if a and all(c.isalnum() or c in "-_./:,=@+${}" for c in a):
            out.append(a)
        else:
            out.append('"' + a.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%").replace("$", "$$") + '"')
    return " ".join(out)


class FilterModule:
    """pd_router filters."""

    def filters(self):
        return {
            "pd_router_workers": pd_router_workers,
            "pd_router_argv": pd_router_argv,
            "pd_router_registry": pd_router_registry,
            "pd_router_quote": pd_router_quote,
        }
