"""Filters of the pd_frontdoor role.

``pd_frontdoor_backends(cluster, this_host, router_bind_host)`` -> the routers behind this host's front door:
``[{"name": "<host>/<unit>", "address": "ip:port", "mode": "pd"|"colocated"}]``, P/D routers first. This host's
router units on 127.0.0.1; another router host's units at its address only when the routers bind a non-loopback
address (else that host's front door alone reaches them). Routers and units come from the cluster view
(``pd_cluster.routers``, checked once by playbooks/validate.yml: every router host has a P/D unit).

``pd_frontdoor_keys(keys)`` -> the keys, checked: at least one, 24-256 characters of a token alphabet (they are
written into nginx's config as ``"Bearer <key>"``: no quotes, spaces or semicolons can get in), no duplicates.

Errors name the field and the fix (contributing.md).
"""

from __future__ import annotations

import re

from ansible_collections.b300.pd.plugins.plugin_utils.pd_filter_errors import fail

_KEY_RE = re.compile(r"[A-Za-z0-9._~+/=-]{24,256}")
_LOOPBACK = ("127.", "localhost", "::1")


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
        addr = "127.0.0.1" if router["host"] == this_host else router["address"]
        out += [{"name": f"{router['host']}/{u['name']}", "address": f"{addr}:{u['port']}", "mode": u["mode"]}
                for u in router["units"]]
    return sorted(out, key=lambda b: b["mode"] != "pd")


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
