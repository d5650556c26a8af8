"""pd_verify's checks of the cluster: the readiness, warmup, kv_transfer and prometheus steps."""

from __future__ import annotations

import json
import math
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from .client import HttpError, http_get, http_post_json
from .metrics import kv_metrics, metric_names, parse_prometheus


def _retry(fn, retries, delay, sleep=time.sleep):
    last = None
    for attempt in range(max(1, retries)):
        try:
            return fn(), attempt + 1, None
        except (HttpError, ValueError, KeyError) as e:
            last = str(e)
            if attempt + 1 < retries:
                sleep(delay)
    return None, retries, last


def key_for(cfg, base_url):
    """The bearer token for base_url: the client key for the router (front door), the workers' key for an instance
    (each vLLM instance requires pd_router_api_key on /v1); neither is ever sent where the other belongs."""
    if base_url.rstrip("/") == str(cfg.get("router_url") or "").rstrip("/"):
        return cfg.get("api_key")
    return cfg.get("worker_api_key")


def check_endpoint(name, base_url, model, *, retries=30, delay=5.0, timeout=10.0, api_key=None, sleep=time.sleep):
    """One server: /health 200 and /v1/models lists ``model``. Returns a dict with ok and error."""

    def probe():
        st, _body = http_get(base_url + "/health", timeout=timeout, api_key=api_key)
        if st != 200:
            raise HttpError(f"GET {base_url}/health: HTTP {st}")
        st, body = http_get(base_url + "/v1/models", timeout=timeout, api_key=api_key)
        if st != 200:
            raise HttpError(f"GET {base_url}/v1/models: HTTP {st}")
        doc = json.loads(body)
        ids = [m.get("id") for m in (doc.get("data") or [])]
        # vllm-router in IGW mode (pd_router_igw, needed for rolling upgrades) answers {"models": [name, ...]}.
        ids += [m for m in (doc.get("models") or []) if isinstance(m, str)]
        if model not in ids:
            raise ValueError(f"GET {base_url}/v1/models lists {ids}, not the served model '{model}'")
        return ids

    ids, attempts, err = _retry(probe, retries, delay, sleep)
    res = {"name": name, "url": base_url, "ok": err is None, "attempts": attempts}
    if err is None:
        res["models"] = ids
    else:
        res["error"] = f"{name} ({base_url}) not ready after {attempts} attempt(s): {err}"
    return res


def step_readiness(cfg, sleep=time.sleep):
    r = cfg["readiness"]
    targets = [(i["name"], i["url"]) for i in cfg["instances"]] + [("router", cfg["router_url"])]
    with ThreadPoolExecutor(max_workers=max(1, len(targets))) as ex:
        results = list(ex.map(lambda t: check_endpoint(t[0], t[1], cfg["model"], retries=r.get("retries", 30),
                                                       delay=r.get("delay_s", 5.0), timeout=r.get("timeout_s", 10.0),
                                                       api_key=key_for(cfg, t[1]), sleep=sleep), targets))
    errors = [x["error"] for x in results if not x["ok"]]
    return {"ok": not errors, "targets": results, "errors": errors}


def _completion(base_url, model, prompt, max_tokens, cfg, *, extra=None):
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
               "return_token_ids": True}
    if extra:
        payload.update(extra)
    return http_post_json(base_url + "/v1/completions", payload, timeout=cfg.get("request_timeout_s", 600),
                          api_key=key_for(cfg, base_url))


def context_lengths(cfg):
    """The context range of the inventory (pd_sla), clipped to the model window minus output tokens."""
    w = cfg["warmup"]
    window = int(cfg["max_model_len"]) - int(w["output_tokens"]) - 8
    lo, hi = int(w["context_min_tokens"]), int(w["context_max_tokens"])
    lo, hi = min(lo, window), min(hi, window)
    if lo <= 0 or hi < lo:
        raise ValueError(f"context range {w['context_min_tokens']}..{w['context_max_tokens']} does not fit the "
                         f"model window {cfg['max_model_len']} (max_model_len)")
    n = max(1, int(w.get("context_points", 3)))
    if n == 1 or lo == hi:
        return [lo]
    return sorted({int(round(lo * (hi / lo) ** (i / (n - 1)))) for i in range(n)})


WARMUP_RETRY_DELAY_S = 5.0


def _warm(fn, sleep=time.sleep):
    """One warm-up request, retried once: first contact between a decode and a prefill engine runs vLLM's NIXL
    handshake, whose side-channel reply has a fixed 5 s timeout that a loaded host can miss (the request then
    fails with kv_load_failure_policy=fail). Returns (first error or None, final error or None)."""
    try:
        fn()
        return None, None
    except HttpError as e:
        first = str(e)
    sleep(WARMUP_RETRY_DELAY_S)
    try:
        fn()
        return first, None
    except HttpError as e:
        return first, str(e)


def instance_warmups(results):
    """The per-instance feature warm-up roles/pd_verify ran before the script (module pd_instance_warmup, one result
    per instance: name, ok, error, seconds, features {name: {status, seconds, skipped_reason}}) -> (summaries,
    errors)."""
    summaries, errors = [], []
    for r in results or []:
        feats = r.get("features") or {}
        summaries.append({"name": r.get("name"), "pool": r.get("pool"), "ok": bool(r.get("ok")),
                          "seconds": r.get("seconds"), "context_tokens": r.get("context_tokens") or [],
                          "features": {f: {"status": v.get("status"), "seconds": v.get("seconds"),
                                           "skipped_reason": v.get("skipped_reason")} for f, v in feats.items()}})
        if not r.get("ok"):
            errors.append(f"warmup instance {r.get('name')}: {r.get('error') or 'failed'}")
    return summaries, errors


def step_warmup(cfg, prompts, sleep=time.sleep):
    w = cfg["warmup"]
    model, router = cfg["model"], cfg["router_url"]
    out_tok = int(w["output_tokens"])
    lengths = context_lengths(cfg)
    instances, errors = instance_warmups(w.get("instances"))
    runs, retried = [], []
    base_prompt, base_count = prompts.make(lengths[0], 1)
    for conc in w["concurrency"]:
        t0 = time.perf_counter()

        def one(i, conc=conc):
            return _warm(lambda: _completion(router, model, base_prompt + f" {i}", out_tok, cfg,
                                             extra={"ignore_eos": True}), sleep)

        with ThreadPoolExecutor(max_workers=conc) as ex:
            results = [f.result() for f in [ex.submit(one, i) for i in range(conc)]]
        errs = [final for _first, final in results if final]
        retried += [f"warmup concurrency {conc}: {first}" for first, final in results if first and not final]
        runs.append({"kind": "batch", "concurrency": conc, "context_tokens": base_count,
                     "seconds": round(time.perf_counter() - t0, 3), "errors": len(errs),
                     "retried": sum(1 for first, _final in results if first)})
        errors += [f"warmup concurrency {conc}: {e}" for e in errs]
    for n, length in enumerate(lengths):
        prompt, count = prompts.make(length, 100 + n)
        t0 = time.perf_counter()
        first, err = _warm(lambda prompt=prompt: _completion(router, model, prompt, out_tok, cfg,
                                                             extra={"ignore_eos": True}), sleep)
        if err:
            errors.append(f"warmup context {length}: {err}")
        elif first:
            retried.append(f"warmup context {length}: {first}")
        runs.append({"kind": "context", "target_tokens": length, "context_tokens": count,
                     "seconds": round(time.perf_counter() - t0, 3), "error": err, "retried_after": first})
    # A request that failed twice fails the step; one that failed once and then passed is reported, not failed.
    return {"ok": not errors, "context_lengths": lengths, "runs": runs, "errors": errors,
            "failed_then_passed": retried, "instances": instances}


def _token_ids(resp, tokenize):
    ch = (resp.get("choices") or [{}])[0]
    if isinstance(ch.get("token_ids"), list):
        return ch["token_ids"], "token_ids", ch.get("text", "")
    ids = tokenize(ch.get("text", ""))
    return ids, "tokenize(text)", ch.get("text", "")


def _delta(after, before):
    if after is None or before is None:
        return None
    return after - before


def _idle(decodes, before, after, names):
    """Decode instances whose NIXL transfer count did not move (None: the metric is missing, reported elsewhere)."""
    idle = []
    for d in decodes:
        b, a = (kv_metrics(snap[d["name"]], names)["nixl_transfers"] for snap in (before, after))
        if a is not None and (a - (b or 0.0)) <= 0:
            idle.append(d["name"])
    return idle


def _reach_every_decode(cfg, prompts, decodes, before, scrape_all):
    """The compared prompts reach the decode instances the routers pick; with several decode instances, more P/D
    requests (distinct prompts, through the router) until every one's NIXL transfer count moved, at most
    kv_check.decode_probes per decode instance: each decode instance must be shown pulling KV, not only the pool.
    Returns the last scrape and what was sent (with the error that stopped it, if one did)."""
    k = cfg["kv_check"]
    names = k["metrics"]
    limit = int(k.get("decode_probes", 0)) * len(decodes) if len(decodes) > 1 else 0
    probes = {"sent": 0, "limit": limit}
    after = scrape_all()
    while probes["sent"] < limit and _idle(decodes, before, after, names):
        prompt, _count = prompts.make(int(k["prompt_tokens"]), 2000 + probes["sent"])
        try:
            _completion(cfg["router_url"], cfg["model"], prompt, 4, cfg)
        except HttpError as e:
            probes["error"] = f"decode probe {probes['sent']}: {e}"
            break
        probes["sent"] += 1
        after = scrape_all()
    return after, probes


def step_kv_transfer(cfg, prompts):
    k = cfg["kv_check"]
    model, router = cfg["model"], cfg["router_url"]
    direct = next(i for i in cfg["instances"] if i["name"] == k["direct_instance"])
    decodes = [i for i in cfg["instances"] if i["pool"] == "decode"]
    names = k["metrics"]

    def scrape_all():
        res = {}
        for d in decodes:
            st, body = http_get(d["url"] + "/metrics", timeout=30, api_key=key_for(cfg, d["url"]))
            if st != 200:
                raise HttpError(f"GET {d['url']}/metrics: HTTP {st}")
            res[d["name"]] = parse_prometheus(body)
        return res

    def tokenize(text):
        r = http_post_json(direct["url"] + "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False},
                           timeout=60, api_key=key_for(cfg, direct["url"]))
        return r.get("tokens") or []

    errors, cases = [], []
    before = scrape_all()
    for n in range(int(k["prompts"])):
        prompt, count = prompts.make(int(k["prompt_tokens"]), 1000 + n)
        case = {"prompt_tokens": count}
        try:
            # ignore_eos: compare max_tokens tokens even when the model would stop early.
            pd = _completion(router, model, prompt, int(k["max_tokens"]), cfg, extra={"ignore_eos": True})
            co = _completion(direct["url"], model, prompt, int(k["max_tokens"]), cfg, extra={"ignore_eos": True})
            pd_ids, basis, pd_text = _token_ids(pd, tokenize)
            co_ids, _co_basis, co_text = _token_ids(co, tokenize)
        except HttpError as e:
            case["error"] = str(e)
            errors.append(f"prompt {n}: {e}")
            cases.append(case)
            continue
        same = pd_ids == co_ids
        first_diff = next((i for i, (a, b) in enumerate(zip(pd_ids, co_ids, strict=False)) if a != b),
                          None if len(pd_ids) == len(co_ids) else min(len(pd_ids), len(co_ids)))
        case.update({"identical": same, "basis": basis, "pd_tokens": len(pd_ids), "colocated_tokens": len(co_ids),
                     "first_mismatch": first_diff, "pd_text": pd_text[:200], "colocated_text": co_text[:200]})
        if not same:
            fd = first_diff if first_diff is not None else 0
            errors.append(f"prompt {n}: token ids differ between P/D (router) and colocated ({direct['name']}) "
                          f"at position {first_diff}: P/D {pd_ids[fd:fd + 3]} vs colocated {co_ids[fd:fd + 3]}")
        cases.append(case)
    after, probes = _reach_every_decode(cfg, prompts, decodes, before, scrape_all)
    if "error" in probes:
        errors.append(probes["error"])
    per_decode = {}
    tot = {"kv_transfer_tokens": 0.0, "local_compute_tokens": 0.0, "nixl_transfers": 0.0, "nixl_failed": 0.0}
    missing = []
    for d in decodes:
        b, a = kv_metrics(before[d["name"]], names), kv_metrics(after[d["name"]], names)
        delta = {key: _delta(a[key], b[key]) for key in a}
        per_decode[d["name"]] = delta
        for key, v in delta.items():
            if key == "nixl_failed":
                tot[key] += v if v is not None else (a[key] or 0.0)  # counter born during the check
                continue
            if v is None and a[key] is None:
                missing.append(f"{d['name']}: metric for {key} not exposed")
            else:
                tot[key] += v or 0.0
    if missing:
        avail = metric_names(after[decodes[0]["name"]], r"nixl|prompt_tokens|kv") if decodes else []
        errors.append("decode /metrics lacks " + "; ".join(missing) + f" (metrics seen: {avail})")
    frac = None
    computed = tot["kv_transfer_tokens"] + tot["local_compute_tokens"]
    if computed > 0:
        frac = tot["kv_transfer_tokens"] / computed
    if tot["nixl_failed"] > 0:
        errors.append(f"decode reports {tot['nixl_failed']:.0f} failed NIXL transfer(s) during the check")
    if not missing:
        if tot["nixl_transfers"] <= 0:
            errors.append("decode shows no NIXL transfer during the check (transfer count delta 0): the KV was not "
                          "pulled from prefill")
        else:
            sent = len(cases) + probes["sent"]
            errors += [f"decode instance {name} received no KV over NIXL in {sent} P/D requests through the router "
                       "(its transfer count did not move, the others' did): the routers do not send it requests, "
                       "or its NIXL handshake with the prefill pool fails"
                       for name in _idle(decodes, before, after, names)]
        if frac is None or frac < float(k["min_transfer_fraction"]):
            errors.append(f"decode computed the prompt itself: kv_transfer {tot['kv_transfer_tokens']:.0f} vs "
                          f"local_compute {tot['local_compute_tokens']:.0f} tokens (transferred fraction {frac}, "
                          f"need >= {k['min_transfer_fraction']})")
    return {"ok": not errors, "direct_instance": direct["name"], "cases": cases, "decode_deltas": per_decode,
            "decode_probes": probes, "totals": tot, "transferred_fraction": frac, "errors": errors}


def step_prometheus(cfg):
    p = cfg["prometheus"]
    out, errors = {}, []
    for key, query in (p.get("queries") or {}).items():
        url = p["url"].rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": query})
        try:
            st, body = http_get(url, timeout=15)
            if st != 200:
                raise HttpError(f"GET {url}: HTTP {st}: {body[:200]}")
            res = json.loads(body)
            vals = {}
            for r in res.get("data", {}).get("result", []):
                label = r.get("metric", {}).get(p.get("group_label", "pool"), "all")
                v = float(r["value"][1])
                vals[label] = None if math.isnan(v) else round(v, 6)
            out[key] = vals
            if not vals:
                errors.append(f"prometheus {key}: no series (query {query})")
        except (HttpError, ValueError, KeyError) as e:
            errors.append(f"prometheus {key}: {e}")
    required = bool(p.get("required", False))
    return {"ok": (not errors) or not required, "required": required, "url": p["url"], "values": out,
            "errors": errors if required else [], "warnings": [] if required else errors}
