"""Filters of the pd_frontdoor role.

``pd_frontdoor_backends(cluster, this_host, router_bind_host)`` -> the routers behind this host's front door:
``[{"name": "<host>/<unit>", "address": "ip:port", "mode": "pd"|"colocated"}]``, P/D routers first. This host's
router units on 127.0.0.1; another router host's units at its address only when the routers bind a non-loopback
address (else that host's front door alone reaches them). Routers and units come from the cluster view
(``pd_cluster.routers``, checked once by playbooks/validate.yml: every router host has a P/D unit).

``pd_frontdoor_keys(keys)`` -> the keys, checked: at least one, 24-256 characters of a token alphabet (they are
written into nginx's config as ``"Bearer <key>"``: no quotes, spaces or semicolons can get in), no duplicates.

``pd_frontdoor_key_map(keys)`` -> ``[{"pattern", "label"}]``: each key as a case-sensitive nginx map regex of
"Bearer <key>" and its label, "k" + the first 8 hex characters of the key's sha256 (what logs and metrics show).

``pd_frontdoor_admission(max_inflight, max_rate, key_share, reserve_share, client_max_body_size, max_model_len)``
-> the admission limits nginx enforces: ``max_inflight`` (M), ``reserve`` (R), ``max_inflight_under_share`` (M + R),
``key_rate``/``key_burst`` (a key sending within key_share x max_rate is under its share: nginx limit_req) and
``client_max_body_size`` (derived from the model's context when not given). A request of a key under its share is
admitted while fewer than M + R are in flight, one over it while fewer than M: one key alone fills the cluster, and a
key within its share is never starved by one far over it.

``pd_frontdoor_tls_sans(host, address)`` -> the subjectAltName of the bundle-made server certificate of a front door:
its address (ansible_host, IP or DNS), its inventory name when that is a DNS name, and 127.0.0.1 (the role's own
health probe); the address checked with pd_input_rules.check_host (it is written into openssl's config).

``pd_frontdoor_key_transport(url, allow_plain_http, field)`` -> the URL a client key is sent to, refused when it is
plain http to a non-loopback host (the key and the prompts would cross the network in clear text) unless
``allow_plain_http`` (pd_frontdoor_allow_plain_http, test networks only).

Errors name the field and the fix (contributing.md).
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import re
from urllib.parse import urlsplit

from ansible_collections.b300.pd.plugins.module_utils.pd_input_rules import InputError, check_host
from ansible_collections.b300.pd.plugins.plugin_utils.pd_filter_errors import fail

_KEY_RE = re.compile(r"[A-Za-z0-9._~+/=-]{24,256}")
_LOOPBACK = ("127.", "localhost", "::1")
_SIZE_RE = re.compile(r"[1-9][0-9]{0,9}[kKmMgG]?")
# The JSON of one prompt token, even when every character is \u-escaped; plus room for messages, tools, options.
BODY_BYTES_PER_TOKEN = 32
BODY_EXTRA_BYTES = 1 << 20


def pd_frontdoor_backends(cluster, this_host, router_bind_host="127.0.0.1"):
    if not isinstance(cluster, dict) or not isinstance(cluster.get("routers"), list):
        fail("pd_frontdoor: pd_cluster (the cluster view) is not defined; run the role through a playbook that "
             "imports playbooks/validate.yml first (site.yml, playbooks/deploy.yml): it validates the topology and "
             "publishes pd_cluster to every host")
    if this_host not in [r["host"] for r in cluster["routers"]]:
        fail(f"pd_frontdoor: host '{this_host}' is not in group 'router_hosts'; the front door runs on router hosts")
    remote_ok = not str(router_bind_host).startswith(_LOOPBACK)
    out = []
    for router in cluster["routers"]:
        if router["host"] != this_host and not remote_ok:
            continue
        addr = "127.0.0.1" if router["host"] == this_host else _upstream_host(router)
        out += [{"name": f"{router['host']}/{u['name']}", "address": f"{addr}:{u['port']}", "mode": u["mode"]}
                for u in router["units"]]
    return sorted(out, key=lambda b: b["mode"] != "pd")


def _upstream_host(router):
    """A router host's address as an nginx upstream line takes it (issue #32: checked where it is written)."""
    try:
        addr = check_host(f"router host {router['host']}, field ansible_host", router["address"])
    except InputError as err:
        fail(f"pd_frontdoor: {err}")
    return f"[{addr}]" if ":" in addr else addr


def pd_frontdoor_tls_sans(host, address):
    try:
        addr = check_host(f"router host {host}, field ansible_host", address)
    except InputError as err:
        fail(f"pd_frontdoor: {err}")
    names = []
    for name in (addr, host, "127.0.0.1"):
        try:
            entry = f"IP:{ipaddress.ip_address(name)}"
        except ValueError:
            try:
                entry = f"DNS:{check_host('inventory_hostname', name)}"
            except InputError:
                continue  # an inventory name that is no DNS name (e.g. with "_") is only the inventory's
        if entry not in names:
            names.append(entry)
    return ",".join(names)


def pd_frontdoor_key_transport(url, allow_plain_http=False, field="pd_verify_router_url"):
    parts = urlsplit(str(url or ""))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        fail(f"pd_frontdoor: {field} is {str(url)!r}: give the front door's URL, https://<host>:<port> (the cluster "
             "view's pd_cluster.router_url)")
    host = parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    plain_ok = allow_plain_http if isinstance(allow_plain_http, bool) else \
        str(allow_plain_http).strip().lower() in ("true", "yes", "on", "1")
    if parts.scheme == "http" and not loopback and not plain_ok:
        fail(f"pd_frontdoor: {field} is {url}: a client key would go over plain HTTP to {host} (not loopback), in "
             "clear text. Turn TLS on (pd_frontdoor_tls_enabled: true, the default: without "
             "pd_frontdoor_tls_certificate the bundle makes a CA), or, on a test network only, set "
             "pd_frontdoor_allow_plain_http: true")
    return url


def pd_frontdoor_keys(keys):
    if isinstance(keys, str) or not isinstance(keys, list) or not keys:
        fail("pd_frontdoor: pd_frontdoor_api_keys is empty or not a list; set at least one client API key "
             "(ansible-vault: vault_pd_frontdoor_api_keys; generate one with `openssl rand -hex 32`)")
    seen = set()
    for idx, key in enumerate(keys):
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            fail(f"pd_frontdoor: pd_frontdoor_api_keys[{idx}] is not 24-256 characters of A-Z a-z 0-9 . _ ~ + / = -; "
                 "generate one with `openssl rand -hex 32` (the value is not shown)")
        if key in seen:
            fail(f"pd_frontdoor: pd_frontdoor_api_keys[{idx}] repeats an earlier key; remove the duplicate")
        seen.add(key)
    return keys


def key_label(key):
    """The label logs and metrics show for a client key: never the key, stable across reloads and rotations."""
    return "k" + hashlib.sha256(key.encode()).hexdigest()[:8]


def pd_frontdoor_key_map(keys):
    out = []
    for key in pd_frontdoor_keys(keys):
        # The key alphabet's regex metacharacters are . and +; nginx keeps other backslashes of a quoted string.
        escaped = re.sub(r"([.+])", r"\\\1", key)
        out.append({"pattern": f"~^Bearer {escaped}$", "label": key_label(key)})
    if len({k["label"] for k in out}) != len(out):
        fail("pd_frontdoor: two of pd_frontdoor_api_keys share a label (sha256 prefix); generate a new key for one "
             "of them")
    return out


def _whole(name, value, low, high, hint):
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit() \
            or not low <= int(value) <= high:
        fail(f"pd_frontdoor: {name} is {value!r}: give a whole number from {low} to {high} ({hint})")
    return int(value)


def _fraction(name, value, hint):
    try:
        share = float(value)
    except (TypeError, ValueError):
        share = -1.0
    if isinstance(value, bool) or not 0 < share <= 1:
        fail(f"pd_frontdoor: {name} is {value!r}: give a fraction in (0, 1], {hint}")
    return share


def pd_frontdoor_admission(max_inflight, max_rate=0, key_share=0.5, reserve_share=0.25, client_max_body_size="",  # noqa: PLR0917 - a Jinja filter: positional
                           max_model_len=262144):
    limit = _whole("pd_frontdoor_max_inflight", max_inflight, 0, 1_000_000,
                   "requests in flight this front door admits, as bench/sla_capacity.py measures it; 0 = no limit")
    try:
        rate = float(max_rate)
    except (TypeError, ValueError):
        rate = -1.0
    if isinstance(max_rate, bool) or rate < 0 or (limit and rate <= 0):
        fail(f"pd_frontdoor: pd_frontdoor_max_rate is {max_rate!r}: give the requests per second this front door "
             "serves within pd_sla (> 0 with pd_frontdoor_max_inflight; bench/sla_capacity.py --admission-file writes "
             "both)")
    share = _fraction("pd_frontdoor_key_share", key_share,
                      "the part of pd_frontdoor_max_rate a key may send and still be under its share (e.g. 0.5)")
    reserve = _fraction("pd_frontdoor_reserve_share", reserve_share,
                        "the part of pd_frontdoor_max_inflight held back for keys under their share (e.g. 0.25)")
    reserved = max(1, math.ceil(limit * reserve)) if limit else 0
    per_s = rate * share
    # nginx takes a whole number of requests per second or per minute. Per minute unless the share is a whole number
    # per second: flooring a share of 5.38 r/s to 5r/s would put a key sending 5.2 r/s, within its share, over it.
    per_min = max(1, math.floor(per_s * 60 + 1e-9))
    key_rate = f"{per_min // 60}r/s" if per_min % 60 == 0 else f"{per_min}r/m"
    key_burst = max(1, math.ceil(per_s))
    if client_max_body_size in (None, ""):
        tokens = _whole("pd_frontdoor_max_model_len", max_model_len, 1, 100_000_000,
                        "the model's context in tokens, max-model-len of pd_vllm_flags_common")
        body = f"{math.ceil((tokens * BODY_BYTES_PER_TOKEN + BODY_EXTRA_BYTES) / 1024)}k"
    elif isinstance(client_max_body_size, str) and _SIZE_RE.fullmatch(client_max_body_size):
        body = client_max_body_size
    else:
        fail(f"pd_frontdoor: pd_frontdoor_client_max_body_size is {client_max_body_size!r}: give an nginx size "
             "(e.g. 16m, 512k) or \"\" to derive it from pd_frontdoor_max_model_len")
    return {"max_inflight": limit, "reserve": reserved, "max_inflight_under_share": limit + reserved,
            "key_rate": key_rate if limit else "", "key_burst": key_burst if limit else 0,
            "client_max_body_size": body}
