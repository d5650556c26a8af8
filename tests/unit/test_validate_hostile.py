"""Property test (issue 18): whatever hostile topology reaches pd_topology, it answers with problem lines or
success, never another exception; and what it accepts renders units and env files with nothing injected.

Generated from the real b300 inventory by mutations: wrong types, control characters, odd unicode, huge
numbers, nan/inf, ports copied from another listener, whole host vars / recipe / sla / services replaced.
"""

from __future__ import annotations

import copy

from ansible_collections.b300.pd.plugins.module_utils import pd_recipe, pd_topology, pd_unit
from ansible_collections.b300.pd.tests.unit.pd_testlib import load_inventory, topology_input
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BASE = load_inventory("b300")
BASE_HOSTS = topology_input(BASE)
SERVICES = [
    {"host": "b300-03", "port": 8000, "field": "pd_router_port", "service": "P/D router API"},
    {"host": "b300-03", "port": 29000, "field": "pd_router_metrics_port", "service": "P/D router metrics"},
    {"host": "b300-03", "port": 9090, "field": "observability_prometheus_port", "service": "Prometheus"},
    *({"host": h, "port": 9100, "field": "node_exporter_port", "service": "node exporter"} for h in BASE_HOSTS),
]
# Ports already in use somewhere in the base topology: copying one elsewhere makes a clash.
USED_PORTS = sorted(
    {s["port"] for s in SERVICES}
    | {i[f] for hv in BASE_HOSTS.values() for i in hv["pd_instances"]
       for f in ("http_port", "nixl_side_channel_port", "dp_rpc_port")}
    | {5603, 5707}  # inside the NIXL side-channel ranges
)
FLAG_NAMES = ["gpu-memory-utilization", "max-model-len", "max-num-batched-tokens", "max_num_seqs", "block-size",
              "kv-cache-dtype", "speculative-config", "port", "tp", "--seed", "seed\n", "Weird Name", ""]
FIELDS = [*pd_topology.KNOWN_FIELDS, "tp", "name ", "pool\n"]

CONTROL = st.sampled_from(["\n", "\r", "\0", "\t", "\x1b", "\x7f", "\x85", "\u2028", "\r\n"])
INJECTED = st.builds(
    lambda head, ctl, tail: head + ctl + tail,
    st.sampled_from(["prefill-a", "GLM-5.2", "/mnt/model/glm", "mlx5_0:1", "8100", "1k", "all", "kv_producer", ""]),
    CONTROL,
    st.sampled_from(["", "[Service]", "ExecStartPre=/bin/true", " x", "%n", "$HOME"]),
)
ODD_TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)  # any code point, controls included
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 1023, 1024, 65535, 65536, 10**30, *USED_PORTS]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, 1.5, 1e308]),
    INJECTED,
    ODD_TEXT,
    st.sampled_from(["prefill", "decode", "kv_both", "kv_consumer", "mlx5_0:1, mlx5_1:1", "1k", "0.9", "8100"]),
)
KEYS = st.one_of(ODD_TEXT, INJECTED, st.sampled_from(FLAG_NAMES + FIELDS), st.integers(-3, 3))
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(KEYS, inner, max_size=3)),
    max_leaves=8,
)


def _instances(hosts):
    if not isinstance(hosts, dict):
        return []
    return [(h, i) for h, hv in hosts.items() if isinstance(hv, dict) and isinstance(hv.get("pd_instances"), list)
            for i in range(len(hv["pd_instances"])) if isinstance(hv["pd_instances"][i], dict)]


def _flag_dicts(recipe, hosts):
    out = []
    if isinstance(recipe.get("pd_vllm_flags_common"), dict):
        out.append(recipe["pd_vllm_flags_common"])
    pools = recipe.get("pd_vllm_flags_pool")
    if isinstance(pools, dict):
        out += [v for v in pools.values() if isinstance(v, dict)]
    for h, i in _instances(hosts):
        out.append(hosts[h]["pd_instances"][i].setdefault("extra_flags", {}))
    return [d for d in out if isinstance(d, dict)]  # an earlier mutation may have made one a list or None


@st.composite
def topologies(draw):
    hosts = copy.deepcopy(BASE_HOSTS)
    recipe = copy.deepcopy(BASE["recipe"])
    sla = dict(BASE["group_vars"]["pd_sla"])
    services = copy.deepcopy(SERVICES)
    for _i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(
            ["instance", "instance", "port-clash", "flag", "flag", "env", "recipe", "host", "hostvars", "sla",
             "service", "host-key", "kv-role", "whole"]))
        insts = _instances(hosts)
        if kind == "instance" and insts:
            h, i = draw(st.sampled_from(insts))
            hosts[h]["pd_instances"][i][draw(st.sampled_from(FIELDS))] = draw(VALUES)
        elif kind == "port-clash" and insts:
            h, i = draw(st.sampled_from(insts))
            field = draw(st.sampled_from(["http_port", "nixl_side_channel_port", "dp_rpc_port"]))
            hosts[h]["pd_instances"][i][field] = draw(st.sampled_from(USED_PORTS))
        elif kind == "flag":
            dicts = _flag_dicts(recipe, hosts)
            if dicts:
                draw(st.sampled_from(dicts))[draw(KEYS)] = draw(VALUES)
        elif kind == "env":
            target = draw(st.sampled_from(["pd_vllm_env", "pd_ucx_env", "extra_env"]))
            if target == "extra_env" and insts:
                h, i = draw(st.sampled_from(insts))
                env = hosts[h]["pd_instances"][i].setdefault("extra_env", {})
            else:
                env = recipe.setdefault(target, {}) if isinstance(recipe.get(target, {}), dict) else {}
            if isinstance(env, dict):
                env[draw(KEYS)] = draw(VALUES)
        elif kind == "recipe":
            recipe[draw(st.sampled_from(pd_recipe.RECIPE_KEYS))] = draw(VALUES)
        elif kind == "kv-role" and isinstance(recipe.get("pd_kv_roles"), dict):
            recipe["pd_kv_roles"][draw(st.sampled_from(["prefill", "decode", "other"]))] = draw(
                st.one_of(st.sampled_from(pd_recipe.KV_ROLES), VALUES))
        elif kind == "host":
            h = draw(st.sampled_from(list(hosts)))
            if isinstance(hosts[h], dict):
                key = draw(st.sampled_from(["ansible_host", "pd_gpus_per_host", "pd_instances", "recipe"]))
                value = draw(st.one_of(VALUES, st.fixed_dictionaries(
                    {}, optional={k: VALUES for k in pd_recipe.RECIPE_KEYS})))
                hosts[h][key] = value
        elif kind == "hostvars":
            hosts[draw(st.sampled_from(list(hosts)))] = draw(VALUES)
        elif kind == "sla" and isinstance(sla, dict):
            sla[draw(st.sampled_from([*pd_topology.SLA_FIELDS, "other"]))] = draw(VALUES)
        elif kind == "service" and isinstance(services, list):
            if services and draw(st.booleans()):
                entry = draw(st.sampled_from(services))
                if isinstance(entry, dict):
                    entry[draw(st.sampled_from(["host", "port", "field", "service"]))] = draw(
                        st.one_of(st.sampled_from([*USED_PORTS, "b300-01", "router-0"]), VALUES))
            else:
                services.append(draw(st.one_of(VALUES, st.fixed_dictionaries({
                    "host": st.sampled_from([*BASE_HOSTS, "router-0"]), "port": st.sampled_from(USED_PORTS),
                    "field": st.just("pd_router_port"), "service": st.just("P/D router API")}))))
        elif kind == "host-key":
            hosts[draw(st.one_of(KEYS, st.sampled_from(list(hosts))))] = copy.deepcopy(BASE_HOSTS["b300-02"])
        elif kind == "whole":
            which = draw(st.sampled_from(["hosts", "recipe", "sla", "services"]))
            value = draw(VALUES)
            # Last mutation: the others need the dicts this one may have replaced.
            return (value if which == "hosts" else hosts, value if which == "recipe" else recipe,
                    value if which == "sla" else sla, value if which == "services" else services)
    return hosts, recipe, sla, services


PYTHON, USER = "/opt/vllm/current/bin/python", "vllm"


def _directives(unit):
    """Section headers and directive names of a unit, in order (ExecStart continuation lines skipped)."""
    return [line.split("=", 1)[0] for line in unit.split("\n") if line and not line.startswith((" ", "#"))]


# What the renderer writes for the valid inventory: an accepted hostile topology may not add to it.
BASE_DIRECTIVES = [_directives(pd_unit.render_unit(BASE["recipe"], i, PYTHON, USER))
                   for hv in BASE_HOSTS.values() for i in hv["pd_instances"]]
ALLOWED_COUNT = {d: max(ds.count(d) for ds in BASE_DIRECTIVES) for ds in BASE_DIRECTIVES for d in ds}


def _assert_rendered_safely(hosts, recipe):
    """An accepted topology renders every unit with no control character and no section or directive that the
    valid inventory's units do not have (no injected [Service] or ExecStartPre=)."""
    for h, i in _instances(hosts):
        hv, inst = hosts[h], hosts[h]["pd_instances"][i]
        host_recipe = dict(recipe)
        host_recipe.update({k: v for k, v in (hv.get("recipe") or {}).items() if k in pd_recipe.RECIPE_KEYS})
        unit = pd_unit.render_unit(host_recipe, inst, PYTHON, USER)
        env = pd_recipe.render_env_file(pd_recipe.build_env(host_recipe, inst, hv["ansible_host"]), inst)
        for text in (unit, env):
            assert pd_recipe.CONTROL_CHAR_RE.search(text.replace("\n", "")) is None, text
        directives = _directives(unit)
        assert all(directives.count(d) <= ALLOWED_COUNT.get(d, 0) for d in directives), unit


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(topologies())
def test_hostile_topology_gets_problems_or_success_never_an_exception(topology):
    hosts, recipe, sla, services = topology
    problems = pd_topology.validate_topology(hosts, recipe, sla, services)
    summary = pd_topology.summarize(hosts)  # the module returns it on failure too
    assert isinstance(problems, list) and all(isinstance(p, str) and p for p in problems)
    assert isinstance(summary["hosts"], int)
    if not problems:
        _assert_rendered_safely(hosts, recipe)
