"""Filters of the pd_frontdoor role.

``pd_frontdoor_backends(groups, hostvars, this_host, router_bind_host)`` -> the routers behind this host's front
door: ``[{"name": "<host>/<unit>", "address": "ip:port", "mode": "pd"|"colocated"}]``, P/D routers first. This
host's router units on 127.0.0.1; another router host's units at its ``ansible_host`` only when the routers bind
a non-loopback address (else that host's front door alone reaches them). Units come from ``pd_router_units``.

``pd_frontdoor_keys(keys)`` -> the keys, checked: at least one, 24-256 characters of a token alphabet (they are
written into nginx's config as ``"Bearer <key>"``: no quotes, spaces or semicolons can get in), no duplicates.

Errors name the field and the fix (contributing.md).
"""

from __future__ import annotations

import re

_KEY_RE = re.compile(r"[A-Za-z0-9._~+/=-]{24,256}")
_LOOPBACK = ("127.", "localhost", "::1")


class PdFrontdoorError(ValueError):
    """Bad input; the message says where and how to fix it."""


def _fail(msg):
    try:
        from ansible.errors import AnsibleFilterError
    except ImportError:  # pragma: no cover - Ansible is always importable in the control venv
        raise PdFrontdoorError(msg) from None
    raise AnsibleFilterError(msg)


def pd_frontdoor_backends(groups, hostvars, this_host, router_bind_host="127.0.0.1", group="router_hosts"):
    hosts = list((groups or {}).get(group) or [])
    if this_host not in hosts:
        _fail(f"pd_frontdoor: host '{this_host}' is not in group '{group}'; the front door runs on router hosts")
    remote_ok = not str(router_bind_host).startswith(_LOOPBACK)
    out = []
    for host in hosts:
        if host != this_host and not remote_ok:
            continue
        hv = hostvars[host]
        units = hv.get("pd_router_units")
        if not isinstance(units, list) or not units:
            _fail(f"pd_frontdoor: host '{host}': pd_router_units is missing or empty; list its router units in the "
                  "inventory (group_vars/all/router.yml, see roles/pd_router/defaults/main.yml)")
        addr = "127.0.0.1" if host == this_host else (hv.get("ansible_host") or host)
        for idx, unit in enumerate(units):
            if not isinstance(unit, dict) or unit.get("mode") not in ("pd", "colocated") \
                    or not isinstance(unit.get("port"), int) or not unit.get("name"):
                _fail(f"pd_frontdoor: host '{host}': pd_router_units[{idx}] is {unit!r}; give name, mode "
                      "(pd | colocated) and an integer port")
            out.append({"name": f"{host}/{unit['name']}", "address": f"{addr}:{unit['port']}", "mode": unit["mode"]})
    if not any(b["mode"] == "pd" for b in out):
        _fail("pd_frontdoor: no P/D router (pd_router_units entry with mode: pd) behind the front door")
    return sorted(out, key=lambda b: b["mode"] != "pd")


def pd_frontdoor_keys(keys):
    if isinstance(keys, str) or not isinstance(keys, list) or not keys:
        _fail("pd_frontdoor: pd_frontdoor_api_keys is empty or not a list; set at least one client API key "
              "(ansible-vault: vault_pd_frontdoor_api_keys; generate one with `openssl rand -hex 32`)")
    seen = set()
    for idx, key in enumerate(keys):
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            _fail(f"pd_frontdoor: pd_frontdoor_api_keys[{idx}] is not 24-256 characters of A-Z a-z 0-9 . _ ~ + / = -; "
                  "generate one with `openssl rand -hex 32` (the value is not shown)")
        if key in seen:
            _fail(f"pd_frontdoor: pd_frontdoor_api_keys[{idx}] repeats an earlier key; remove the duplicate")
        seen.add(key)
    return keys


class FilterModule:
    """pd_frontdoor filters."""

    def filters(self):
        return {"pd_frontdoor_backends": pd_frontdoor_backends, "pd_frontdoor_keys": pd_frontdoor_keys}
