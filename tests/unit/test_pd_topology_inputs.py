"""pd_topology on hostile inventory input (security review, issue 18): each case was accepted or raised before.

Control characters in anything written to a unit or env file, ucx_net_devices, kv roles that do not fit their
pool, port clashes with the bundle's other listeners, flag values the recipe cannot use, wrong types and nan.
"""

from __future__ import annotations

import copy
import math

import pytest
import yaml
from ansible_collections.b300.pd.bench.pd_cluster import inventory_data
from ansible_collections.b300.pd.plugins.module_utils import pd_recipe, pd_topology
from ansible_collections.b300.pd.plugins.module_utils.pd_cluster_inputs import (
    LISTENERS,
    VIEW_ROLES,
    listener_services,
    topology_args,
)
from ansible_collections.b300.pd.plugins.module_utils.pd_cluster_view import VIEW_VARS
from ansible_collections.b300.pd.plugins.plugin_utils.pd_role_defaults import role_defaults
from ansible_collections.b300.pd.tests.unit.pd_testlib import (
    ROOT,
    load_inventory,
    load_library,
    run_module,
    topology_input,
)

INJECTION = "GLM\n[Service]\nExecStartPre=/bin/sh -c 'touch /tmp/pwned'"


def base():
    inv = load_inventory("b300")
    return topology_input(inv), copy.deepcopy(inv["recipe"]), dict(inv["group_vars"]["pd_sla"])


def inst(hosts, host, name):
    return next(i for i in hosts[host]["pd_instances"] if i["name"] == name)


def b300_services():
    """What playbooks/validate.yml builds for inventory/b300 (router and monitoring on b300-03)."""
    return [
        {"host": "b300-03", "port": 8000, "field": "pd_router_port", "service": "P/D router API"},
        {"host": "b300-03", "port": 29000, "field": "pd_router_metrics_port", "service": "P/D router metrics"},
        {"host": "b300-03", "port": 9090, "field": "observability_prometheus_port", "service": "Prometheus"},
        *({"host": h, "port": 9100, "field": "node_exporter_port", "service": "node exporter"}
          for h in ("b300-01", "b300-02", "b300-03")),
    ]


def flags(recipe, pool=None):
    return recipe["pd_vllm_flags_pool"][pool] if pool else recipe["pd_vllm_flags_common"]


# (id, mutation(hosts, recipe, sla, services), substrings every one of which must be in one problem line)
CASES = [
    # 1. control characters in every string that reaches a unit or env file; \Z-anchored name regexes
    ("served-name-injects-section", lambda h, r, s, v: r.update(pd_served_model_name=INJECTION),
     ["field pd_served_model_name", "a newline (U+000A)"]),
    ("served-name-cr", lambda h, r, s, v: r.update(pd_served_model_name="GLM\r"),
     ["field pd_served_model_name", "carriage return"]),
    ("served-name-percent", lambda h, r, s, v: r.update(pd_served_model_name="GLM-%n"),
     ["field pd_served_model_name", "'%'"]),
    ("instance-name-trailing-newline", lambda h, r, s, v: inst(h, "b300-01", "prefill-a").update(name="prefill-a\n"),
     ["host b300-01, pd_instances[0]", "field name", "'prefill-a\\n'"]),
    ("flag-name-trailing-newline", lambda h, r, s, v: flags(r).update({"seed\n": 1}),
     ["field pd_vllm_flags_common", "flag name 'seed\\n'"]),
    ("env-name-trailing-newline", lambda h, r, s, v: r["pd_vllm_env"].update({"FOO\n": "1"}),
     ["field pd_vllm_env", "'FOO\\n' is not a valid environment variable name"]),
    ("flag-value-cr", lambda h, r, s, v: flags(r).update({"tool-call-parser": "glm47\r"}),
     ["field pd_vllm_flags_common.tool-call-parser", "carriage return"]),
    ("flag-value-newline-extra-flags", lambda h, r, s, v: inst(h, "b300-01", "prefill-a").update(
        extra_flags={"reasoning-parser": "glm45\nExecStartPre=/bin/true"}),
     ["instance prefill-a", "field extra_flags.reasoning-parser", "newline"]),
    ("flag-value-nested-escape", lambda h, r, s, v: flags(r, "decode")["speculative-config"].update(method="mtp\x1b"),
     ["field pd_vllm_flags_pool.decode.speculative-config.method", "U+001B"]),
    ("env-value-cr", lambda h, r, s, v: r["pd_ucx_env"].update(UCX_TLS="rc,sm\r"),
     ["field pd_ucx_env", "UCX_TLS", "carriage return"]),
    ("extra-env-value-line-separator", lambda h, r, s, v: inst(h, "b300-03", "decode-a").update(
        extra_env={"X": "a\u2028b"}),
     ["instance decode-a", "field extra_env", "U+2028"]),
    ("model-path-newline", lambda h, r, s, v: r.update(pd_model_path="/mnt/model/glm\nExecStartPre=/bin/true"),
     ["field pd_model_path", "newline"]),
    ("ansible-host-newline", lambda h, r, s, v: h["b300-02"].update(ansible_host="192.0.2.12\nFOO=1"),
     ["host b300-02", "field ansible_host", "VLLM_NIXL_SIDE_CHANNEL_HOST"]),
    ("ansible-host-not-a-string", lambda h, r, s, v: h["b300-02"].update(ansible_host=["192.0.2.12"]),
     ["host b300-02", "field ansible_host", "not an IP address or DNS name"]),
    # 2. ucx_net_devices
    ("ucx-newline", lambda h, r, s, v: inst(h, "b300-01", "prefill-a").update(ucx_net_devices="mlx5_0:1\nX=1"),
     ["instance prefill-a", "field ucx_net_devices", "newline"]),
    ("ucx-space-after-comma", lambda h, r, s, v: inst(h, "b300-01", "prefill-a").update(
        ucx_net_devices="mlx5_0:1, mlx5_1:1"),
     ["instance prefill-a", "field ucx_net_devices", "' mlx5_1:1'", "device:port"]),
    ("ucx-no-port", lambda h, r, s, v: inst(h, "b300-01", "prefill-a").update(ucx_net_devices="mlx5_0,mlx5_1"),
     ["instance prefill-a", "field ucx_net_devices", "'mlx5_0'", "device:port"]),
    ("ucx-all", lambda h, r, s, v: inst(h, "b300-01", "prefill-a").update(ucx_net_devices="all"),
     ["instance prefill-a", "field ucx_net_devices", "omit the field"]),
    ("ucx-twice", lambda h, r, s, v: inst(h, "b300-01", "prefill-a").update(ucx_net_devices="mlx5_0:1,mlx5_0:1"),
     ["instance prefill-a", "field ucx_net_devices", "mlx5_0:1 listed twice"]),
    ("ucx-trailing-comma", lambda h, r, s, v: inst(h, "b300-01", "prefill-a").update(ucx_net_devices="mlx5_0:1,"),
     ["instance prefill-a", "field ucx_net_devices", "device:port"]),
    # 3. kv roles that do not fit the pool
    ("kv-role-decode-producer", lambda h, r, s, v: r["pd_kv_roles"].update(decode="kv_producer"),
     ["field pd_kv_roles.decode", "does not fit the decode pool", "kv_consumer"]),
    ("kv-role-prefill-consumer", lambda h, r, s, v: r["pd_kv_roles"].update(prefill="kv_consumer"),
     ["field pd_kv_roles.prefill", "does not fit the prefill pool", "kv_producer"]),
    # 3. port clashes with the bundle's other listeners
    ("router-port-vs-http", lambda h, r, s, v: v[0].update(port=8200),
     ["host b300-03, instance decode-a", "field http_port", "port 8200", "pd_router_port (P/D router API)"]),
    ("router-metrics-vs-side-channel", lambda h, r, s, v: v[1].update(port=5703),
     ["host b300-03, instance decode-a", "field nixl_side_channel_port", "port 5703", "pd_router_metrics_port"]),
    ("node-exporter-vs-dp-rpc", lambda h, r, s, v: v[3].update(port=13345),
     ["host b300-01, instance prefill-a", "field dp_rpc_port", "port 13345", "node_exporter_port (node exporter)"]),
    ("prometheus-vs-router", lambda h, r, s, v: v[2].update(port=8000),
     ["host b300-03", "field observability_prometheus_port", "port 8000", "pd_router_port"]),
    ("router-only-host-clash", lambda h, r, s, v: v.extend([
        {"host": "router-0", "port": 9100, "field": "pd_router_metrics_port", "service": "P/D router metrics"},
        {"host": "router-0", "port": 9100, "field": "node_exporter_port", "service": "node exporter"}]),
     ["host router-0", "field node_exporter_port", "port 9100", "pd_router_metrics_port"]),
    ("service-port-not-a-port", lambda h, r, s, v: v[0].update(port="8k"),
     ["host b300-03", "field pd_router_port", "'8k' is not a TCP port"]),
    # 3. flag values vLLM's parser accepts but the recipe cannot use
    ("gpu-mem-above-one", lambda h, r, s, v: flags(r, "prefill").update({"gpu-memory-utilization": 1.5}),
     ["field pd_vllm_flags_pool.prefill", "'gpu-memory-utilization' is 1.5", "(0, 1]"]),
    ("gpu-mem-zero", lambda h, r, s, v: flags(r, "decode").update({"gpu-memory-utilization": 0}),
     ["field pd_vllm_flags_pool.decode", "'gpu-memory-utilization' is 0", "(0, 1]"]),
    ("gpu-mem-string", lambda h, r, s, v: inst(h, "b300-01", "prefill-a").update(
        extra_flags={"gpu_memory_utilization": "0.9"}),
     ["instance prefill-a", "field extra_flags", "'gpu_memory_utilization' is '0.9'"]),
    ("gpu-mem-nan", lambda h, r, s, v: flags(r, "decode").update({"gpu-memory-utilization": math.nan}),
     ["field pd_vllm_flags_pool.decode", "'gpu-memory-utilization' is nan", "finite"]),
    ("max-model-len-1k", lambda h, r, s, v: flags(r).update({"max-model-len": "1k"}),
     ["field pd_vllm_flags_common", "'max-model-len' is '1k' (str)", "positive integer"]),
    ("max-num-batched-tokens-string", lambda h, r, s, v: flags(r, "decode").update({"max-num-batched-tokens": "1024"}),
     ["field pd_vllm_flags_pool.decode", "'max-num-batched-tokens' is '1024' (str)"]),
    ("max-num-seqs-zero", lambda h, r, s, v: flags(r).update({"max-num-seqs": 0}),
     ["field pd_vllm_flags_common", "'max-num-seqs' is 0"]),
    ("max-num-seqs-float", lambda h, r, s, v: flags(r).update({"max_num_seqs": 256.0}),
     ["field pd_vllm_flags_common", "'max_num_seqs' is 256.0 (float)"]),
    ("max-model-len-bool", lambda h, r, s, v: flags(r).update({"max-model-len": True}),
     ["field pd_vllm_flags_common", "'max-model-len' is True (bool)"]),
    # 4. wrong types and non-finite SLA values
    ("host-recipe-list", lambda h, r, s, v: h["b300-02"].update(recipe=["pd_model_path"]),
     ["host b300-02", "field recipe", "list", "mapping"]),
    ("host-recipe-string", lambda h, r, s, v: h["b300-02"].update(recipe="pd_model_path: /x"),
     ["host b300-02", "field recipe", "str", "mapping"]),
    ("pool-is-a-list", lambda h, r, s, v: inst(h, "b300-01", "prefill-a").update(pool=["prefill"]),
     ["instance prefill-a", "field pool", "['prefill'] is not a pool"]),
    ("sla-nan", lambda h, r, s, v: s.update(ttft_mean_s=math.nan),
     ["pd_sla, field ttft_mean_s", "nan", "finite"]),
    ("sla-inf", lambda h, r, s, v: s.update(tpot_mean_ms=math.inf),
     ["pd_sla, field tpot_mean_ms", "inf", "finite"]),
]


# Cases about the bundle's other listeners; the others call validate_topology as it was called before them.
SERVICE_CASES = {"router-port-vs-http", "router-metrics-vs-side-channel", "node-exporter-vs-dp-rpc",
                 "prometheus-vs-router", "router-only-host-clash", "service-port-not-a-port"}


@pytest.mark.parametrize(("case", "mutate", "needles"), CASES, ids=[c[0] for c in CASES])
def test_hostile_input_is_refused_with_a_named_error(case, mutate, needles):
    hosts, recipe, sla = base()
    services = b300_services()
    extra = (services,) if case in SERVICE_CASES else ()
    assert pd_topology.validate_topology(hosts, recipe, sla, *extra) == []  # the baseline is clean
    mutate(hosts, recipe, sla, services)
    problems = pd_topology.validate_topology(hosts, recipe, sla, *extra)
    assert problems, "the bad input was accepted"
    assert any(all(n in p for n in needles) for p in problems), "\n".join(problems)


def problems_with(mutate):
    hosts, recipe, sla = base()
    mutate(hosts, recipe)
    return pd_topology.validate_topology(hosts, recipe, sla)


def test_ucx_net_devices_shape_both_ways():
    def with_ucx(value):
        return problems_with(lambda h, r: inst(h, "b300-01", "prefill-a").update(ucx_net_devices=value))

    for good in ("mlx5_0:1", "mlx5_0:1,mlx5_1:1", "mlx5_bond_0:1", "rocep1s0f0:2"):
        assert with_ucx(good) == [], good
    for bad in ("mlx5_0:0", "mlx5_0:1;mlx5_1:1", "mlx5_0:1\t", "ml\u00e9x5_0:1", "-x:1"):
        assert any("field ucx_net_devices" in p for p in with_ucx(bad)), bad


def test_kv_roles_both_ways():
    def with_roles(prefill, decode):
        return problems_with(lambda h, r: r["pd_kv_roles"].update(prefill=prefill, decode=decode))

    assert with_roles("kv_both", "kv_both") == []
    assert with_roles("kv_producer", "kv_consumer") == []
    assert any("pd_kv_roles.prefill" in p for p in with_roles("kv_consumer", "kv_both"))
    assert any("pd_kv_roles.decode" in p for p in with_roles("kv_both", "kv_producer"))


def test_memory_fraction_and_token_counts_both_ways():
    def with_flag(name, value):
        return problems_with(lambda h, r: r["pd_vllm_flags_pool"]["prefill"].update({name: value}))

    for value in (1, 0.5, 1.0, 0.01, None, False):  # None / false omit the flag
        assert with_flag("gpu-memory-utilization", value) == [], value
    for value in (1.0001, -0.5, math.inf, "0.9", True):
        assert any("'gpu-memory-utilization'" in p for p in with_flag("gpu-memory-utilization", value)), value
    for name in pd_recipe.TOKEN_COUNT_FLAGS:
        for value in (1, 262144, None, False):
            assert with_flag(name, value) == [], (name, value)
        for value in ("1k", "4096", 0, -1, 1.5, True, [4096]):
            assert any(f"{name!r} is" in p for p in with_flag(name, value)), (name, value)


def test_env_file_refuses_carriage_return_at_render_time_too():
    # check_env_dict is shared with build_env, so vllm_instance refuses it at deploy as well.
    hosts, recipe, _sla = base()
    recipe["pd_vllm_env"]["X"] = "1\r"
    with pytest.raises(pd_recipe.RecipeError, match="carriage return"):
        pd_recipe.build_env(recipe, inst(hosts, "b300-01", "prefill-a"), "192.0.2.11")


def test_name_regexes_refuse_a_trailing_newline():
    assert pd_recipe.INSTANCE_NAME_RE.match("prefill-a")
    assert not pd_recipe.INSTANCE_NAME_RE.match("prefill-a\n")
    assert not pd_recipe.FLAG_NAME_RE.match("max-model-len\n")
    assert not pd_recipe.ENV_NAME_RE.match("HOME\n")


@pytest.mark.parametrize("hostvars", [["pd_instances"], "b300-02", 3])
def test_module_names_host_vars_that_are_not_a_mapping(monkeypatch, hostvars):
    lib = load_library("pd_topology")
    hosts, recipe, sla = base()
    hosts["b300-02"] = hostvars
    res, failed = run_module(lib.main, {"hosts": hosts, "recipe": recipe, "sla": sla}, monkeypatch=monkeypatch)
    assert failed
    assert any(p.startswith("host b300-02: host vars are a ") for p in res["problems"]), res["problems"]
    assert res["summary"]["hosts"] == 3


def test_module_names_a_service_clash(monkeypatch):
    lib = load_library("pd_topology")
    hosts, recipe, sla = base()
    services = b300_services()
    services[0]["port"] = 8200
    res, failed = run_module(lib.main, {"hosts": hosts, "recipe": recipe, "sla": sla, "services": services},
                             monkeypatch=monkeypatch)
    assert failed and "field http_port: port 8200" in res["msg"] and "pd_router_port" in res["msg"]


def test_summarize_tolerates_any_shape():
    assert pd_topology.summarize([1, 2])["hosts"] == 0
    out = pd_topology.summarize({"a": [1], "b": {"pd_instances": [{"pool": ["x"]}, {"pool": "decode", "gpus": 3}]}})
    assert out == {"hosts": 2, "instances": {"prefill": [], "decode": ["b/None"]}, "gpus": 0}


def test_integer_host_names_are_reported_not_raised():
    hosts, recipe, sla = base()
    hosts[10] = hosts.pop("b300-02")
    hosts[11] = copy.deepcopy(hosts[10])  # same instance names on two int-named hosts
    problems = pd_topology.validate_topology(hosts, recipe, sla)
    assert any("host 10, 11, instance prefill-c, field name" in p for p in problems), problems


def test_validate_playbook_passes_every_listener_with_its_role_default():
    """The listeners pd_topology checks are port vars that the roles really define, gathered for validate.yml by the
    action plugin (the playbook copies no list and overrides none of what it gathers)."""
    play = yaml.safe_load((ROOT / "playbooks" / "validate.yml").read_text())[0]
    assert play["tasks"][0]["block"][0]["b300.pd.pd_topology"] in (None, {})  # services, inventory: all gathered
    assert not [name for name, value in play["vars"].items() if isinstance(value, list | dict)], play["vars"]
    fields = {(VIEW_VARS[field], field) for _group, field, _what in LISTENERS}
    assert fields >= {("pd_router", "pd_router_port"), ("pd_frontdoor", "pd_frontdoor_metrics_port"),
                      ("observability", "observability_prometheus_port"), ("node_exporter", "node_exporter_port")}
    defaults = role_defaults()
    for role, field in fields:
        assert isinstance(defaults[role].get(field), int), (role, field)
    # The router units' ports (a list per host, pd_router_units) are services too: the role's default units here.
    groups = {"router_hosts": ["r1"], "monitoring_hosts": ["r1"], "vllm_hosts": ["v1"]}
    services = listener_services(groups, {"r1": {"node_exporter_port": 9101}, "v1": {}}, defaults)
    assert {(s["host"], s["field"], s["port"]) for s in services} >= {
        ("r1", "pd_router_port", defaults["pd_router"]["pd_router_port"]), ("r1", "node_exporter_port", 9101),
        ("v1", "node_exporter_port", defaults["node_exporter"]["node_exporter_port"]),
        *(("r1", f"pd_router_units {unit['name']} {field}", unit[field])
          for unit in defaults["pd_router"]["pd_router_units"] for field in ("port", "metrics_port"))}
    assert len([s for s in services if s["field"] == "node_exporter_port"]) == 2  # r1 once, though in two groups


def test_action_plugin_gathers_what_the_playbook_built():
    """inventory/b300 through the gathering: the vLLM hosts with their own recipe vars, the first host's recipe and
    pd_sla, every listener, and the view's inventory with every VIEW_VARS a host sets."""
    groups, hostvars = inventory_data(ROOT / "inventory" / "b300")
    args = topology_args(groups, hostvars, role_defaults())
    inv = load_inventory("b300")
    assert list(args["hosts"]) == ["b300-01", "b300-02", "b300-03"]
    assert {h: {k: v for k, v in hv.items() if k != "recipe"} for h, hv in args["hosts"].items()} == topology_input(inv)
    assert args["recipe"] == inv["recipe"] == args["hosts"]["b300-03"]["recipe"]
    assert args["sla"] == inv["group_vars"]["pd_sla"]
    assert pd_topology.validate_topology(args["hosts"], args["recipe"], args["sla"], args["services"]) == []
    assert {(s["host"], s["field"]) for s in args["services"]} >= {
        ("b300-03", "pd_router_port"), ("b300-02", "pd_frontdoor_metrics_port"),
        ("b300-03", "observability_prometheus_port"), ("b300-01", "node_exporter_port"),
        ("b300-02", "pd_router_units vllm-router metrics_port")}
    assert args["inventory"]["groups"]["router_hosts"] == ["b300-03", "b300-02"]
    assert set(args["inventory"]["defaults"]) == set(VIEW_ROLES)
    assert args["inventory"]["hostvars"]["b300-01"] == {k: v for k, v in hostvars["b300-01"].items() if k in VIEW_VARS}
