# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Whole-topology validation (like kubespray's validate_inventory): pure, collects every problem.

validate_topology(hosts, recipe, sla) -> list of one-line problems, each naming host, instance, field and fix.
hosts: {host: {"pd_instances": [...], "pd_gpus_per_host": int, "ansible_host": str, "recipe": {optional
per-host overrides of the recipe vars}}}.
Here: the recipe, pd_sla, each instance's fields and GPUs, and the cluster-wide P/D agreement; the port matrix of
each host is pd_topology_ports, the cluster view of a valid topology pd_cluster_view.
"""

from __future__ import annotations

import math
import re

from ansible_collections.b300.pd.plugins.module_utils.pd_input_rules import (
    InputError,
    check_abs_path,
    check_host,
    problems_of,
)
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
from ansible_collections.b300.pd.plugins.module_utils.pd_topology_ports import check_host_ports, service_claims
from ansible_collections.b300.pd.plugins.module_utils.pd_topology_values import (
    check_port,
    is_int,
    short,
    suggest,
)
from ansible_collections.b300.pd.plugins.module_utils.pd_unit import UNIT_WRITABLE_ENV, unit_writable_paths

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
# The kv roles each pool may have: prefill hands its KV cache out, decode takes it in (kv_both does either).
POOL_KV_ROLES = {"prefill": ("kv_producer", "kv_both"), "decode": ("kv_consumer", "kv_both")}
# One UCX_NET_DEVICES entry as the bundle uses it: an RDMA device and its port (ucx_info -d names them so, and
# rdma_nixl / preflight look each device up in ibv_devices / /sys/class/infiniband).
UCX_NET_DEVICE_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,63}:[1-9][0-9]{0,2}\Z")
# A host address as it goes into VLLM_NIXL_SIDE_CHANNEL_HOST: IPv4/IPv6 literal or DNS name, nothing else.
HOST_ADDRESS_RE = re.compile(r"\A[A-Za-z0-9_.:%-]{1,253}\Z")


def check_writable_env_paths(env, field, where):
    """Problems of the env vars the unit makes writable (UNIT_WRITABLE_ENV: TMPDIR, HF_HOME, ...): an absolute value
    goes into the unit's ReadWritePaths= list, where a space would add another path (issue 32: "/srv/x /etc")."""
    if not isinstance(env, dict):
        return []  # check_env_dict names the type
    return [line for key in UNIT_WRITABLE_ENV
            if isinstance(env.get(key), str) and env[key].startswith("/")
            for line in problems_of(check_abs_path, f"field {field}.{key}", env[key], where=where)]


def validate_recipe(recipe, where="group_vars (recipe)"):
    problems = []
    if not isinstance(recipe, dict):
        return [f"{where}: the recipe vars are not a mapping; define them in group_vars/all/recipe.yml"]
    for key in RECIPE_KEYS:
        if key not in recipe or recipe[key] is None:
            problems.append(f"{where}, field {key}: missing; define it in group_vars/all/recipe.yml")
    model = recipe.get("pd_model_path")
    if model is not None and (not isinstance(model, str) or not model.startswith("/")):
        problems.append(f"{where}, field pd_model_path: {short(model)} is not an absolute path")
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
                        + suggest(pool, POOLS)
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
                        f"{where}, field pd_kv_roles.{pool}: kv role {short(role)} is missing or invalid; "
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
    for env_field in ("pd_vllm_env", "pd_ucx_env"):
        problems += check_env_dict(recipe.get(env_field), env_field, where)
        problems += check_writable_env_paths(recipe.get(env_field), env_field, where)
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
    if is_int(lo) and is_int(hi) and lo > hi:
        problems.append(
            f"pd_sla, field context_min_tokens: {lo} > context_max_tokens {hi}; the minimum must not exceed the maximum"
        )
    return problems


def _check_ucx_net_devices(problems, where, value):
    """UCX_NET_DEVICES of one instance: 'dev:port[,dev:port...]' of RDMA devices. Returns True when sound."""
    fix = "use RDMA device:port names like 'mlx5_0:1,mlx5_1:1' (ibv_devices), or omit the field for UCX's default"
    if not isinstance(value, str) or not value.strip():
        problems.append(f"{where}, field ucx_net_devices: {short(value)} is not a device list; {fix}")
        return False
    found = control_char(value)
    if found:
        problems.append(f"{where}, field ucx_net_devices: {short(value)} contains {found}; {fix}")
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
            f"{where}, field ucx_net_devices: {', '.join(short(e) for e in bad[:3])} not of the form device:port "
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
            problems.append(f"{where}, field {short(field) if control_char(str(field)) else field}: unknown field; "
                            f"remove it{suggest(field, KNOWN_FIELDS)}")
            ok = False
    for field in REQUIRED_FIELDS:
        if field not in inst or inst[field] is None:
            problems.append(f"{where}, field {field}: missing; every instance needs {', '.join(REQUIRED_FIELDS)}")
            ok = False
    if name is not None and (not isinstance(name, str) or not INSTANCE_NAME_RE.match(name)):
        problems.append(
            f"{where}, field name: {short(name)} is not a valid name; use lowercase letters, digits and '-' "
            "(it becomes vllm-<name>.service)"
        )
        ok = False
    pool = inst.get("pool")
    if pool is not None and (not isinstance(pool, str) or pool not in POOLS):
        problems.append(
            f"{where}, field pool: {short(pool)} is not a pool; use prefill or decode{suggest(pool, POOLS)}"
        )
        ok = False
    for field in ("tp_size", "dp_size"):
        v = inst.get(field)
        if v is not None and (not is_int(v) or v < 1):
            problems.append(f"{where}, field {field}: {short(v)} must be an integer >= 1")
            ok = False
    for field in ("http_port", "nixl_side_channel_port"):
        if inst.get(field) is not None and not check_port(problems, where, field, inst[field]):
            ok = False
    dp = inst.get("dp_size")
    if is_int(dp) and dp > 1:
        if inst.get("dp_rpc_port") is None:
            problems.append(f"{where}, field dp_rpc_port: missing; required when dp_size > 1 (a free TCP port)")
            ok = False
        elif not check_port(problems, where, "dp_rpc_port", inst["dp_rpc_port"]):
            ok = False
    elif inst.get("dp_rpc_port") is not None:
        check_port(problems, where, "dp_rpc_port", inst["dp_rpc_port"])
    base = inst.get("nixl_side_channel_port")
    if is_int(base) and is_int(dp) and dp >= 1 and base + dp - 1 > 65535:
        problems.append(f"{where}, field nixl_side_channel_port: range {base}..{base + dp - 1} passes 65535; lower it")
        ok = False
    ucx = inst.get("ucx_net_devices")
    if ucx is not None and not _check_ucx_net_devices(problems, where, ucx):
        ok = False
    before = len(problems)
    problems += check_flag_dict(inst.get("extra_flags"), "extra_flags", where)
    problems += check_env_dict(inst.get("extra_env"), "extra_env", where)
    problems += check_writable_env_paths(inst.get("extra_env"), "extra_env", where)
    ok = ok and len(problems) == before
    gpus = inst.get("gpus")
    if gpus is not None:
        if not isinstance(gpus, list) or any(not is_int(g) or g < 0 for g in gpus):
            problems.append(
                f"{where}, field gpus: {short(gpus)} must be a list of GPU indexes (integers >= 0), [] on CPU"
            )
            return False
        if len(set(gpus)) != len(gpus):
            problems.append(f"{where}, field gpus: {gpus} lists a GPU twice")
            ok = False
        if is_int(gpus_per_host):
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
                if is_int(tp) and is_int(dpv) and len(gpus) != tp * dpv:
                    problems.append(
                        f"{where}, field gpus: {len(gpus)} GPUs but tp_size*dp_size = {tp}*{dpv} = {tp * dpv}; "
                        "list exactly tp_size*dp_size GPUs"
                    )
                    ok = False
    return ok


def validate_topology(hosts, recipe, sla, services=None):
    """Every problem of the topology, one line each. services: the bundle's other listeners, a list of
    {host, port, field, service} (router API and metrics, Prometheus, node exporter), checked for port clashes."""
    problems = validate_recipe(recipe)
    recipe_ok = not problems  # a broken recipe is reported once, not again for every instance
    problems += validate_sla(sla)
    services_by_host = service_claims(problems, services)
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
                f"host {host}, field ansible_host: {short(addr)} is not an IP address or DNS name (it becomes "
                "VLLM_NIXL_SIDE_CHANNEL_HOST); fix it in hosts.yml"
            )
        else:  # the shared rule: an address or DNS name alone (no port, no '_')
            problems += problems_of(check_host, "field ansible_host", addr, where=f"host {host}")
        gph = hv.get("pd_gpus_per_host")
        if not is_int(gph) or gph < 0:
            problems.append(
                f"host {host}, field pd_gpus_per_host: {short(gph)} must be an integer >= 0 (8 on B300, 0 on CPU)"
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
        check_host_ports(problems, host, services_by_host.pop(host, []), host_good)
        for inst in host_good if host_recipe_ok else []:
            try:
                build_argv(host_recipe, inst)
                build_env(host_recipe, inst, addr if isinstance(addr, str) else "", state_root="/var/lib/vllm")
                # The unit's ReadWritePaths= (its writer refuses an env path that opens the model directory).
                unit_writable_paths(host_recipe, inst)
            except (RecipeError, InputError) as exc:
                problems.append(f"host {host}, {exc}")
                continue
            good.append((host, inst, host_recipe))
    for host, claims in services_by_host.items():  # hosts without vLLM instances (router, monitoring)
        check_host_ports(problems, host, claims)
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
    for ph, pi, _recipe in by_pool["prefill"]:
        for dh, di, _decode_recipe in by_pool["decode"]:
            if pi["tp_size"] > di["tp_size"]:
                problems.append(
                    f"host {ph}, instance {pi['name']}, field tp_size: prefill TP {pi['tp_size']} > decode TP "
                    f"{di['tp_size']} of {di['name']} on {dh}; NIXL needs prefill TP <= decode TP"
                )
    flags = {(h, i["name"]): build_flags(r, i) for h, i, r in good}
    models = {(h, i["name"]): r.get("pd_model_path") for h, i, r in good}
    if by_pool["prefill"] and by_pool["decode"]:
        ref_h, ref_i, _ref_recipe = by_pool["decode"][0]
        ref = (ref_h, ref_i["name"])
        for h, i, _recipe in by_pool["prefill"] + by_pool["decode"][1:]:
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
