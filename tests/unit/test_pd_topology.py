"""pd_topology: both real inventories pass; every bad input is caught with host, instance and field named."""

from __future__ import annotations

import copy

import pytest
from ansible_collections.b300.pd.plugins.module_utils import pd_topology
from ansible_collections.b300.pd.tests.unit.pd_testlib import load_inventory, load_library, run_module, topology_input


def base():
    inv = load_inventory("b300")
    return topology_input(inv), copy.deepcopy(inv["recipe"]), dict(inv["group_vars"]["pd_sla"])


def inst(hosts, host, name):
    return next(i for i in hosts[host]["pd_instances"] if i["name"] == name)


@pytest.mark.parametrize("inventory", ["b300", "local"])
def test_real_inventories_are_valid(inventory):
    inv = load_inventory(inventory)
    assert pd_topology.validate_topology(topology_input(inv), inv["recipe"], inv["group_vars"]["pd_sla"]) == []


# (id, mutation(hosts, recipe, sla), substrings every one of which must be in one problem line)
CASES = [
    ("missing-field", lambda h, r, s: inst(h, "b300-01", "prefill-a").pop("http_port"),
     ["host b300-01", "instance prefill-a", "field http_port", "missing"]),
    ("unknown-field", lambda h, r, s: inst(h, "b300-01", "prefill-a").update(tp=1),
     ["instance prefill-a", "field tp", "unknown field"]),
    ("typo-field-suggests", lambda h, r, s: inst(h, "b300-01", "prefill-a").update(
        ucx_net_device=inst(h, "b300-01", "prefill-a").pop("ucx_net_devices")),
     ["field ucx_net_device", "did you mean 'ucx_net_devices'"]),
    ("bad-pool", lambda h, r, s: inst(h, "b300-01", "prefill-a").update(pool="prefil"),
     ["instance prefill-a", "field pool", "did you mean 'prefill'"]),
    ("duplicate-name", lambda h, r, s: inst(h, "b300-02", "prefill-c").update(name="prefill-a"),
     ["b300-01, b300-02", "instance prefill-a", "field name", "unique"]),
    ("bad-name", lambda h, r, s: inst(h, "b300-01", "prefill-a").update(name="Prefill_A"),
     ["instance Prefill_A", "field name", "lowercase"]),
    ("gpu-overlap", lambda h, r, s: inst(h, "b300-01", "prefill-b").update(gpus=[3, 5, 6, 7]),
     ["host b300-01", "instance prefill-b", "field gpus", "GPU 3 is also used by prefill-a"]),
    ("gpu-beyond-host", lambda h, r, s: inst(h, "b300-01", "prefill-b").update(gpus=[4, 5, 6, 8]),
     ["instance prefill-b", "field gpus", "[8] not on this host"]),
    ("gpu-count-vs-tp-dp", lambda h, r, s: inst(h, "b300-03", "decode-a").update(dp_size=4),
     ["instance decode-a", "field gpus", "tp_size*dp_size"]),
    ("gpu-duplicate-in-list", lambda h, r, s: inst(h, "b300-01", "prefill-a").update(gpus=[0, 0, 1, 2]),
     ["instance prefill-a", "field gpus", "twice"]),
    ("gpus-on-cpu-host", lambda h, r, s: h["b300-01"].update(pd_gpus_per_host=0),
     ["host b300-01", "field gpus", "pd_gpus_per_host 0"]),
    ("http-port-dup", lambda h, r, s: inst(h, "b300-01", "prefill-b").update(http_port=8100),
     ["host b300-01", "instance prefill-b", "field http_port", "port 8100", "prefill-a"]),
    ("side-channel-range-overlap", lambda h, r, s: inst(h, "b300-01", "prefill-b").update(nixl_side_channel_port=5603),
     ["instance prefill-b", "field nixl_side_channel_port", "port 5603", "prefill-a"]),
    ("http-inside-side-channel-range", lambda h, r, s: inst(h, "b300-01", "prefill-b").update(http_port=5602),
     ["instance prefill-b", "port 5602", "NIXL side-channel port of prefill-a"]),
    ("dp-rpc-dup", lambda h, r, s: inst(h, "b300-01", "prefill-b").update(dp_rpc_port=13345),
     ["instance prefill-b", "field dp_rpc_port", "port 13345"]),
    ("dp-rpc-missing", lambda h, r, s: inst(h, "b300-03", "decode-a").pop("dp_rpc_port"),
     ["instance decode-a", "field dp_rpc_port", "required when dp_size > 1"]),
    ("port-out-of-range", lambda h, r, s: inst(h, "b300-01", "prefill-a").update(http_port=70000),
     ["instance prefill-a", "field http_port", "70000"]),
    ("port-privileged", lambda h, r, s: inst(h, "b300-01", "prefill-a").update(http_port=80),
     ["instance prefill-a", "field http_port", "privileged"]),
    ("port-string", lambda h, r, s: inst(h, "b300-01", "prefill-a").update(nixl_side_channel_port="5600"),
     ["instance prefill-a", "field nixl_side_channel_port", "'5600'"]),
    ("tp-zero", lambda h, r, s: inst(h, "b300-01", "prefill-a").update(tp_size=0),
     ["instance prefill-a", "field tp_size"]),
    ("prefill-tp-gt-decode-tp", lambda h, r, s: inst(h, "b300-01", "prefill-a").update(tp_size=2, dp_size=2),
     ["instance prefill-a", "field tp_size", "prefill TP 2 > decode TP 1"]),
    ("block-size-mismatch", lambda h, r, s: r["pd_vllm_flags_pool"]["decode"].update({"block-size": 64}),
     ["instance prefill-a", "field flags.block-size", "decode instance decode-a"]),
    ("kv-cache-dtype-mismatch", lambda h, r, s: inst(h, "b300-01", "prefill-a").update(
        extra_flags={"kv-cache-dtype": "fp8"}),
     ["instance prefill-a", "field flags.kv-cache-dtype", "'fp8'"]),
    ("no-decode-pool", lambda h, r, s: h.pop("b300-03"),
     ["field pool", "no decode instance"]),
    ("no-prefill-pool", lambda h, r, s: [h.pop("b300-01"), h.pop("b300-02")],
     ["field pool", "no prefill instance"]),
    ("kv-role-missing", lambda h, r, s: r["pd_kv_roles"].pop("decode"),
     ["field pd_kv_roles.decode", "kv_consumer"]),
    ("kv-role-in-config", lambda h, r, s: r["pd_kv_transfer_config"].update(kv_role="kv_both"),
     ["field pd_kv_transfer_config.kv_role"]),
    ("reserved-flag-in-pool", lambda h, r, s: r["pd_vllm_flags_pool"]["prefill"].update(port=9000),
     ["field pd_vllm_flags_pool.prefill", "'port'", "http_port"]),
    ("short-flag", lambda h, r, s: r["pd_vllm_flags_common"].update(tp=1),
     ["field pd_vllm_flags_common", "short flag 'tp'", "tensor-parallel-size"]),
    ("model-path-relative", lambda h, r, s: r.update(pd_model_path="models/glm"),
     ["field pd_model_path", "absolute"]),
    ("recipe-key-missing", lambda h, r, s: r.pop("pd_served_model_name"),
     ["field pd_served_model_name", "missing"]),
    ("sla-wrong-type", lambda h, r, s: s.update(ttft_mean_s="2.5"),
     ["pd_sla, field ttft_mean_s", "str"]),
    ("sla-non-positive", lambda h, r, s: s.update(tpot_mean_ms=0),
     ["pd_sla, field tpot_mean_ms", "> 0"]),
    ("sla-float-context", lambda h, r, s: s.update(context_max_tokens=2.5e5),
     ["pd_sla, field context_max_tokens", "integer"]),
    ("sla-bool", lambda h, r, s: s.update(ttft_mean_s=True),
     ["pd_sla, field ttft_mean_s"]),
    ("context-min-gt-max", lambda h, r, s: s.update(context_min_tokens=300000),
     ["pd_sla, field context_min_tokens", "context_max_tokens"]),
    ("instances-missing", lambda h, r, s: h["b300-02"].update(pd_instances=None),
     ["host b300-02", "field pd_instances", "host_vars/b300-02.yml"]),
    ("ansible-host-missing", lambda h, r, s: h["b300-02"].update(ansible_host=None),
     ["host b300-02", "field ansible_host"]),
    ("gpus-per-host-bad", lambda h, r, s: h["b300-02"].update(pd_gpus_per_host="8"),
     ["host b300-02", "field pd_gpus_per_host"]),
    ("reserved-env", lambda h, r, s: inst(h, "b300-01", "prefill-a").update(extra_env={"CUDA_VISIBLE_DEVICES": "0"}),
     ["instance prefill-a", "field extra_env", "CUDA_VISIBLE_DEVICES"]),
]


@pytest.mark.parametrize(("mutate", "needles"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_topology_is_reported(mutate, needles):
    hosts, recipe, sla = base()
    assert pd_topology.validate_topology(hosts, recipe, sla) == []  # the baseline is clean
    mutate(hosts, recipe, sla)
    problems = pd_topology.validate_topology(hosts, recipe, sla)
    assert problems, "the bad input was accepted"
    assert any(all(n in p for n in needles) for p in problems), "\n".join(problems)


def test_all_problems_are_collected():
    hosts, recipe, sla = base()
    inst(hosts, "b300-01", "prefill-a")["pool"] = "nope"
    inst(hosts, "b300-03", "decode-a")["http_port"] = 1
    sla["ttft_mean_s"] = -1
    problems = pd_topology.validate_topology(hosts, recipe, sla)
    assert len(problems) >= 3
    assert len({p.split(":")[0] for p in problems}) >= 3


def test_side_channel_range_ends_are_exclusive_of_neighbours():
    # prefill-b's range 5610..5613 starts right after prefill-a's 5600..5603 ends: no false positive
    hosts, recipe, sla = base()
    inst(hosts, "b300-01", "prefill-b")["nixl_side_channel_port"] = 5604
    assert pd_topology.validate_topology(hosts, recipe, sla) == []


def test_module_fails_once_with_every_line(monkeypatch):
    lib = load_library("pd_topology")
    hosts, recipe, sla = base()
    inst(hosts, "b300-01", "prefill-a")["gpus"] = [0, 1, 2, 9]
    sla["context_min_tokens"] = 10 ** 7
    res, failed = run_module(lib.main, {"hosts": hosts, "recipe": recipe, "sla": sla}, monkeypatch=monkeypatch)
    assert failed
    assert "2 problems" in res["msg"] and "nothing was changed" in res["msg"]
    assert len(res["problems"]) == 2
    hosts, recipe, sla = base()
    res, failed = run_module(lib.main, {"hosts": hosts, "recipe": recipe, "sla": sla}, monkeypatch=monkeypatch)
    assert not failed and res["changed"] is False
    assert res["summary"]["gpus"] == 24 and len(res["summary"]["instances"]["prefill"]) == 4
