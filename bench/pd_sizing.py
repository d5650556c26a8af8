#!/usr/bin/env python3
"""P:D sizing (issue 34): turn measured capacity into the P:D split for a traffic mix.

Three steps, each a subcommand; the model and its assumptions are in bench/pd_sizing_model.py and docs/sizing.md.

1. measure: from capacity-search reports (bench/sla_capacity.py) of shapes deployed from inventories, the
   measured classes (input/output length) with each shape's max rate and what bound it:
       bench/pd_sizing.py measure --report inventory/local=docs/capacity/<run>/report.json [--report INV=R ...]
           [--shared-hardware --cores 2] > measured.yml
2. predict: the max rate of a shape nobody measured (and, given its measured rate, the error):
       bench/pd_sizing.py predict --input measured.yml --shape 2P2D [--measured-rate 9.1]
3. split: the split for a traffic mix on the GPUs available, its headroom per pool, and an inventory patch:
       bench/pd_sizing.py split --input sizing.yml [--patch-dir out/host_vars]

The input of predict/split (YAML):
    shared_hardware: false            # true where engines share cores/GPUs (the embedded default)
    classes:                          # measured classes: input/output tokens and shapes' max rates
      - {input_tokens: 16384, output_tokens: 1024,
         measurements: [{name: 4P1D, prefill: 4, decode: 1, max_rate: 1.3, bound: prefill}]}
    instance_types: {prefill: {gpus: 4, tp_size: 1, dp_size: 4}, decode: {gpus: 8, tp_size: 1, dp_size: 8}}
    cluster: {gpus: 24, gpus_per_host: 8, hosts: [b300-01, b300-02, b300-03]}
    mix: [{input_tokens: 16384, output_tokens: 1024, weight: 0.5}, ...]
    target_rate: null                 # req/s, or null for "as much as fits"
    headroom: 0.2                     # with target_rate: each pool's capacity at least this much above it
Exit 0 on an answer, 2 on input the model refuses (the message names the field).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import yaml
from ansible_collections.b300.pd.bench import pd_cluster
from ansible_collections.b300.pd.bench import pd_sizing_model as model

MISFIT_WARN = 0.1
SHAPE_RE = re.compile(r"([0-9]+)P([0-9]+)D")


def bound_of(context, *, shared_hardware, cores):
    """What bound one context of a capacity report: the failing metric of the first failing point above the max
    rate (TTFT -> prefill, TPOT -> decode), or the shared budget where the hosts' cores were saturated at the max
    rate (1-minute load >= cores). None when the report cannot tell."""
    points = context.get("points") or []
    at_max = [p for p in points if p.get("passed") and p.get("rate") == context.get("max_rate")]
    if shared_hardware and at_max and (at_max[-1].get("load_avg_1m") or 0) >= cores:
        return "shared"
    failing = [p for p in points if not p.get("passed") and p.get("rate", 0) > (context.get("max_rate") or 0)]
    reason = (min(failing, key=lambda p: p["rate"]).get("reason") or "") if failing else ""
    if "TTFT" in reason:
        return "prefill"
    if "TPOT" in reason:
        return "decode"
    return None


def measure(reports, *, shared_hardware=False, cores=None):
    """Measured classes from [(inventory, report path)]: the shape of each from the inventory's cluster view."""
    cores = cores or os.cpu_count() or 1
    classes = {}
    for inventory, path in reports:
        report = json.loads(Path(path).read_text())
        pools = pd_cluster.load(inventory)["pools"]
        n_p, n_d = len(pools.get("prefill") or []), len(pools.get("decode") or [])
        for ctx in report.get("contexts") or []:
            if not ctx.get("max_rate"):
                continue
            key = (int(ctx["context"]), int(report.get("output_len") or 0))
            classes.setdefault(key, []).append({
                "name": f"{n_p}P{n_d}D", "prefill": n_p, "decode": n_d, "max_rate": round(ctx["max_rate"], 4),
                "bound": bound_of(ctx, shared_hardware=shared_hardware, cores=cores),
                "report": str(path), "inventory": str(inventory)})
    return {"shared_hardware": shared_hardware,
            "classes": [{"input_tokens": i, "output_tokens": o, "measurements": ms}
                        for (i, o), ms in sorted(classes.items())]}


def fitted_classes(data):
    shared = bool(data.get("shared_hardware"))
    classes = data.get("classes") or []
    if not isinstance(classes, list) or not classes:
        raise model.SizingError("classes: at least one measured class (input_tokens, output_tokens, measurements)")
    out = []
    for i, c in enumerate(classes):
        try:
            fit = model.fit(c.get("measurements") or [], shared=shared)
        except model.SizingError as err:
            raise model.SizingError(f"classes[{i}].{err}") from None
        out.append({"input_tokens": c["input_tokens"], "output_tokens": c["output_tokens"], "fit": fit})
    return out


def parse_shape(text):
    match = SHAPE_RE.fullmatch(text or "")
    if not match:
        raise model.SizingError(f"--shape: {text!r} is not <N>P<M>D (e.g. 2P2D)")
    return int(match.group(1)), int(match.group(2))


def predict(data, shape, measured_rate=None):
    n_p, n_d = parse_shape(shape)
    rows = []
    for c in fitted_classes(data):
        pred = model.predict(c["fit"], n_p, n_d)
        row = {"input_tokens": c["input_tokens"], "output_tokens": c["output_tokens"], "shape": shape, **pred,
               "fit": c["fit"]}
        if measured_rate:
            row["measured_rate"] = measured_rate
            row["error"] = pred["max_rate"] / measured_rate - 1
        rows.append(row)
    return rows


def instance_patch(split, types, cluster):
    """host_vars pd_instances for the split: instances packed first-fit decreasing onto the cluster's hosts, GPUs
    numbered per host, ports by the b300 inventory's convention (validate.yml checks the result)."""
    n_hosts = cluster["gpus"] // cluster["gpus_per_host"]
    hosts = list(cluster.get("hosts") or [f"host-{i + 1:02d}" for i in range(n_hosts)])
    free = {h: list(range(cluster["gpus_per_host"])) for h in hosts}
    placed = {h: [] for h in hosts}
    wanted = [("decode", i) for i in range(split["decode"])] + [("prefill", i) for i in range(split["prefill"])]
    wanted.sort(key=lambda w: -types[w[0]]["gpus"])
    for pool, i in wanted:
        size = types[pool]["gpus"]
        host = next((h for h in hosts if len(free[h]) >= size), None)
        if host is None:
            raise model.SizingError(f"cluster: the split does not pack onto {len(hosts)} hosts")
        gpus, free[host] = free[host][:size], free[host][size:]
        k = len(placed[host])
        placed[host].append({
            "name": f"{pool}-{chr(ord('a') + i)}", "pool": pool, "gpus": gpus,
            "tp_size": types[pool].get("tp_size", 1), "dp_size": types[pool].get("dp_size", size),
            "http_port": (8100 if pool == "prefill" else 8200) + k,
            "nixl_side_channel_port": (5600 if pool == "prefill" else 5700) + 10 * k,
            "dp_rpc_port": 13345 + 10 * k,
            "ucx_net_devices": ",".join(f"mlx5_{g}:1" for g in gpus)})
    return {h: {"pd_instances": insts} for h, insts in placed.items() if insts}


def split(data):
    for field in ("instance_types", "cluster", "mix"):
        if not data.get(field):
            raise model.SizingError(f"{field}: required for split (see bench/pd_sizing.py --help)")
    if data.get("shared_hardware"):
        raise model.SizingError("shared_hardware: a split moves GPUs between pools; with engines sharing hardware "
                                "the pools' capacities are not separate, so the tool only predicts shapes there")
    types, cluster = data["instance_types"], data["cluster"]
    rates = model.class_rates(fitted_classes(data), data["mix"])
    answer = model.best_split(rates, gpus=cluster["gpus"], gpus_per_host=cluster["gpus_per_host"],
                              prefill_gpus=types["prefill"]["gpus"], decode_gpus=types["decode"]["gpus"],
                              target_rate=data.get("target_rate"), headroom=float(data.get("headroom") or 0))
    answer["patch"] = instance_patch(answer["chosen"], types, cluster)
    answer["class_rates"] = rates
    return answer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--report", action="append", required=True, metavar="INVENTORY=REPORT_JSON")
    m.add_argument("--shared-hardware", action="store_true")
    m.add_argument("--cores", type=int)
    p = sub.add_parser("predict")
    p.add_argument("--input", type=Path, required=True)
    p.add_argument("--shape", required=True)
    p.add_argument("--measured-rate", type=float)
    s = sub.add_parser("split")
    s.add_argument("--input", type=Path, required=True)
    s.add_argument("--patch-dir", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "measure":
            pairs = [r.split("=", 1) for r in args.report]
            if any(len(pr) != 2 for pr in pairs):
                raise model.SizingError("--report: use INVENTORY=REPORT_JSON")
            print(yaml.safe_dump(measure(pairs, shared_hardware=args.shared_hardware, cores=args.cores),
                                 sort_keys=False))
            return 0
        data = yaml.safe_load(args.input.read_text()) or {}
        if args.cmd == "predict":
            for row in predict(data, args.shape, args.measured_rate):
                note = " (a lower bound: no measurement was bound by that term)" if row["lower_bound_only"] else ""
                err = f"; measured {row['measured_rate']:g}, error {row['error']:+.1%}" if "error" in row else ""
                print(f"{row['shape']} at {row['input_tokens']:g}/{row['output_tokens']:g} tokens: "
                      f"{row['max_rate']:.3f} req/s, bound by {row['bound']}{note}{err}")
                print(f"  fit: {json.dumps(row['fit'])}")
                if row["fit"]["error"] > MISFIT_WARN:
                    print(f"  warning: the measurements fit the model only to {row['fit']['error']:.0%} (rms log "
                          "error): the shapes do not scale as the model assumes; trust the prediction less")
            return 0
        answer = split(data)
        c = answer["chosen"]
        print(f"split: {c['prefill']} prefill x {data['instance_types']['prefill']['gpus']} GPUs + {c['decode']} "
              f"decode x {data['instance_types']['decode']['gpus']} GPUs = {c['gpus']} GPUs; max rate "
              f"{c['max_rate']:.3f} req/s (bound by {c['bound']}); headroom "
              + ", ".join(f"{k} {v:+.0%}" for k, v in c["headroom"].items()))
        for cand in sorted(answer["candidates"], key=lambda x: -x["max_rate"])[:8]:
            print(f"  {cand['prefill']}P{cand['decode']}D: {cand['max_rate']:.3f} req/s ({cand['bound']}), "
                  f"{cand['gpus']} GPUs")
        if args.patch_dir:
            args.patch_dir.mkdir(parents=True, exist_ok=True)
            for host, hv in answer["patch"].items():
                (args.patch_dir / f"{host}.yml").write_text("---\n" + yaml.safe_dump(hv, sort_keys=False))
            print(f"inventory patch: {args.patch_dir}/<host>.yml")
        return 0
    except model.SizingError as err:
        print(f"pd_sizing: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
