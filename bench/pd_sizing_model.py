"""The P:D sizing model (issue 34): from measured max rates of some shapes to the max rate of any shape, and the
split that serves a traffic mix within the SLA with the most goodput.

The model, and what it assumes (docs/sizing.md says it for operators):

- A *shape* is N_p prefill instances of one instance type and N_d decode instances of one type (a type: its pool,
  GPUs per instance and parallelism, e.g. "prefill TP1 DP4 EP, 4 GPUs").
- At the SLA knee of one request class (input L tokens, output O tokens) the cluster's max rate is
      R(N_p, N_d) = min(N_p * p, N_d * d, S)
  p: the requests/s one prefill instance serves within the TTFT target; d: the requests/s one decode instance serves
  within the TPOT target; S: a budget the instances share (requests/s), finite only where engines share hardware
  (the embedded default: every engine runs on the same two CPU cores), unbounded on b300 (each instance owns its
  GPUs; the NICs between them are assumed not to bind, KV transfer time is part of TTFT).
- Instances of a pool scale linearly (the router spreads load evenly; no cross-instance interference).
- A mix of classes is served at rate R when each pool's busy share fits: R * sum_i w_i / p_i <= N_p and
  R * sum_i w_i / d_i <= N_d (and R <= S at the measured class only: a shared budget is not carried to other
  classes). p at another input length scales as prefill tokens/s (p * L), interpolated in log L between measured
  lengths; d scales as decode tokens/s (d * O) interpolated in log L. Nothing is extrapolated: a class whose input
  length is outside the measured lengths, or whose output length is not a measured one within 2x, is refused.

Fitting p, d and S from measurements: each measured shape's rate is bound by one of the three terms. Two shapes
cannot tell "prefill bound at 1P1D, decode bound at 2P1D" from "a shared budget bound both", so a measurement may
say what bound it (`bound`: the metric the capacity search failed on first, TTFT = prefill, TPOT = decode; or
`shared` where the hosts' cores were saturated); unsaid, every reading is tried. Every assignment of measurements
to terms is tried; a term's value is the geometric mean of R/N over the measurements
bound by it, a term bound by none is known only from below (its largest R/N: "at least"), and an assignment holds
when each measurement's own term is its smallest. The assignment with the least squared log error wins; on a tie
the one predicting less (conservative). A prediction that a term known only from below decides is marked as a lower
bound.
"""

from __future__ import annotations

import itertools
import math

TERMS = ("prefill", "decode", "shared")
OUTPUT_RANGE = 2.0  # an output length is inside the measured range within this factor of a measured one
TIE_TOLERANCE = 1e-9


class SizingError(ValueError):
    """Input the model cannot answer without extrapolating, or malformed; the message names the field."""


def _positive(field, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise SizingError(f"{field}: {value!r} must be a positive number")
    return float(value)


def _count(field, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SizingError(f"{field}: {value!r} must be an integer >= 1")
    return value


def check_measurement(m, where):
    """A measured shape at one class: {prefill: N_p, decode: N_d, max_rate: R} -> normalized copy."""
    if not isinstance(m, dict):
        raise SizingError(f"{where}: expected a mapping with prefill, decode, max_rate")
    bound = m.get("bound")
    if bound is not None and bound not in TERMS:
        raise SizingError(f"{where}.bound: {bound!r} is not one of {', '.join(TERMS)} (or leave it out)")
    return {"prefill": _count(f"{where}.prefill", m.get("prefill")),
            "decode": _count(f"{where}.decode", m.get("decode")),
            "max_rate": _positive(f"{where}.max_rate", m.get("max_rate")),
            "bound": bound,
            "name": str(m.get("name") or f"{m.get('prefill')}P{m.get('decode')}D")}


def _per_instance(m, term):
    return m["max_rate"] / (m[term] if term != "shared" else 1)


def _rate(values, shape, shared):
    """min over the terms of shape's capacity; values: term -> (value, exact). A term known only from below can be
    as large as needed, so it never binds a measured shape."""
    def cap(term, n):
        value, exact = values[term]
        return n * value if exact else math.inf
    caps = {"prefill": cap("prefill", shape["prefill"]), "decode": cap("decode", shape["decode"])}
    if shared:
        caps["shared"] = cap("shared", 1)
    term = min(caps, key=caps.get)
    return caps[term], term


def fit(measurements, shared=False):
    """The per-instance rates p, d (and shared budget S) of one class from measured shapes.

    Returns {"terms": {term: {"value": float, "exact": bool, "bound_by": [names]}}, "error": rms log error,
    "assignment": {name: term}}. exact False: only a lower bound (no measurement was bound by it)."""
    ms = [check_measurement(m, f"measurements[{i}]") for i, m in enumerate(measurements)]
    if not ms:
        raise SizingError("measurements: at least one measured shape is needed")
    terms = TERMS if shared else TERMS[:2]
    for i, m in enumerate(ms):
        if m["bound"] == "shared" and not shared:
            raise SizingError(f"measurements[{i}].bound: 'shared' needs shared hardware (the engines share hosts' "
                              "cores or GPUs); set shared_hardware: true or name the pool that bound it")
    best = None
    for assignment in itertools.product(terms, repeat=len(ms)):
        if any(m["bound"] not in (None, term) for m, term in zip(ms, assignment, strict=True)):
            continue  # the measurement says which term bound it (the search's failing metric, the host load)
        values = {}
        for term in terms:
            mine = [m for m, t in zip(ms, assignment, strict=True) if t == term]
            if mine:
                values[term] = (math.exp(sum(math.log(_per_instance(m, term)) for m in mine) / len(mine)), True)
            else:  # only known from below: no measurement may be bound by less
                values[term] = (max(_per_instance(m, term) for m in ms), False)
        if not shared:
            values["shared"] = (math.inf, False)
        # The assignment holds when each measurement's own term is (one of) its smallest.
        holds, err = True, 0.0
        for m, term in zip(ms, assignment, strict=True):
            rate, _smallest = _rate(values, m, shared)
            own = m[term] * values[term][0] if term != "shared" else values[term][0]
            if own > rate * (1 + 1e-9):
                holds = False
                break
            err += math.log(rate / m["max_rate"]) ** 2
        if not holds:
            continue
        err = math.sqrt(err / len(ms))
        score = (round(err, 9), sum(v for v, _exact in values.values() if math.isfinite(v)))
        if best is None or score < best[0]:
            best = (score, values, assignment)
    if best is None:
        raise SizingError("measurements: no reading of the bounds fits every measurement (each shape's own bound "
                          "must be its smallest capacity); check the bound of each measurement")
    _score, values, assignment = best
    pairs = list(zip(ms, assignment, strict=True))
    return {"terms": {t: {"value": values[t][0], "exact": values[t][1],
                          "bound_by": [m["name"] for m, a in pairs if a == t]} for t in TERMS},
            "error": best[0][0], "assignment": {m["name"]: a for m, a in pairs}}


def predict(fitted, prefill, decode):
    """Max rate of N_p prefill x N_d decode at the fitted class: {"max_rate", "bound", "lower_bound_only"}."""
    _count("prefill", prefill)
    _count("decode", decode)
    t = fitted["terms"]
    caps = {"prefill": prefill * t["prefill"]["value"], "decode": decode * t["decode"]["value"],
            "shared": t["shared"]["value"]}
    bound = min(caps, key=caps.get)
    return {"max_rate": caps[bound], "bound": bound, "lower_bound_only": not t[bound]["exact"],
            "capacity": caps}


def _interp_log(points, x):
    """Piecewise-linear interpolation in log-log over sorted (x, y) points; x inside their range."""
    pts = sorted(points)
    if len(pts) == 1:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= x <= x1:
            if x1 == x0:
                return y0
            f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
    raise SizingError(f"input length {x} is outside the measured lengths {pts[0][0]:g}-{pts[-1][0]:g}")


def class_rates(classes, mix):
    """Per-instance requests/s of each pool for every class of the mix.

    classes: [{input_tokens, output_tokens, fit (fit() result)}] - the measured classes; mix: [{input_tokens,
    output_tokens, weight}]. Returns [{..mix entry, p, d}] or raises SizingError for a class outside the range."""
    if not classes:
        raise SizingError("classes: at least one measured class is needed")
    lengths = sorted(c["input_tokens"] for c in classes)
    outputs = sorted({c["output_tokens"] for c in classes})
    prefill_tps = [(c["input_tokens"], c["fit"]["terms"]["prefill"]["value"] * c["input_tokens"]) for c in classes]
    decode_tps = [(c["input_tokens"], c["fit"]["terms"]["decode"]["value"] * c["output_tokens"]) for c in classes]
    out = []
    for i, entry in enumerate(mix):
        where = f"mix[{i}]"
        if not isinstance(entry, dict):
            raise SizingError(f"{where}: expected a mapping with input_tokens, output_tokens, weight")
        n_in = _positive(f"{where}.input_tokens", entry.get("input_tokens"))
        n_out = _positive(f"{where}.output_tokens", entry.get("output_tokens"))
        weight = _positive(f"{where}.weight", entry.get("weight", 1))
        if not lengths[0] <= n_in <= lengths[-1]:
            raise SizingError(
                f"{where}.input_tokens: {n_in:g} is outside the measured input lengths {lengths[0]:g}-{lengths[-1]:g}; "
                "measure that length with bench/sla_capacity.py --contexts first (the tool does not extrapolate)")
        if not any(o / OUTPUT_RANGE <= n_out <= o * OUTPUT_RANGE for o in outputs):
            raise SizingError(
                f"{where}.output_tokens: {n_out:g} is not within {OUTPUT_RANGE:g}x of a measured output length "
                f"({', '.join(f'{o:g}' for o in outputs)}); measure it with --output-len first")
        out.append({"input_tokens": n_in, "output_tokens": n_out, "weight": weight,
                    "p": _interp_log(prefill_tps, n_in) / n_in, "d": _interp_log(decode_tps, n_in) / n_out})
    return out


def mix_capacity(rates, prefill, decode):
    """Max rate of a shape for a mix: each pool's busy share fits. Returns {"max_rate", "bound", per pool demand}."""
    total = sum(r["weight"] for r in rates)
    demand_p = sum(r["weight"] / total / r["p"] for r in rates)  # prefill instance-seconds per request
    demand_d = sum(r["weight"] / total / r["d"] for r in rates)
    caps = {"prefill": prefill / demand_p, "decode": decode / demand_d}
    bound = min(caps, key=caps.get)
    return {"max_rate": caps[bound], "bound": bound, "capacity": caps}


def _packs(sizes, hosts, per_host):
    """Whether instances of the given GPU counts fit on hosts of per_host GPUs (first fit decreasing)."""
    free = [per_host] * hosts
    for size in sorted(sizes, reverse=True):
        for h, room in enumerate(free):
            if room >= size:
                free[h] -= size
                break
        else:
            return False
    return True


def best_split(rates, *, gpus, gpus_per_host, prefill_gpus, decode_gpus, target_rate=None, headroom=0.0):
    """The split (N_p, N_d) for the mix on `gpus` GPUs in hosts of gpus_per_host.

    target_rate None: the most goodput that fits. Otherwise the fewest GPUs that serve target_rate with each pool
    at least `headroom` (0.2 = 20 %) above it, then the most goodput. Returns the chosen split and every candidate."""
    hosts = gpus // gpus_per_host
    if hosts < 1:
        raise SizingError(f"gpus: {gpus} is less than one host of {gpus_per_host}")
    candidates = []
    for n_p in range(1, gpus // prefill_gpus + 1):
        for n_d in range(1, (gpus - n_p * prefill_gpus) // decode_gpus + 1):
            if not _packs([prefill_gpus] * n_p + [decode_gpus] * n_d, hosts, gpus_per_host):
                continue
            cap = mix_capacity(rates, n_p, n_d)
            candidates.append({"prefill": n_p, "decode": n_d, "gpus": n_p * prefill_gpus + n_d * decode_gpus, **cap})
    if not candidates:
        raise SizingError(f"no split of one prefill ({prefill_gpus} GPUs) and one decode ({decode_gpus} GPUs) "
                          f"instance fits {gpus} GPUs")
    if target_rate is None:
        chosen = max(candidates, key=lambda c: (c["max_rate"], -c["gpus"]))
    else:
        need = target_rate * (1 + headroom)
        fitting = [c for c in candidates if min(c["capacity"].values()) >= need]
        if not fitting:
            top = max(c["max_rate"] for c in candidates)
            raise SizingError(f"target_rate: {target_rate:g} req/s with {headroom:.0%} headroom does not fit {gpus} "
                              f"GPUs (the most any split serves is {top:.3g} req/s); add GPUs or lower the rate")
        chosen = min(fitting, key=lambda c: (c["gpus"], -c["max_rate"]))
    offered = target_rate if target_rate is not None else chosen["max_rate"]
    chosen = dict(chosen, headroom={pool: cap / offered - 1 for pool, cap in chosen["capacity"].items()})
    return {"chosen": chosen, "candidates": candidates}
