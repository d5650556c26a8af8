"""Filters of the pd_rollout role (drain-first, one instance at a time; docs/upgrades.md).

``pd_rollout_topology(cluster, hosts)``: the instances of the cluster view (``pd_cluster``, validated once by
playbooks/validate.yml) on ``hosts`` as ``{name, host, pool, url, http_port}`` in inventory order (URL as the
router knows it).

``pd_rollout_order(topology)``: the host order of a rollout: hosts with prefill instances only, then the
others (a host with the decode pool last); and per host its instances, prefill first.

``pd_rollout_routing(topology, keys, out, prefer_key, model)``: the router registry wanted while the instances
named in ``out`` are out of rotation. P/D pairs only instances of one NIXL compatibility key (``keys``:
name -> key; vLLM's NIXL handshake rejects peers whose vLLM version, NIXL connector version, model, dtype, KV
cache dtype, attention backend or speculative config differ). When no prefill and decode instance of one key
are left, whole requests go to the remaining prefill instances as regular (colocated) workers.

``pd_rollout_queue(metrics_text)``: ``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` summed over
every label set of a vLLM ``/metrics`` page; None when neither metric is there.

``pd_rollout_never_deployed(states)``: True when the per-host ``pd_rollout_state`` dicts name at least one instance
and none of them has a record (``source`` none): a first deploy, where every host may start at once.

The compatibility keys come from the instances' records (``compat_key``, computed once by
``plugins/module_utils/pd_record.py`` when ``vllm_instance`` renders the unit; read back by ``pd_instance_state``).
"""

from __future__ import annotations

from ansible_collections.b300.pd.plugins.plugin_utils.pd_filter_errors import fail

# The Prometheus text parser of the verify script (standard library only, so the script can run alone on a router
# host): one parser for the rollout's /metrics reads and verify's.
from ansible_collections.b300.pd.roles.pd_verify.files.pd_verify import metric_sum, parse_prometheus

POOLS = ("prefill", "decode")
QUEUE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def pd_rollout_topology(cluster, hosts=None):
    """The cluster view's instances on ``hosts`` (default every vLLM host) as {name, host, pool, url, http_port}."""
    if not isinstance(cluster, dict) or not isinstance(cluster.get("instances"), list):
        fail("pd_rollout: pd_cluster (the cluster view) is not defined; run the role through a playbook that imports "
             "playbooks/validate.yml first (site.yml, playbooks/deploy.yml): it validates the topology and "
             "publishes pd_cluster to every host")
    out = [{"name": i["name"], "host": i["host"], "pool": i["pool"], "url": i["url"], "http_port": i["http_port"]}
           for i in cluster["instances"] if hosts is None or i["host"] in hosts]
    for pool in POOLS:
        if not any(t["pool"] == pool for t in out):
            fail(f"pd_rollout: no {pool} instance on the hosts of pd_rollout_worker_group ({', '.join(hosts or [])})")
    return out


def pd_rollout_order(topology):
    """[{host, instances: [names]}]: prefill-only hosts first, in inventory order, then the rest."""
    hosts = []
    for t in topology:
        if t["host"] not in hosts:
            hosts.append(t["host"])

    def pools(h):
        return {t["pool"] for t in topology if t["host"] == h}

    ordered = [h for h in hosts if pools(h) == {"prefill"}] + [h for h in hosts if pools(h) != {"prefill"}]
    rank = {"prefill": 0, "decode": 1}

    def instances_of(host):
        return [t["name"] for t in sorted((t for t in topology if t["host"] == host), key=lambda t: rank[t["pool"]])]

    return [{"host": h, "instances": instances_of(h)} for h in ordered]


def pd_rollout_routing(topology, keys, out=(), prefer_key=None, model=None):
    """Wanted registry: [{url, worker_type, model_id, name}]; see the module docstring."""
    if not model:
        fail("pd_rollout: the model id (pd_served_model_name) is empty")
    out = set(out or [])
    missing = [t["name"] for t in topology if t["name"] not in (keys or {})]
    if missing:
        fail(f"pd_rollout: no compatibility key for instance(s) {', '.join(missing)} (facts not gathered)")
    avail = [t for t in topology if t["name"] not in out]
    counts = {}
    for t in avail:
        if t["pool"] == "prefill":
            counts[keys[t["name"]]] = counts.get(keys[t["name"]], 0) + 1
    candidates = ([prefer_key] if prefer_key else []) + sorted(counts, key=lambda k: (-counts[k], k))
    for key in candidates:
        pre = [t for t in avail if t["pool"] == "prefill" and keys[t["name"]] == key]
        dec = [t for t in avail if t["pool"] == "decode" and keys[t["name"]] == key]
        if pre and dec:
            return [{"url": t["url"], "worker_type": t["pool"], "model_id": model, "name": t["name"]}
                    for t in pre + dec]
    regular = [t for t in avail if t["pool"] == "prefill"] or [t for t in avail if t["pool"] == "decode"]
    if not regular:
        fail(f"pd_rollout: taking {', '.join(sorted(out))} out of rotation leaves no instance to serve; "
             "a rollout needs at least two instances")
    return [{"url": t["url"], "worker_type": "regular", "model_id": model, "name": t["name"]} for t in regular]


def pd_rollout_keys(groups, hostvars, group="vllm_hosts"):
    """{instance: compatibility key} from the pd_rollout_state fact of every host of ``group``."""
    keys = {}
    for host in (groups or {}).get(group) or []:
        state = hostvars[host].get("pd_rollout_state")
        if not state:
            fail(f"pd_rollout: host '{host}' has no pd_rollout_state (run the role's facts.yml on every host of "
                 f"'{group}' first)")
        for name, st in state.items():
            keys[name] = st["key"]
    return keys


def pd_rollout_routing_mode(registry):
    """'pd' when the registry has prefill/decode workers, 'colocated' when only regular ones."""
    return "pd" if any(w["worker_type"] in POOLS for w in registry) else "colocated"


def pd_rollout_queue(metrics_text):
    samples = parse_prometheus(metrics_text or "")
    sums = [v for v in (metric_sum(samples, name) for name in QUEUE_METRICS) if v is not None]
    return int(round(sum(sums))) if sums else None


def pd_rollout_metric_sum(metrics_text, name, labels=None):
    """Sum of the samples of ``name`` whose labels include ``labels`` (dict); None when there is none."""
    return metric_sum(parse_prometheus(metrics_text or ""), name, **{k: str(v) for k, v in (labels or {}).items()})


def pd_rollout_never_deployed(states):
    sources = [inst.get("source") for state in states or [] for inst in (state or {}).values()]
    return bool(sources) and all(src == "none" for src in sources)


def pd_rollout_partner(topology, keys, name, key):
    """Name of an instance of the other pool with compatibility key ``key`` (for the P/D smoke), or ''."""
    me = next((t for t in topology if t["name"] == name), None)
    if me is None:
        fail(f"pd_rollout: instance '{name}' is not in the topology")
    other = "decode" if me["pool"] == "prefill" else "prefill"
    for t in topology:
        if t["pool"] == other and t["name"] != name and keys.get(t["name"]) == key:
            return t["name"]
    return ""
