"""Property test (issue 18): whatever hostile topology reaches pd_topology, it answers with problem lines or
success, never another exception; and what it accepts renders units and env files with nothing injected.
Issue 32 adds the inventory outside the topology (router, front door, firewall, Alertmanager vars and the address of
a router-only host: pd_inventory_rules.validate_inventory) and the env vars whose paths the unit makes writable: what
the validation accepts, the writers write as one word / one line.

Generated from the real b300 inventory by mutations: wrong types, control characters, odd unicode, huge
numbers, nan/inf, ports copied from another listener, whole host vars / recipe / sla / services replaced.
"""

from __future__ import annotations

import copy
import ipaddress
import shlex

from ansible_collections.b300.pd.plugins.module_utils import pd_input_rules as rules
from ansible_collections.b300.pd.plugins.module_utils import pd_inventory_rules, pd_recipe, pd_topology, pd_unit
from ansible_collections.b300.pd.plugins.plugin_utils import pd_frontdoor, pd_router
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
# Values of a path env var (TMPDIR, HF_HOME, ...): the "/srv/x /etc" and its relatives.
PATHS = st.builds(
    lambda head, sep, tail: head + sep + tail,
    st.sampled_from(["/srv/x", "/scratch", "/var/lib/vllm/t", "/", "rel", "/srv/a'b", '/srv/"q"']),
    st.sampled_from(["", " ", "\t", ";", "/../", "/", "\\ ", "%"]),
    st.sampled_from(["", "/etc", "etc", "-/etc", "x"]),
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


def _drawn_env(draw, targets, recipe, hosts, insts):
    """One env map of the topology to mutate: a recipe-level one of `targets` or an instance's extra_env (not a
    dict when an earlier mutation replaced it)."""
    target = draw(st.sampled_from(targets))
    if target == "extra_env" and insts:
        h, i = draw(st.sampled_from(insts))
        return hosts[h]["pd_instances"][i].setdefault("extra_env", {})
    return recipe.setdefault(target, {}) if isinstance(recipe.get(target, {}), dict) else {}


@st.composite
def topologies(draw):
    hosts = copy.deepcopy(BASE_HOSTS)
    recipe = copy.deepcopy(BASE["recipe"])
    sla = dict(BASE["group_vars"]["pd_sla"])
    services = copy.deepcopy(SERVICES)
    for _i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(
            ["instance", "instance", "port-clash", "flag", "flag", "env", "env-path", "env-path", "recipe", "host",
             "hostvars", "sla", "service", "host-key", "kv-role", "whole"]))
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
            env = _drawn_env(draw, ["pd_vllm_env", "pd_ucx_env", "extra_env"], recipe, hosts, insts)
            if isinstance(env, dict):
                if draw(st.booleans()):  # a var the unit makes writable: its path goes into ReadWritePaths=
                    env[draw(st.sampled_from(pd_unit.UNIT_WRITABLE_ENV))] = draw(st.one_of(PATHS, VALUES))
                else:
                    env[draw(KEYS)] = draw(VALUES)
        elif kind == "env-path":  # issue 32: a path the unit makes writable, e.g. TMPDIR: "/srv/x /etc"
            env = _drawn_env(draw, ["pd_vllm_env", "extra_env", "extra_env"], recipe, hosts, insts)
            if isinstance(env, dict):
                env[draw(st.sampled_from(pd_unit.UNIT_WRITABLE_ENV))] = draw(PATHS)
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
        # Each writable path is one word of ReadWritePaths= (a space in one would add another path, e.g. /etc).
        paths = pd_unit.unit_writable_paths(host_recipe, inst)
        line = next(x for x in unit.split("\n") if x.startswith("ReadWritePaths="))
        assert line.split("=", 1)[1].split() == paths, line
        assert all(rules.check_abs_path("ReadWritePaths", p.removeprefix("-")) for p in paths), paths


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


@st.composite
def env_path_topologies(draw):
    """The valid b300 topology with only the paths of writable env vars changed (pd_vllm_env, pd_ucx_env,
    extra_env): the mutations above refuse most topologies for another reason, these reach the renderer."""
    hosts, recipe = copy.deepcopy(BASE_HOSTS), copy.deepcopy(BASE["recipe"])
    insts = _instances(hosts)
    for _i in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(["pd_vllm_env", "pd_ucx_env", "extra_env"]))
        if target == "extra_env":
            h, i = draw(st.sampled_from(insts))
            env = hosts[h]["pd_instances"][i].setdefault("extra_env", {})
        else:
            env = recipe.setdefault(target, {}) if isinstance(recipe.get(target), dict) else recipe[target]
        env[draw(st.sampled_from(pd_unit.UNIT_WRITABLE_ENV))] = draw(PATHS)
    return hosts, recipe


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(env_path_topologies())
def test_hostile_env_paths_are_refused_or_written_as_one_path(topology):
    hosts, recipe = topology
    problems = pd_topology.validate_topology(hosts, recipe, dict(BASE["group_vars"]["pd_sla"]), SERVICES)
    assert all(isinstance(p, str) and p for p in problems)
    if not problems:
        _assert_rendered_safely(hosts, recipe)


# --- issue 32: router, front door, firewall, Alertmanager and a router-only host's address -----------------------

GROUPS = {"all": ["b300-01", "gw"], "vllm_hosts": ["b300-01"], "router_hosts": ["gw"], "monitoring_hosts": ["gw"]}
ROUTER_WORKERS = {"prefill": [{"name": "p", "host": "b300-01", "url": "http://192.0.2.11:8100"}],
                  "decode": [{"name": "d", "host": "b300-01", "url": "http://192.0.2.11:8200"}]}
HOSTLIKE = st.builds(lambda head, tail: head + tail,
                     st.sampled_from(["192.0.2.20", "0.0.0.0", "::1", "gw.example", "fe80::1%eth0", "", "a_b"]),  # noqa: S104
                     st.sampled_from(["", ":80", " ; server 6.6.6.6", "\n", " --x", "/24", "."]))
FLAG_VALUES = st.one_of(SCALARS, st.lists(st.one_of(INJECTED, ODD_TEXT), max_size=2),
                        st.dictionaries(st.one_of(INJECTED, ODD_TEXT), INJECTED, max_size=2))
INVENTORY_VALUES = {
    "ansible_host": st.one_of(HOSTLIKE, VALUES),
    "pd_firewall_host_addresses": st.one_of(st.lists(st.one_of(HOSTLIKE, VALUES), max_size=3), VALUES),
    "pd_firewall_extra_peers": st.one_of(st.lists(HOSTLIKE, max_size=3), VALUES),
    "pd_router_bind_host": st.one_of(HOSTLIKE, VALUES),
    "pd_router_metrics_bind_host": HOSTLIKE,
    "pd_router_extra_args": st.one_of(st.dictionaries(st.one_of(KEYS, st.sampled_from(
        ["max-payload-size", "--cors-allowed-origins", "x_y"])), FLAG_VALUES, max_size=3), VALUES),
    "pd_router_log_level": st.one_of(INJECTED, st.just("debug"), VALUES),
    "pd_router_policy": st.one_of(INJECTED, st.just("random")),
    "pd_router_health_check_endpoint": st.one_of(INJECTED, st.just("/health")),
    "pd_frontdoor_bind_host": HOSTLIKE,
    "pd_frontdoor_access_log": st.one_of(PATHS, VALUES),
    "observability_alertmanager_listen_address": HOSTLIKE,
    "observability_alertmanager_receivers": st.one_of(VALUES, st.lists(st.fixed_dictionaries(
        {"name": st.one_of(INJECTED, st.just("ops"))},
        optional={"webhook_configs": st.lists(st.fixed_dictionaries({"url": st.one_of(INJECTED, ODD_TEXT)}),
                                              max_size=2)}), max_size=2)),
    "observability_alertmanager_group_wait": st.one_of(INJECTED, st.just("30s"), VALUES),
}


@st.composite
def inventories(draw):
    """Host vars of a vLLM host and a router-only (router + monitoring) host, some vars hostile."""
    hostvars = {"b300-01": {"ansible_host": "192.0.2.11"}, "gw": {"ansible_host": "192.0.2.20"}}
    for var in draw(st.lists(st.sampled_from(sorted(INVENTORY_VALUES)), min_size=1, max_size=4, unique=True)):
        hostvars[draw(st.sampled_from(["gw", "gw", "b300-01"]))][var] = draw(INVENTORY_VALUES[var])
    return hostvars


def _assert_written_safely(own):
    """What validate_inventory accepted for the router-only host, through its writers: one word / one line each."""
    def word(text):
        assert text and not any(c.isspace() or c in ";{}'\"" for c in text), text
        return text

    settings = {"host": own.get("pd_router_bind_host") or "0.0.0.0", "port": 8001,  # noqa: S104
                "metrics_host": own.get("pd_router_metrics_bind_host") or "0.0.0.0", "metrics_port": 29000,  # noqa: S104
                "client_port": 8000, "log_level": own.get("pd_router_log_level") or "info",
                "policy": own.get("pd_router_policy"),
                "health_check_endpoint": own.get("pd_router_health_check_endpoint"),
                "extra_args": own.get("pd_router_extra_args") or {}}
    units = [{"name": "vllm-router", "mode": "pd", "port": 8001, "metrics_port": 29000}]
    try:
        rendered = pd_router.pd_router_units(units, ROUTER_WORKERS, settings)
    except pd_router.PdFilterError as err:  # the role's own rules (a flag it renders itself), not an injection
        assert "pd_router_extra_args sets" in str(err), err
        rendered = []
    for unit in rendered:
        line = pd_router.pd_router_quote(unit["argv"])
        assert pd_recipe.CONTROL_CHAR_RE.search(line) is None, line
        assert len(shlex.split(line)) == len(unit["argv"]), line  # no argument split into two, none joined
    cluster = {"routers": [{"host": "r1", "address": "192.0.2.13", "units": [{"name": "vllm-router", "mode": "pd",
                                                                              "port": 8001}]},
                           {"host": "gw", "address": own.get("ansible_host") or "gw", "units": units}]}
    for backend in pd_frontdoor.pd_frontdoor_backends(cluster, "r1", "0.0.0.0"):  # noqa: S104
        word(backend["address"])  # an nginx upstream: `server <address>;`
    for address in own.get("pd_firewall_host_addresses") or []:
        ipaddress.ip_network(address, strict=False)  # an nft set element
    for var in ("pd_frontdoor_bind_host", "observability_alertmanager_listen_address", "pd_frontdoor_access_log"):
        if own.get(var) is not None:  # null: unset, the role's default
            word(own[var])  # nginx `listen <addr>:<port>;`, alertmanager's ARGS="--web.listen-address=<addr>:<port>"
    for text in (own.get("observability_alertmanager_group_wait"), *_strings(own.get(
            "observability_alertmanager_receivers"))):
        assert text is None or pd_recipe.CONTROL_CHAR_RE.search(str(text)) is None, text


def _strings(value):
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, str):
        yield value


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(inventories())
def test_hostile_inventory_gets_problems_or_is_written_safely(hostvars):
    problems = pd_inventory_rules.validate_inventory(GROUPS, hostvars)
    assert isinstance(problems, list) and all(isinstance(p, str) and p.startswith("host ") for p in problems)
    if not problems:
        _assert_written_safely(hostvars["gw"])
    for host, own in hostvars.items():  # every refused var is named in a problem line of its host
        for var, value in own.items():
            if value is not None and rules.problems_of(_rule(var, host), var, value):
                assert any(f"field {var}" in p and host in p for p in problems), (host, var, problems)


def _rule(var, host):
    if var == "ansible_host":
        return rules.check_host if host == "gw" else (lambda _f, v: v)  # a vLLM host's: validate_topology's
    groups = [g for g in GROUPS if host in GROUPS[g]]
    checks = [check for group, name, check in pd_inventory_rules.INVENTORY_RULES if name == var and group in groups]
    return checks[0] if checks else (lambda _f, v: v)
