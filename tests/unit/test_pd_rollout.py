"""roles/pd_rollout filters: rollout order, router registry while instances are out (P/D pairs only one NIXL
compatibility key, colocated fallback), drain metrics, unit ExecStart parsing, compatibility keys.

The registry function is checked exhaustively on both inventories: for every set of instances out of rotation and
every assignment of old/new keys, a P/D registry never pairs instances of different keys and never contains an
instance that is out, and a colocated registry only appears when no same-key pair is left.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from ansible_collections.b300.pd.plugins.module_utils.pd_recipe import build_argv  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.pd_record import compat_key  # noqa: E402
from ansible_collections.b300.pd.plugins.plugin_utils import pd_rollout as ro
from ansible_collections.b300.pd.tests.unit.pd_testlib import load_inventory  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
from ansible_collections.b300.pd.bench.pd_cluster import load as load_cluster  # noqa: E402


def topo(name):
    inv = load_inventory(name)
    return ro.pd_rollout_topology(load_cluster(ROOT / "inventory" / name), list(inv["hosts"])), inv


def test_local_topology_and_order():
    t, _inv = topo("local")
    assert [(x["name"], x["pool"], x["url"]) for x in t] == [
        ("prefill-0", "prefill", "http://10.237.0.11:8100"), ("prefill-1", "prefill", "http://10.237.0.11:8101"),
        ("decode-0", "decode", "http://10.237.0.12:8200")]
    assert ro.pd_rollout_order(t) == [{"host": "pd-prefill-0", "instances": ["prefill-0", "prefill-1"]},
                                      {"host": "pd-decode-0", "instances": ["decode-0"]}]


def test_order_puts_prefill_only_hosts_first_and_prefill_before_decode_on_a_host():
    t = [{"name": "d", "host": "h1", "pool": "decode", "url": "http://a:1"},
         {"name": "p2", "host": "h1", "pool": "prefill", "url": "http://a:2"},
         {"name": "p1", "host": "h2", "pool": "prefill", "url": "http://b:1"}]
    assert ro.pd_rollout_order(t) == [{"host": "h2", "instances": ["p1"]}, {"host": "h1", "instances": ["p2", "d"]}]


def test_b300_order_is_prefill_servers_then_the_decode_server():
    t, _inv = topo("b300")
    assert [o["host"] for o in ro.pd_rollout_order(t)] == ["b300-01", "b300-02", "b300-03"]


def reg(wanted):
    return sorted((w["name"], w["worker_type"]) for w in wanted)


def test_draining_one_prefill_keeps_pd_with_the_others():
    t, _inv = topo("local")
    keys = dict.fromkeys(("prefill-0", "prefill-1", "decode-0"), "k")
    assert reg(ro.pd_rollout_routing(t, keys, ["prefill-1"], "k", "tiny-pd")) == [
        ("decode-0", "decode"), ("prefill-0", "prefill")]
    assert reg(ro.pd_rollout_routing(t, keys, [], "k", "tiny-pd")) == [
        ("decode-0", "decode"), ("prefill-0", "prefill"), ("prefill-1", "prefill")]
    w = ro.pd_rollout_routing(t, keys, [], "k", "tiny-pd")
    assert {x["model_id"] for x in w} == {"tiny-pd"}
    assert {x["url"] for x in w} == {x["url"] for x in t}


def test_draining_the_only_decode_sends_whole_requests_to_the_prefill_pool():
    t, _inv = topo("local")
    keys = dict.fromkeys(("prefill-0", "prefill-1", "decode-0"), "k")
    w = ro.pd_rollout_routing(t, keys, ["decode-0"], "k", "tiny-pd")
    assert reg(w) == [("prefill-0", "regular"), ("prefill-1", "regular")]
    assert ro.pd_rollout_routing_mode(w) == "colocated"


def test_version_change_pairs_only_same_version_instances():
    """Prefill first through a vLLM version change: old P with old D, then colocated, then new P/D."""
    t, _inv = topo("local")
    old, new = "vllm=0.32.0;nixl=1.5.1;flags=a", "vllm=0.33.0;nixl=1.5.1;flags=a"
    keys = {"prefill-0": new, "prefill-1": old, "decode-0": old}
    # prefill-0 switched, back "in": it has no new decode to pair with; old pair serves.
    assert reg(ro.pd_rollout_routing(t, keys, [], new, "m")) == [("decode-0", "decode"), ("prefill-1", "prefill")]
    # prefill-1 out: no same-key pair left -> colocated on the prefill pool (prefill-0, new version).
    assert reg(ro.pd_rollout_routing(t, keys, ["prefill-1"], old, "m")) == [("prefill-0", "regular")]
    keys["prefill-1"] = new
    assert reg(ro.pd_rollout_routing(t, keys, [], new, "m")) == [("prefill-0", "regular"), ("prefill-1", "regular")]
    assert reg(ro.pd_rollout_routing(t, keys, ["decode-0"], old, "m")) == [
        ("prefill-0", "regular"), ("prefill-1", "regular")]
    keys["decode-0"] = new
    assert reg(ro.pd_rollout_routing(t, keys, [], new, "m")) == [
        ("decode-0", "decode"), ("prefill-0", "prefill"), ("prefill-1", "prefill")]


@pytest.mark.parametrize("inv", ["local", "b300"])
def test_registry_never_pairs_different_keys_or_routes_to_an_instance_that_is_out(inv):
    t, _inv = topo(inv)
    names = [x["name"] for x in t]
    pool = {x["name"]: x["pool"] for x in t}
    checked = 0
    for bits in itertools.product("AB", repeat=len(names)):
        keys = dict(zip(names, bits, strict=True))
        for r in range(len(names)):
            for out in itertools.combinations(names, r):
                for prefer in ("A", "B"):
                    w = ro.pd_rollout_routing(t, keys, list(out), prefer, "m")
                    routed = {x["name"] for x in w}
                    assert not routed & set(out)
                    if ro.pd_rollout_routing_mode(w) == "pd":
                        assert len({keys[n] for n in routed}) == 1, (keys, out, w)
                        assert {x["worker_type"] for x in w} == {"prefill", "decode"}
                        assert all(x["worker_type"] == pool[x["name"]] for x in w)
                    else:
                        avail = [n for n in names if n not in out]
                        pairable = any(
                            any(pool[p] == "prefill" and keys[p] == k for p in avail)
                            and any(pool[d] == "decode" and keys[d] == k for d in avail) for k in "AB")
                        assert not pairable, (keys, out, w)
                        assert routed, (keys, out)
                    checked += 1
    assert checked > 50


def test_nothing_left_to_serve_is_refused():
    t = [{"name": "p", "host": "h", "pool": "prefill", "url": "http://a:1"},
         {"name": "d", "host": "h", "pool": "decode", "url": "http://a:2"}]
    with pytest.raises(Exception, match="leaves no instance to serve"):
        ro.pd_rollout_routing(t, {"p": "k", "d": "k"}, ["p", "d"], "k", "m")
    with pytest.raises(Exception, match="no compatibility key for instance"):
        ro.pd_rollout_routing(t, {"p": "k"}, [], "k", "m")
    with pytest.raises(Exception, match="model id"):
        ro.pd_rollout_routing(t, {"p": "k", "d": "k"}, [], "k", "")


def test_partner_is_of_the_other_pool_and_the_same_key():
    t, _inv = topo("local")
    keys = {"prefill-0": "new", "prefill-1": "old", "decode-0": "old"}
    assert ro.pd_rollout_partner(t, keys, "prefill-0", "new") == ""
    assert ro.pd_rollout_partner(t, keys, "prefill-1", "old") == "decode-0"
    assert ro.pd_rollout_partner(t, keys, "decode-0", "old") == "prefill-1"
    keys["decode-0"] = "new"
    assert ro.pd_rollout_partner(t, keys, "decode-0", "new") == "prefill-0"


METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-pd"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny-pd"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny-pd"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-pd",source="external_kv_transfer"} 128.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-pd",source="local_compute"} 7.0
"""


def test_queue_sums_running_and_waiting_over_engines_only():
    assert ro.pd_rollout_queue(METRICS) == 7
    assert ro.pd_rollout_queue(METRICS.replace(" 2.0", " 0.0").replace(" 1.0", " 0.0").replace(" 4.0", " 0.0")) == 0
    assert ro.pd_rollout_queue("process_cpu_seconds_total 3\n") is None
    assert ro.pd_rollout_queue("") is None


def test_metric_sum_by_label():
    assert ro.pd_rollout_metric_sum(METRICS, "vllm:prompt_tokens_by_source_total",
                                    {"source": "external_kv_transfer"}) == 128.0
    assert ro.pd_rollout_metric_sum(METRICS, "vllm:prompt_tokens_by_source_total") == 135.0
    assert ro.pd_rollout_metric_sum(METRICS, "vllm:nope") is None


def test_never_deployed_only_when_no_instance_has_a_record():
    fresh = {"prefill-0": {"source": "none"}, "prefill-1": {"source": "none"}}
    assert ro.pd_rollout_never_deployed([fresh, {"decode-0": {"source": "none"}}]) is True
    # one record anywhere (deployed, or a restart pending with its saved state): one host at a time
    assert ro.pd_rollout_never_deployed([fresh, {"decode-0": {"source": "current"}}]) is False
    assert ro.pd_rollout_never_deployed([fresh, {"decode-0": {"source": "rollback"}}]) is False
    # no state read at all (a host whose facts play did not run): not a first deploy
    assert ro.pd_rollout_never_deployed([]) is False
    assert ro.pd_rollout_never_deployed([{}, {}]) is False


def test_compat_key_follows_versions_and_compat_flags_only():
    argv = ["/m", "--dtype", "bfloat16", "--max-num-seqs", "8", "--enforce-eager"]
    base = compat_key(argv, "0.32.0", "1.5.1")
    assert base.startswith("vllm=0.32.0;nixl=1.5.1;flags=")
    assert compat_key(argv, "0.33.0", "1.5.1") != base
    assert compat_key(argv, "0.32.0", "1.6.0") != base
    assert compat_key([*argv[:2], "float16", *argv[3:]], "0.32.0", "1.5.1") != base
    assert compat_key([*argv, "--kv-cache-dtype", "fp8"], "0.32.0", "1.5.1") != base
    assert compat_key(["/m-rev2", *argv[1:]], "0.32.0", "1.5.1") != base  # another model revision
    # max-num-seqs is not in the NIXL hash: changing it keeps the key (P/D pairs stay possible).
    assert compat_key([*argv[:4], "64", *argv[5:]], "0.32.0", "1.5.1") == base
    # a record without versions (validation skipped) still has a key, one that pairs with no versioned instance
    assert compat_key(argv, None, None).startswith("vllm=unknown;nixl=none;")


@pytest.mark.parametrize("inv", ["local", "b300"])
def test_prefill_and_decode_of_one_version_share_a_key(inv):
    # Their --kv-transfer-config differs in kv_role, b300's --speculative-config in num_speculative_tokens: neither
    # is in vLLM's NIXL hash, so P/D stays paired during a rollout (a key that included them sent every rollout
    # colocated from its first step).
    data = load_inventory(inv)
    keys = {}
    for hv in data["hosts"].values():
        for inst in hv["pd_instances"]:
            argv = build_argv(data["recipe"], inst)
            keys.setdefault(inst["pool"], set()).add(compat_key(argv, "0.32.0", "1.5.1"))
    assert len(keys["prefill"] | keys["decode"]) == 1, keys
    kv = '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}'
    other = '{"kv_connector": "OtherConnector", "kv_role": "kv_producer"}'
    assert compat_key(["/m", "--kv-transfer-config", kv], "1", None) != compat_key(
        ["/m", "--kv-transfer-config", other], "1", None)
    mtp, eagle = '{"method": "mtp", "num_speculative_tokens": 1}', '{"method": "eagle3", "num_speculative_tokens": 1}'
    assert compat_key(["/m", "--speculative-config", mtp], "1", None) != compat_key(
        ["/m", "--speculative-config", eagle], "1", None)


def test_keys_come_from_every_host_state():
    hv = {"a": {"pd_rollout_state": {"p": {"key": "k1"}}}, "b": {"pd_rollout_state": {"d": {"key": "k2"}}}}
    assert ro.pd_rollout_keys({"vllm_hosts": ["a", "b"]}, hv) == {"p": "k1", "d": "k2"}
    with pytest.raises(Exception, match="has no pd_rollout_state"):
        ro.pd_rollout_keys({"vllm_hosts": ["a", "c"]}, {**hv, "c": {}})
