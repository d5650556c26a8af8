# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Whole-topology validation (like kubespray's validate_inventory): pure, collects every problem.

validate_topology(hosts, recipe, sla) -> list of one-line problems, each naming host, instance, field and fix.
hosts: {host: {"pd_instances": [...], "pd_gpus_per_host": int, "ansible_host": str, "recipe": {optional
per-host overrides of the recipe vars}}}.
"""

from __future__ import annotations

import difflib
import math
import re

from ansible_collections.b300.pd.plugins.module_utils.pd_recipe import (
    INSTANCE_NAME_RE,
    KV_ROLES,
    POOLS,
    RECIPE_KEYS,
    RecipeError,
    build_argv,
    build_env,
    build_flags,
    check_env_dict,
    check_flag_dict,
    check_text,
    control_char,
)

REQUIRED_FIELDS = ("name", "pool", "gpus", "tp_size", "dp_size", "http_port", "nixl_side_channel_port")
OPTIONAL_FIELDS = ("dp_rpc_port", "ucx_net_devices", "extra_flags", "extra_env")
KNOWN_FIELDS = REQUIRED_FIELDS + OPTIONAL_FIELDS
# Flags that must agree between prefill and decode for the KV cache to be transferable.
KV_COMPAT_FLAGS = ("block-size", "kv-cache-dtype", "dtype", "quantization", "tokenizer", "revision")
SLA_FIELDS = {
    "ttft_mean_s": (int, float),
    "tpot_mean_ms": (int, float),
    "context_min_tokens": (int,),
    "context_max_tokens": (int,),
}
MIN_UNPRIVILEGED_PORT = 1024
# The kv roles each pool may have: prefill hands its KV cache out, decode takes it in (kv_both does either).
POOL_KV_ROLES = {"prefill": ("kv_producer", "kv_both"), "decode": ("kv_consumer", "kv_both")}
# One UCX_NET_DEVICES entry as the bundle uses it: an RDMA device and its port (ucx_info -d names them so, and
# rdma_nixl / preflight look each device up in ibv_devices / /sys/class/infiniband).
UCX_NET_DEVICE_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,63}:[1-9][0-9]{0,2}\Z")
# A host address as it goes into VLLM_NIXL_SIDE_CHANNEL_HOST: IPv4/IPv6 literal or DNS name, nothing else.
HOST_ADDRESS_RE = re.compile(r"\A[A-Za-z0-9_.:%-]{1,253}\Z")


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _short(value):
    """repr() for a problem line, cut so a huge value does not drown the message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _suggest(word, choices):
    match = difflib.get_close_matches(str(word), choices, n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _check_port(problems, where, field, value):
    if not _is_int(value) or not 1 <= value <= 65535:
        problems.append(f"{where}, field {field}: {_short(value)} is not a TCP port; use an integer in 1024..65535")
        return False
    if value < MIN_UNPRIVILEGED_PORT:
        problems.append(
            f"{where}, field {field}: port {value} is privileged and vLLM runs as an unprivileged user; "
            "use a port in 1024..65535"
        )
        return False
    return True


def validate_recipe(recipe, where="group_vars (recipe)"):
    problems = []
    if not isinstance(recipe, dict):
        return [f"{where}: the recipe vars are not a mapping; define them in group_vars/all/recipe.yml"]
    for key in RECIPE_KEYS:
        if key not in recipe or recipe[key] is None:
            problems.append(f"{where}, field {key}: missing; define it in group_vars/all/recipe.yml")
    model = recipe.get("pd_model_path")
    if model is not None and (not isinstance(model, str) or not model.startswith("/")):
        problems.append(f"{where}, field pd_model_path: {_short(model)} is not an absolute path")
    else:
        problems += check_text(model, "pd_model_path", where)
    name = recipe.get("pd_served_model_name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        problems.append(f"{where}, field pd_served_model_name: must be a non-empty string")
    elif control_char(name):
        problems += check_text(name, "pd_served_model_name", where)
    elif isinstance(name, str) and "%" in name:
        # It is in the unit's Description=, where systemd expands %-specifiers.
        problems.append(
            f"{where}, field pd_served_model_name: {name!r} contains '%' (a systemd specifier in the unit's "
            "Description); remove it"
        )
    for key in ("pd_vllm_flags_common",):
        if recipe.get(key) is not None:
            problems += check_flag_dict(recipe[key], key, where)
    pools = recipe.get("pd_vllm_flags_pool")
    if pools is not None:
        if not isinstance(pools, dict):
            problems.append(f"{where}, field pd_vllm_flags_pool: must be a mapping pool -> flags")
        else:
            for pool in pools:
                if pool not in POOLS:
                    problems.append(
                        f"{where}, field pd_vllm_flags_pool.{pool}: unknown pool; use {' or '.join(POOLS)}"
                        + _suggest(pool, POOLS)
                    )
            for pool in POOLS:
                if pool not in pools:
                    problems.append(f"{where}, field pd_vllm_flags_pool.{pool}: missing; use {{}} for no flags")
                else:
                    problems += check_flag_dict(pools[pool], f"pd_vllm_flags_pool.{pool}", where)
    roles = recipe.get("pd_kv_roles")
    if roles is not None:
        if not isinstance(roles, dict):
            problems.append(f"{where}, field pd_kv_roles: must be a mapping pool -> kv role")
        else:
            for pool in POOLS:
                role = roles.get(pool)
                if not isinstance(role, str) or role not in KV_ROLES:
                    problems.append(
                        f"{where}, field pd_kv_roles.{pool}: kv role {_short(role)} is missing or invalid; "
                        f"set pd_kv_roles.{pool}: {POOL_KV_ROLES[pool][0]} (one of {', '.join(KV_ROLES)})"
                    )
                elif role not in POOL_KV_ROLES[pool]:
                    problems.append(
                        f"{where}, field pd_kv_roles.{pool}: kv role {role!r} does not fit the {pool} pool "
                        f"(it {'sends' if pool == 'prefill' else 'receives'} the KV cache); set pd_kv_roles.{pool}: "
                        f"{POOL_KV_ROLES[pool][0]} (or {POOL_KV_ROLES[pool][1]})"
                    )
    kvc = recipe.get("pd_kv_transfer_config")
    if kvc is not None:
        if not isinstance(kvc, dict) or not kvc.get("kv_connector"):
            problems.append(
                f"{where}, field pd_kv_transfer_config: needs kv_connector (e.g. {{kv_connector: NixlConnector}})"
            )
        elif "kv_role" in kvc:
            problems.append(
                f"{where}, field pd_kv_transfer_config.kv_role: added per pool from pd_kv_roles; remove it here"
            )
    problems += check_env_dict(recipe.get("pd_vllm_env"), "pd_vllm_env", where)
    problems += check_env_dict(recipe.get("pd_ucx_env"), "pd_ucx_env", where)
    return problems


def validate_sla(sla):
    problems = []
    if not isinstance(sla, dict):
        return ["pd_sla: missing or not a mapping; define it in group_vars/all/sla.yml"]
    for field, types in SLA_FIELDS.items():
        value = sla.get(field)
        kind = "integer" if types == (int,) else "number"
        if value is None:
            problems.append(f"pd_sla, field {field}: missing; set a positive {kind} in group_vars/all/sla.yml")
        elif isinstance(value, bool) or not isinstance(value, types):
            problems.append(f"pd_sla, field {field}: {value!r} is a {type(value).__name__}; use a positive {kind}")
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append(f"pd_sla, field {field}: {value!r} is not a number; use a positive finite {kind}")
        elif value <= 0:
            problems.append(f"pd_sla, field {field}: {value!r} must be > 0")
    lo, hi = sla.get("context_min_tokens"), sla.get("context_max_tokens")
    if _is_int(lo) and _is_int(hi) and lo > hi:
        problems.append(
            f"pd_sla, field context_min_tokens: {lo} > context_max_tokens {hi}; the minimum must not exceed the maximum"
        )
    return problems


def _check_ucx_net_devices(problems, where, value):
    """UCX_NET_DEVICES of one instance: 'dev:port[,dev:port...]' of RDMA devices. Returns True when sound."""
    fix = "use RDMA device:port names like 'mlx5_0:1,mlx5_1:1' (ibv_devices), or omit the field for UCX's default"
    if not isinstance(value, str) or not value.strip():
        problems.append(f"{where}, field ucx_net_devices: {_short(value)} is not a device list; {fix}")
        return False
    found = control_char(value)
    if found:
        problems.append(f"{where}, field ucx_net_devices: {_short(value)} contains {found}; {fix}")
        return False
    entries = value.split(",")
    bad = [e for e in entries if not UCX_NET_DEVICE_RE.match(e)]
    if value == "all":
        problems.append(
            f"{where}, field ucx_net_devices: 'all' is UCX's default; omit the field instead (the bundle checks "
            "every listed name against ibv_devices)"
        )
        return False
    if bad:
        problems.append(
            f"{where}, field ucx_net_devices: {', '.join(_short(e) for e in bad[:3])} not of the form device:port "
            f"(no spaces); {fix}"
        )
        return False
    twice = sorted({e for e in entries if entries.count(e) > 1})
    if twice:
        problems.append(f"{where}, field ucx_net_devices: {', '.join(twice)} listed twice; list each device once")
        return False
    return True


def _validate_instance(problems, host, idx, inst, gpus_per_host):
    """Field-level checks of one instance. Returns True when it is sound enough for cross checks."""
    if not isinstance(inst, dict):
        problems.append(f"host {host}, pd_instances[{idx}]: must be a mapping, got {type(inst).__name__}")
        return False
    name = inst.get("name")
    # A name with a control character (or not a string) is located by index; the name check shows it quoted.
    where = (f"host {host}, instance {name}" if isinstance(name, str) and name and not control_char(name)
             else f"host {host}, pd_instances[{idx}]")
    ok = True
    for field in inst:
        if field not in KNOWN_FIELDS:
            problems.append(f"{where}, field {_short(field) if control_char(str(field)) else field}: unknown field; "
                            f"remove it{_suggest(field, KNOWN_FIELDS)}")
            ok = False
    for field in REQUIRED_FIELDS:
        if field not in inst or inst[field] is None:
            problems.append(f"{where}, field {field}: missing; every instance needs {', '.join(REQUIRED_FIELDS)}")
            ok = False
    if name is not None and (not isinstance(name, str) or not INSTANCE_NAME_RE.match(name)):
        problems.append(
            f"{where}, field name: {_short(name)} is not a valid name; use lowercase letters, digits and '-' "
            "(it becomes vllm-<name>.service)"
        )
        ok = False
    pool = inst.get("pool")
    if pool is not None and (not isinstance(pool, str) or pool not in POOLS):
        problems.append(
            f"{where}, field pool: {_short(pool)} is not a pool; use prefill or decode{_suggest(pool, POOLS)}"
        )
        ok = False
    for field in ("tp_size", "dp_size"):
        v = inst.get(field)
        if v is not None and (not _is_int(v) or v < 1):
            problems.append(f"{where}, field {field}: {_short(v)} must be an integer >= 1")
            ok = False
    for field in ("http_port", "nixl_side_channel_port"):
        if inst.get(field) is not None and not _check_port(problems, where, field, inst[field]):
            ok = False
    dp = inst.get("dp_size")
    if _is_int(dp) and dp > 1:
        if inst.get("dp_rpc_port") is None:
            problems.append(f"{where}, field dp_rpc_port: missing; required when dp_size > 1 (a free TCP port)")
            ok = False
        elif not _check_port(problems, where, "dp_rpc_port", inst["dp_rpc_port"]):
            ok = False
    elif inst.get("dp_rpc_port") is not None:
        _check_port(problems, where, "dp_rpc_port", inst["dp_rpc_port"])
    base = inst.get("nixl_side_channel_port")
    if _is_int(base) and _is_int(dp) and dp >= 1 and base + dp - 1 > 65535:
        problems.append(f"{where}, field nixl_side_channel_port: range {base}..{base + dp - 1} passes 65535; lower it")
        ok = False
    ucx = inst.get("ucx_net_devices")
    if ucx is not None and not _check_ucx_net_devices(problems, where, ucx):
        ok = False
    before = len(problems)
    problems += check_flag_dict(inst.get("extra_flags"), "extra_flags", where)
    problems += check_env_dict(inst.get("extra_env"), "extra_env", where)
    ok = ok and len(problems) == before
    gpus = inst.get("gpus")
    if gpus is not None:
        if not isinstance(gpus, list) or any(not _is_int(g) or g < 0 for g in gpus):
            problems.append(
                f"{where}, field gpus: {_short(gpus)} must be a list of GPU indexes (integers >= 0), [] on CPU"
            )
            return False
        if len(set(gpus)) != len(gpus):
            problems.append(f"{where}, field gpus: {gpus} lists a GPU twice")
            ok = False
        if _is_int(gpus_per_host):
            if gpus_per_host == 0 and gpus:
                problems.append(
                    f"{where}, field gpus: host has pd_gpus_per_host 0 (CPU host); set gpus: [] or fix pd_gpus_per_host"
                )
                ok = False
            elif gpus_per_host > 0:
                bad = [g for g in gpus if g >= gpus_per_host]
                if bad:
                    problems.append(
                        f"{where}, field gpus: {bad} not on this host (pd_gpus_per_host {gpus_per_host}: "
                        f"indexes 0..{gpus_per_host - 1})"
                    )
                    ok = False
                tp, dpv = inst.get("tp_size"), inst.get("dp_size")
                if _is_int(tp) and _is_int(dpv) and len(gpus) != tp * dpv:
                    problems.append(
                        f"{where}, field gpus: {len(gpus)} GPUs but tp_size*dp_size = {tp}*{dpv} = {tp * dpv}; "
                        "list exactly tp_size*dp_size GPUs"
                    )
                    ok = False
    return ok


def _port_claims(inst):
    name = inst["name"]
    claims = [(inst["http_port"], f"http_port of {name}")]
    dp = inst["dp_size"]
    base = inst["nixl_side_channel_port"]
    for r in range(dp):
        claims.append((base + r, f"NIXL side-channel port of {name} (nixl_side_channel_port {base}, DP rank {r})"))
    if dp > 1 and _is_int(inst.get("dp_rpc_port")):
        claims.append((inst["dp_rpc_port"], f"dp_rpc_port of {name}"))
    return claims


def _service_claims(problems, services):
    """host -> [(port, what, field)] of the bundle's other listeners (router, Prometheus, ...); bad entries reported."""
    claims = {}
    if services is None:
        return claims
    if not isinstance(services, list):
        problems.append(
            f"services: {_short(services)} is not a list of {{host, port, field, service}} "
            "(playbooks/validate.yml builds it from the router / monitoring vars)"
        )
        return claims
    for svc in services:
        if not isinstance(svc, dict) or not isinstance(svc.get("host"), str):
            problems.append(f"services: {_short(svc)} is not a {{host, port, field, service}} mapping with a host name")
            continue
        host, field, what = svc["host"], str(svc.get("field") or "port"), str(svc.get("service") or "service")
        port = svc.get("port")
        if isinstance(port, str) and re.fullmatch(r"[0-9]{1,5}", port):  # the roles read these ports with | int
            port = int(port)
        if not _is_int(port) or not 1 <= port <= 65535:
            problems.append(
                f"host {host}, field {field}: {_short(port)} is not a TCP port ({what}); use an integer in 1024..65535"
            )
            continue
        claims.setdefault(host, []).append((port, f"{field} ({what})", field))
    return claims


def _claim_port(problems, claimed, port, what, *, where, field):
    """Record one listener of a host in claimed (port -> what); a port claimed twice is a problem."""
    if port in claimed:
        problems.append(
            f"{where}, field {field}: port {port} ({what}) is already the {claimed[port]}; pick a free port"
        )
    else:
        claimed[port] = what


def validate_topology(hosts, recipe, sla, services=None):
    """Every problem of the topology, one line each. services: the bundle's other listeners, a list of
    {host, port, field, service} (router API and metrics, Prometheus, node exporter), checked for port clashes."""
    problems = validate_recipe(recipe)
    recipe_ok = not problems  # a broken recipe is reported once, not again for every instance
    problems += validate_sla(sla)
    service_claims = _service_claims(problems, services)
    if not isinstance(hosts, dict) or not hosts:
        problems.append(
            "group vllm_hosts: no hosts; put the vLLM servers in group vllm_hosts of the inventory (hosts.yml)"
        )
        return problems
    names = {}
    good = []  # (host, instance, host_recipe)
    for host_key, hv in hosts.items():
        host = str(host_key)  # a YAML key such as 10 is an int; problem lines join host names
        if not isinstance(hv, dict):
            problems.append(
                f"host {host}: host vars are a {type(hv).__name__}, not a mapping; write them as key: value pairs"
            )
            continue
        addr = hv.get("ansible_host")
        if addr is None or (isinstance(addr, str) and not addr.strip()):
            problems.append(f"host {host}, field ansible_host: missing; set the host's address in hosts.yml")
        elif not isinstance(addr, str) or not HOST_ADDRESS_RE.match(addr):
            problems.append(
                f"host {host}, field ansible_host: {_short(addr)} is not an IP address or DNS name (it becomes "
                "VLLM_NIXL_SIDE_CHANNEL_HOST); fix it in hosts.yml"
            )
        gph = hv.get("pd_gpus_per_host")
        if not _is_int(gph) or gph < 0:
            problems.append(
                f"host {host}, field pd_gpus_per_host: {_short(gph)} must be an integer >= 0 (8 on B300, 0 on CPU)"
            )
            gph = None
        host_recipe = dict(recipe) if isinstance(recipe, dict) else {}
        overrides = hv.get("recipe")
        if overrides is None:
            overrides = {}
        elif not isinstance(overrides, dict):
            problems.append(
                f"host {host}, field recipe: the host's own recipe vars are a {type(overrides).__name__}; "
                f"they must be a mapping of recipe var -> value ({', '.join(RECIPE_KEYS[:2])}, ...)"
            )
            overrides = {}
        changed = {k: v for k, v in overrides.items() if k in RECIPE_KEYS and v != host_recipe.get(k)}
        host_recipe_ok = recipe_ok
        if changed:
            host_recipe.update(changed)
            host_problems = validate_recipe(host_recipe, where=f"host {host} (host-level recipe vars)")
            problems += host_problems
            host_recipe_ok = not host_problems
        insts = hv.get("pd_instances")
        if insts is None:
            problems.append(
                f"host {host}, field pd_instances: missing; list the host's instances in host_vars/{host}.yml"
            )
            continue
        if not isinstance(insts, list):
            problems.append(f"host {host}, field pd_instances: must be a list, got {type(insts).__name__}")
            continue
        if not insts:
            problems.append(f"host {host}, field pd_instances: empty; a vllm_hosts member needs at least one instance")
            continue
        host_good = []
        for idx, inst in enumerate(insts):
            if not _validate_instance(problems, host, idx, inst, gph):
                if isinstance(inst, dict) and isinstance(inst.get("name"), str):
                    names.setdefault(inst["name"], []).append(host)
                continue
            names.setdefault(inst["name"], []).append(host)
            host_good.append(inst)
        # GPU overlap on the host
        owner = {}
        for inst in host_good:
            for g in inst["gpus"]:
                if g in owner:
                    problems.append(
                        f"host {host}, instance {inst['name']}, field gpus: GPU {g} is also used by {owner[g]}; "
                        "give each instance its own GPUs"
                    )
                else:
                    owner[g] = inst["name"]
        # Port collisions on the host (the bundle's other listeners, HTTP, NIXL side-channel ranges, DP RPC).
        claimed = {}
        for port, what, field in service_claims.pop(host, []):
            _claim_port(problems, claimed, port, what, where=f"host {host}", field=field)
        for inst in host_good:
            for port, what in _port_claims(inst):
                field = what.split(" of ")[0].replace("NIXL side-channel port", "nixl_side_channel_port")
                _claim_port(problems, claimed, port, what, where=f"host {host}, instance {inst['name']}", field=field)
        for inst in host_good if host_recipe_ok else []:
            try:
                build_argv(host_recipe, inst)
                build_env(host_recipe, inst, addr if isinstance(addr, str) else "", state_root="/var/lib/vllm")
            except RecipeError as exc:
                problems.append(f"host {host}, {exc}")
                continue
            good.append((host, inst, host_recipe))
    for host, claims in service_claims.items():  # hosts without vLLM instances (router, monitoring)
        claimed = {}
        for port, what, field in claims:
            _claim_port(problems, claimed, port, what, where=f"host {host}", field=field)
    for name, where in names.items():
        if len(where) > 1:
            problems.append(
                f"host {', '.join(where)}, instance {name}, field name: {name!r} is used {len(where)} times; "
                "instance names must be unique in the cluster (unit vllm-<name>.service)"
            )
    # Cluster-wide P/D consistency.
    by_pool = {p: [(h, i, r) for h, i, r in good if i["pool"] == p] for p in POOLS}
    declared = {p for hv in hosts.values() if isinstance(hv, dict) and isinstance(hv.get("pd_instances"), list)
                for i in hv["pd_instances"] if isinstance(i, dict) for p in [i.get("pool")] if isinstance(p, str)}
    for pool in POOLS:
        if pool not in declared:
            problems.append(
                f"topology, field pool: no {pool} instance in any host's pd_instances; P/D needs at least one "
                f"{pool} instance"
            )
    for ph, pi, _ in by_pool["prefill"]:
        for dh, di, _ in by_pool["decode"]:
            if pi["tp_size"] > di["tp_size"]:
                problems.append(
                    f"host {ph}, instance {pi['name']}, field tp_size: prefill TP {pi['tp_size']} > decode TP "
                    f"{di['tp_size']} of {di['name']} on {dh}; NIXL needs prefill TP <= decode TP"
                )
    flags = {(h, i["name"]): build_flags(r, i) for h, i, r in good}
    models = {(h, i["name"]): r.get("pd_model_path") for h, i, r in good}
    if by_pool["prefill"] and by_pool["decode"]:
        ref_h, ref_i, _ = by_pool["decode"][0]
        ref = (ref_h, ref_i["name"])
        for h, i, _ in by_pool["prefill"] + by_pool["decode"][1:]:
            key = (h, i["name"])
            if models[key] != models[ref]:
                problems.append(
                    f"host {h}, instance {i['name']}, field pd_model_path: {models[key]!r} differs from "
                    f"{models[ref]!r} of {ref_i['name']}; prefill and decode must serve the same model"
                )
            for flag in KV_COMPAT_FLAGS:
                a, b = flags[key].get(flag), flags[ref].get(flag)
                if a != b:
                    problems.append(
                        f"host {h}, instance {i['name']}, field flags.{flag}: {a!r} differs from {b!r} of decode "
                        f"instance {ref_i['name']}; the KV cache only transfers when --{flag} matches: set it in "
                        "pd_vllm_flags_common"
                    )
    return problems


def summarize(hosts):
    """Hosts, instances per pool and GPUs; tolerant of any input (it is also returned when validation fails)."""
    out = {"hosts": 0, "instances": {p: [] for p in POOLS}, "gpus": 0}
    for host, hv in (hosts.items() if isinstance(hosts, dict) else []):
        out["hosts"] += 1
        insts = hv.get("pd_instances") if isinstance(hv, dict) else None
        for inst in insts if isinstance(insts, list) else []:
            pool = inst.get("pool") if isinstance(inst, dict) else None
            if isinstance(pool, str) and pool in POOLS:
                out["instances"][pool].append(f"{host}/{inst.get('name')}")
                gpus = inst.get("gpus")
                out["gpus"] += len(gpus) if isinstance(gpus, list) else 0
    return out


# ---------------------------------------------------------------------------------------------------------------
# The cluster view: every address, URL and port set the roles, verify, bench and tests use, composed here once.
# ---------------------------------------------------------------------------------------------------------------

# The inventory vars the view reads, per host (hostvars) and, where a host does not set them, from the role that
# owns them (defaults/main.yml): var -> role.
VIEW_VARS = {
    "ansible_host": None,
    "pd_instances": None,
    "pd_firewall_host_addresses": None,
    "pd_router_port": "pd_router",
    "pd_router_units": "pd_router",
    "pd_router_bind_host": "pd_router",
    "pd_frontdoor_metrics_port": "pd_frontdoor",
    "observability_prometheus_port": "observability",
    "observability_alertmanager_enabled": "observability",
    "observability_alertmanager_port": "observability",
    "observability_alertmanager_listen_address": "observability",
    "observability_dcgm_exporter_port": "observability",
    "node_exporter_port": "node_exporter",
}
ROUTER_UNIT_MODES = ("pd", "colocated")
_LOOPBACK_PREFIXES = ("127.", "localhost", "::1")


class TopologyError(ValueError):
    """The router / monitoring input of the cluster view is unusable; one line per problem."""

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def _as_port(value):
    """A port as the roles read it (`| int` on a digit string)."""
    if isinstance(value, str) and re.fullmatch(r"[0-9]{1,5}", value):
        return int(value)
    return value


def _truthy(value):
    if isinstance(value, str):
        return value.strip().lower() in ("true", "yes", "on", "1")
    return bool(value)


def _url(address, port):
    host = f"[{address}]" if ":" in str(address) else address
    return f"http://{host}:{port}"


def _alertmanager_api(mon):
    """The Alertmanager API as its own host reaches it ({host, url}; None where none is deployed): the role's default
    listener is loopback only (observability_alertmanager_listen_address), so callers run there (delegate_to host);
    a wildcard listener answers on loopback too."""
    if not mon or mon.get("alertmanager_port") is None:
        return None
    listen = str(mon.get("alertmanager_listen_address") or "")
    local = listen in ("", "0.0.0.0", "::") or listen.startswith(_LOOPBACK_PREFIXES)  # noqa: S104 (a comparison: a wildcard listener)
    return {"host": mon["host"], "url": _url("127.0.0.1" if local else listen, _as_port(mon["alertmanager_port"]))}


def view_inputs(groups, hostvars, defaults):
    """The view's input from raw inventory data: groups (name -> hosts, inventory order), hostvars (host -> the
    VIEW_VARS it sets) and defaults (role -> its defaults/main.yml). Returns (hosts, routers, monitoring, peers):
    hosts is validate_topology's input (vLLM hosts), the others as cluster_view takes them."""
    groups = groups or {}
    hostvars = hostvars or {}

    def var(host, name):
        hv = hostvars.get(host) or {}
        if name in hv and hv[name] is not None:
            return hv[name]
        role = VIEW_VARS.get(name)
        return ((defaults or {}).get(role) or {}).get(name) if role else None

    def address(host):
        return var(host, "ansible_host") or host

    hosts = {h: {"ansible_host": var(h, "ansible_host"), "pd_instances": var(h, "pd_instances"),
                 "node_exporter_port": var(h, "node_exporter_port")}
             for h in groups.get("vllm_hosts") or []}
    routers = [{"host": h, "address": address(h), "client_port": var(h, "pd_router_port"),
                "bind_host": var(h, "pd_router_bind_host"), "units": var(h, "pd_router_units"),
                "frontdoor_metrics_port": var(h, "pd_frontdoor_metrics_port"),
                "node_exporter_port": var(h, "node_exporter_port")}
               for h in groups.get("router_hosts") or []]
    monitoring = [{"host": h, "address": address(h), "prometheus_port": var(h, "observability_prometheus_port"),
                   "alertmanager_port": (var(h, "observability_alertmanager_port")
                                         if _truthy(var(h, "observability_alertmanager_enabled")) else None),
                   "alertmanager_listen_address": var(h, "observability_alertmanager_listen_address"),
                   "dcgm_exporter_port": var(h, "observability_dcgm_exporter_port")}
                  for h in groups.get("monitoring_hosts") or []]
    # Every inventory host's ansible_host (a host without one adds none) and its pd_firewall_host_addresses.
    peers = []
    for h in groups.get("all") or []:
        if var(h, "ansible_host") is not None:
            peers.append(var(h, "ansible_host"))
        peers += list(var(h, "pd_firewall_host_addresses") or [])
    return hosts, routers, monitoring, peers


def _check_router(problems, router):
    host = router.get("host")
    where = f"router host {host}"
    units = router.get("units")
    if not isinstance(units, list) or not units:
        problems.append(f"{where}, field pd_router_units: missing or empty; list its router units (group_vars/all/"
                        "router.yml, see roles/pd_router/defaults/main.yml)")
        return
    for idx, unit in enumerate(units):
        if not isinstance(unit, dict):
            problems.append(f"{where}, field pd_router_units[{idx}]: {_short(unit)} is not a mapping of name, mode, "
                            "port, metrics_port")
            continue
        if not isinstance(unit.get("name"), str) or not unit.get("name"):
            problems.append(f"{where}, field pd_router_units[{idx}].name: missing; name the unit (vllm-router...)")
        if unit.get("mode") not in ROUTER_UNIT_MODES:
            problems.append(f"{where}, field pd_router_units[{idx}].mode: {_short(unit.get('mode'))} is not a mode; "
                            "use pd or colocated")
        for field in ("port", "metrics_port"):
            port = _as_port(unit.get(field))
            if not _is_int(port) or not MIN_UNPRIVILEGED_PORT <= port <= 65535:
                # the router units run as an unprivileged user without capabilities: no port below 1024
                problems.append(f"{where}, field pd_router_units[{idx}].{field}: {_short(unit.get(field))} is not a "
                                "port the unprivileged router can listen on; use an integer in 1024..65535")
    if not any(isinstance(u, dict) and u.get("mode") == "pd" for u in units):
        problems.append(f"{where}, field pd_router_units: no unit with mode: pd; a router host needs a P/D router")
    for field in ("client_port", "frontdoor_metrics_port"):
        port = _as_port(router.get(field))
        if not _is_int(port) or not 1 <= port <= 65535:
            # nginx binds as root: a front door on 443 is fine
            name = "pd_router_port" if field == "client_port" else "pd_frontdoor_metrics_port"
            problems.append(f"{where}, field {name}: {_short(router.get(field))} is not a TCP port; use an integer "
                            "in 1..65535")


def cluster_view(hosts, routers=(), monitoring=(), peers=()):
    """The normalized cluster view (JSON-able) of a topology that validate_topology() accepted.

    hosts: validate_topology's vLLM hosts (host -> {ansible_host, pd_instances, node_exporter_port}), inventory
    order. routers: [{host, address, client_port, bind_host, units, frontdoor_metrics_port, node_exporter_port}].
    monitoring: [{host, address, prometheus_port, alertmanager_port (None: not deployed),
    alertmanager_listen_address, dcgm_exporter_port}].
    peers: the addresses every host's firewall admits as cluster peers. view_inputs() builds all four from the
    inventory. Raises TopologyError when the router input is unusable.
    """
    problems = []
    for router in routers:
        _check_router(problems, router)
    if problems:
        raise TopologyError(problems)

    instances, pools = [], {p: [] for p in POOLS}
    firewall = {}
    for host, hv in hosts.items():
        address = hv.get("ansible_host") or host
        ports = []
        for inst in hv.get("pd_instances") or []:
            dp = inst.get("dp_size") or 1
            side = [inst["nixl_side_channel_port"] + r for r in range(dp)]
            entry = {"name": inst["name"], "host": host, "address": address, "pool": inst["pool"],
                     "http_port": inst["http_port"], "url": _url(address, inst["http_port"]),
                     "nixl_side_channel_port": inst["nixl_side_channel_port"], "nixl_side_channel_ports": side,
                     "dp_rpc_port": inst.get("dp_rpc_port")}
            instances.append(entry)
            pools[inst["pool"]].append(inst["name"])
            ports += [inst["http_port"], *side] + ([inst["dp_rpc_port"]] if inst.get("dp_rpc_port") is not None
                                                   else [])
        firewall[host] = {"instance_ports": sorted(set(ports)), "router_ports": [], "client_ports": []}

    view_routers, pd_router_urls = [], []
    for idx, r in enumerate(routers):
        units = [{"name": u["name"], "mode": u["mode"], "port": _as_port(u["port"]),
                  "metrics_port": _as_port(u["metrics_port"]), "url": _url(r["address"], _as_port(u["port"]))}
                 for u in r["units"]]
        client_port = _as_port(r["client_port"])
        view_routers.append({"host": r["host"], "address": r["address"], "client_port": client_port,
                             "url": _url(r["address"], client_port), "bind_host": r.get("bind_host"),
                             "frontdoor_metrics_port": _as_port(r["frontdoor_metrics_port"]), "units": units})
        # The P/D router units as the first router host reaches them (its own on loopback): pd_rollout's registry
        # tool runs there and drains every P/D router.
        pd_router_urls += [_url("127.0.0.1" if idx == 0 else r["address"], u["port"])
                           for u in units if u["mode"] == "pd"]
        fw = firewall.setdefault(r["host"], {"instance_ports": [], "router_ports": [], "client_ports": []})
        fw["router_ports"] = sorted({_as_port(r["frontdoor_metrics_port"])} | {u["port"] for u in units}
                                    | {u["metrics_port"] for u in units})
        fw["client_ports"] = [client_port]
    for m in monitoring:
        firewall.setdefault(m["host"], {"instance_ports": [], "router_ports": [], "client_ports": []})

    node_hosts = list(hosts) + [r["host"] for r in routers if r["host"] not in hosts]
    node_port = {h: hv.get("node_exporter_port") for h, hv in hosts.items()}
    for r in routers:
        node_port.setdefault(r["host"], r.get("node_exporter_port"))
    address_of = {h: (hv.get("ansible_host") or h) for h, hv in hosts.items()}
    for r in routers:
        address_of.setdefault(r["host"], r["address"])
    dcgm_port = _as_port(monitoring[0].get("dcgm_exporter_port")) if monitoring else None
    targets = {
        "vllm": [{"target": f"{i['address']}:{i['http_port']}",
                  "labels": {"pool": i["pool"], "instance_name": i["name"], "host": i["host"]}} for i in instances],
        "pd-router": [{"target": f"{r['address']}:{u['metrics_port']}",
                       "labels": {"host": r["host"], "router_unit": u["name"], "router_mode": u["mode"]}}
                      for r in view_routers for u in r["units"]],
        "pd-frontdoor": [{"target": f"{r['address']}:{r['frontdoor_metrics_port']}", "labels": {"host": r["host"]}}
                         for r in view_routers],
        "node": [{"target": f"{address_of[h]}:{_as_port(node_port[h])}",
                  "labels": {"host": h, "vllm_host": "true" if hosts.get(h, {}).get("pd_instances") else "false"}}
                 for h in node_hosts],
        "dcgm": [{"target": f"{address_of[h]}:{dcgm_port}", "labels": {"host": h}} for h in hosts],
    }
    first_mon = monitoring[0] if monitoring else None
    return {
        "instances": instances,
        "pools": pools,
        "routers": view_routers,
        "router_url": view_routers[0]["url"] if view_routers else None,
        "pd_router_urls": pd_router_urls,
        "prometheus_url": _url(first_mon["address"], _as_port(first_mon["prometheus_port"])) if first_mon else None,
        "alertmanager": _alertmanager_api(first_mon),
        "prometheus_targets": targets,
        "firewall": {"peers": sorted({str(p).strip() for p in peers}), "hosts": firewall},
    }
