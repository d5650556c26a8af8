# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Whole-topology validation (like kubespray's validate_inventory): pure, collects every problem.

validate_topology(hosts, recipe, sla) -> list of one-line problems, each naming host, instance, field and fix.
hosts: {host: {"pd_instances": [...], "pd_gpus_per_host": int, "ansible_host": str, "recipe": {optional
per-host overrides of the recipe vars}}}.
"""

from __future__ import annotations

import difflib

try:  # imported as ansible.module_utils.pd_topology from modules, plainly from tests
    from ansible.module_utils.pd_recipe import (
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
    )
except ImportError:  # pragma: no cover - tests put module_utils/ on sys.path
    from pd_recipe import (  # type: ignore[no-redef]
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


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _suggest(word, choices):
    match = difflib.get_close_matches(str(word), choices, n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _check_port(problems, where, field, value):
    if not _is_int(value) or not 1 <= value <= 65535:
        problems.append(f"{where}, field {field}: {value!r} is not a TCP port; use an integer in 1024..65535")
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
        problems.append(f"{where}, field pd_model_path: {model!r} is not an absolute path")
    name = recipe.get("pd_served_model_name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        problems.append(f"{where}, field pd_served_model_name: must be a non-empty string")
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
                if roles.get(pool) not in KV_ROLES:
                    problems.append(
                        f"{where}, field pd_kv_roles.{pool}: kv role {roles.get(pool)!r} is missing or invalid; "
                        f"set pd_kv_roles.{pool}: {'kv_producer' if pool == 'prefill' else 'kv_consumer'} "
                        f"(one of {', '.join(KV_ROLES)})"
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
        elif value <= 0:
            problems.append(f"pd_sla, field {field}: {value!r} must be > 0")
    lo, hi = sla.get("context_min_tokens"), sla.get("context_max_tokens")
    if _is_int(lo) and _is_int(hi) and lo > hi:
        problems.append(
            f"pd_sla, field context_min_tokens: {lo} > context_max_tokens {hi}; the minimum must not exceed the maximum"
        )
    return problems


def _validate_instance(problems, host, idx, inst, gpus_per_host):
    """Field-level checks of one instance. Returns True when it is sound enough for cross checks."""
    if not isinstance(inst, dict):
        problems.append(f"host {host}, pd_instances[{idx}]: must be a mapping, got {type(inst).__name__}")
        return False
    name = inst.get("name")
    where = f"host {host}, instance {name}" if name else f"host {host}, pd_instances[{idx}]"
    ok = True
    for field in inst:
        if field not in KNOWN_FIELDS:
            problems.append(f"{where}, field {field}: unknown field; remove it{_suggest(field, KNOWN_FIELDS)}")
            ok = False
    for field in REQUIRED_FIELDS:
        if field not in inst or inst[field] is None:
            problems.append(f"{where}, field {field}: missing; every instance needs {', '.join(REQUIRED_FIELDS)}")
            ok = False
    if name is not None and (not isinstance(name, str) or not INSTANCE_NAME_RE.match(name)):
        problems.append(
            f"{where}, field name: {name!r} is not a valid name; use lowercase letters, digits and '-' "
            "(it becomes vllm-<name>.service)"
        )
        ok = False
    pool = inst.get("pool")
    if pool is not None and pool not in POOLS:
        problems.append(f"{where}, field pool: {pool!r} is not a pool; use prefill or decode{_suggest(pool, POOLS)}")
        ok = False
    for field in ("tp_size", "dp_size"):
        v = inst.get(field)
        if v is not None and (not _is_int(v) or v < 1):
            problems.append(f"{where}, field {field}: {v!r} must be an integer >= 1")
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
    if ucx is not None and (not isinstance(ucx, str) or not ucx.strip()):
        problems.append(f"{where}, field ucx_net_devices: must be a string like 'mlx5_0:1,mlx5_1:1'")
        ok = False
    before = len(problems)
    problems += check_flag_dict(inst.get("extra_flags"), "extra_flags", where)
    problems += check_env_dict(inst.get("extra_env"), "extra_env", where)
    ok = ok and len(problems) == before
    gpus = inst.get("gpus")
    if gpus is not None:
        if not isinstance(gpus, list) or any(not _is_int(g) or g < 0 for g in gpus):
            problems.append(f"{where}, field gpus: {gpus!r} must be a list of GPU indexes (integers >= 0), [] on CPU")
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


def validate_topology(hosts, recipe, sla):
    problems = validate_recipe(recipe)
    recipe_ok = not problems  # a broken recipe is reported once, not again for every instance
    problems += validate_sla(sla)
    if not isinstance(hosts, dict) or not hosts:
        problems.append(
            "group vllm_hosts: no hosts; put the vLLM servers in group vllm_hosts of the inventory (hosts.yml)"
        )
        return problems
    names = {}
    good = []  # (host, instance, host_recipe)
    for host, hv in hosts.items():
        if not isinstance(hv, dict):
            problems.append(f"host {host}: host vars are not a mapping")
            continue
        addr = hv.get("ansible_host")
        if not isinstance(addr, str) or not addr.strip():
            problems.append(f"host {host}, field ansible_host: missing; set the host's address in hosts.yml")
        gph = hv.get("pd_gpus_per_host")
        if not _is_int(gph) or gph < 0:
            problems.append(
                f"host {host}, field pd_gpus_per_host: {gph!r} must be an integer >= 0 (8 on B300, 0 on CPU)"
            )
            gph = None
        host_recipe = dict(recipe) if isinstance(recipe, dict) else {}
        overrides = hv.get("recipe") or {}
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
        # Port collisions on the host (HTTP, NIXL side-channel ranges, DP RPC), across kinds.
        claimed = {}
        for inst in host_good:
            for port, what in _port_claims(inst):
                if port in claimed:
                    field = what.split(" of ")[0].replace("NIXL side-channel port", "nixl_side_channel_port")
                    problems.append(
                        f"host {host}, instance {inst['name']}, field {field}: port {port} ({what}) is already "
                        f"the {claimed[port]}; pick a free port"
                    )
                else:
                    claimed[port] = what
        for inst in host_good if host_recipe_ok else []:
            try:
                build_argv(host_recipe, inst)
                build_env(host_recipe, inst, addr if isinstance(addr, str) else "", state_root="/var/lib/vllm")
            except RecipeError as exc:
                problems.append(f"host {host}, {exc}")
                continue
            good.append((host, inst, host_recipe))
    for name, where in names.items():
        if len(where) > 1:
            problems.append(
                f"host {', '.join(where)}, instance {name}, field name: {name!r} is used {len(where)} times; "
                "instance names must be unique in the cluster (unit vllm-<name>.service)"
            )
    # Cluster-wide P/D consistency.
    by_pool = {p: [(h, i, r) for h, i, r in good if i["pool"] == p] for p in POOLS}
    declared = {p for hv in hosts.values() if isinstance(hv, dict) and isinstance(hv.get("pd_instances"), list)
                for i in hv["pd_instances"] if isinstance(i, dict) for p in [i.get("pool")]}
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
    out = {"hosts": 0, "instances": {p: [] for p in POOLS}, "gpus": 0}
    for host, hv in (hosts or {}).items():
        out["hosts"] += 1
        for inst in (hv or {}).get("pd_instances") or []:
            if isinstance(inst, dict) and inst.get("pool") in POOLS:
                out["instances"][inst["pool"]].append(f"{host}/{inst.get('name')}")
                out["gpus"] += len(inst.get("gpus") or [])
    return out
