#!/usr/bin/env python3
"""Verify a vLLM P/D deployment from a cluster peer (the router host). Standard library only.

Steps (each returns a JSON-able dict with ``ok`` and details):
  readiness    every instance: GET /health == 200 and /v1/models lists the served model; the router likewise
  warmup       every instance alone on every request feature (logprobs, chat, structured output, ...: roles/pd_verify
               runs module pd_instance_warmup before the script and hands its results in as warmup.instances), then
               through the router: concurrency 1..N at the shortest context, then the context range; a request
               that fails is retried once after 5 s (first NIXL handshake under load) and reported
  kv_transfer  the same greedy prompts via the router (P/D) and directly to one instance (colocated):
               identical token ids; decode /metrics deltas show KV transferred, not recomputed
  accuracy     not run here: roles/pd_verify runs lm-evaluation-harness on the control node (its module
               pd_verify_lmeval) and merges that step into this report with --merge (below)
  sla          a streaming benchmark through the router: mean TTFT / TPOT and goodput vs the SLA
  prometheus   per-pool TTFT / TPOT read back from Prometheus (informational unless required)

Usage: pd_verify.py --config cfg.json --json out.json --markdown out.md
       pd_verify.py --merge report.json --step-result accuracy=acc.json --json out.json --markdown out.md
The exit code is 0 when every enforced step passed, 1 otherwise, 2 on bad config or input.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

STEPS = ("readiness", "warmup", "kv_transfer", "accuracy", "sla", "prometheus")


class HttpError(Exception):
    """An HTTP request failed; ``str()`` says which URL and why."""


# --------------------------------------------------------------------------------------------- HTTP helpers
def _headers(api_key=None):
    h = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def http_get(url, timeout=10.0, api_key=None):
    """GET url -> (status, body text). Raises HttpError on connection problems."""
    req = urllib.request.Request(url, headers=_headers(api_key), method="GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise HttpError(f"GET {url}: {getattr(e, 'reason', e)}") from e


def http_post_json(url, payload, timeout=600.0, api_key=None):
    """POST JSON -> parsed JSON. Raises HttpError with status and body excerpt when not 200."""
    data = json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers=_headers(api_key), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        raise HttpError(f"POST {url}: HTTP {e.code}: {e.read().decode('utf-8', 'replace')[:300]}") from e
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise HttpError(f"POST {url}: {getattr(e, 'reason', e)}") from e
    try:
        return json.loads(body)
    except ValueError as e:
        raise HttpError(f"POST {url}: response is not JSON: {body[:200]!r}") from e


def stream_completion(url, payload, timeout=600.0, api_key=None, clock=time.perf_counter):
    """POST a streaming completion; returns {ttft_s, e2e_s, output_tokens, text, chunk_times}.

    Output tokens are taken from the final usage block (``stream_options.include_usage``) when the server
    sends it, else counted as non-empty text chunks.
    """
    body = dict(payload, stream=True, stream_options={"include_usage": True})
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=_headers(api_key), method="POST")
    start = clock()
    ttft, chunks, text, usage_tokens = None, [], [], None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except ValueError:
                    continue
                if obj.get("usage") and obj["usage"].get("completion_tokens") is not None:
                    usage_tokens = int(obj["usage"]["completion_tokens"])
                for ch in obj.get("choices") or []:
                    piece = ch.get("text")
                    if piece is None:
                        piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        now = clock()
                        if ttft is None:
                            ttft = now - start
                        chunks.append(now)
                        text.append(piece)
    except urllib.error.HTTPError as e:
        raise HttpError(f"POST {url} (stream): HTTP {e.code}: {e.read().decode('utf-8', 'replace')[:300]}") from e
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise HttpError(f"POST {url} (stream): {getattr(e, 'reason', e)}") from e
    end = clock()
    if ttft is None:
        raise HttpError(f"POST {url} (stream): no token received")
    return {"ttft_s": ttft, "e2e_s": end - start, "output_tokens": usage_tokens or len(chunks),
            "text": "".join(text)}


# -------------------------------------------------------------------------------------------- Prometheus text
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text):
    """Prometheus text exposition -> list of (name, {labels}, float value)."""
    out = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        m = _SAMPLE.match(stripped)
        if not m:
            continue
        try:
            val = float(m.group(4))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        out.append((m.group(1), labels, val))
    return out


def metric_sum(samples, name, /, **label_filter):
    """Sum of samples named ``name`` whose labels match ``label_filter``; None if no such sample. (Positional-only:
    a label may itself be called ``name`` or ``samples``.)"""
    vals = [v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in label_filter.items())]
    return sum(vals) if vals else None


def metric_names(samples, pattern):
    rx = re.compile(pattern)
    return sorted({n for n, _labels, _value in samples if rx.search(n)})


# ---------------------------------------------------------------------------------------------- prompts
_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango uniform victor whiskey xray yankee zulu river stone cloud light north "
          "south green amber copper silver garden window market valley harbor signal").split()


def word_prompt(n_words, seed):
    """n_words random words (about 1.0-1.3 tokens each), reproducible from seed."""
    rng = random.Random(seed)  # noqa: S311 - reproducible filler text, not crypto
    return " ".join(rng.choice(_WORDS) for _word in range(max(1, n_words)))


class PromptMaker:
    """Builds prompts of about N tokens, calibrated with the server's /tokenize when available."""

    def __init__(self, tokenize_url=None, model=None, timeout=30.0, api_key=None):
        self.tokenize_url, self.model, self.timeout, self.api_key = tokenize_url, model, timeout, api_key
        self.tokens_per_word = None

    def count(self, prompt):
        if not self.tokenize_url:
            return None
        try:
            r = http_post_json(self.tokenize_url, {"model": self.model, "prompt": prompt},
                               timeout=self.timeout, api_key=self.api_key)
        except HttpError:
            return None
        return r.get("count") if isinstance(r.get("count"), int) else len(r.get("tokens") or [])

    def make(self, n_tokens, seed):
        if self.tokens_per_word is None:
            probe = word_prompt(200, 12345)
            c = self.count(probe)
            self.tokens_per_word = (c / 200.0) if c else 1.3
        n_words = max(1, int(n_tokens / self.tokens_per_word))
        prompt = word_prompt(n_words, seed)
        c = self.count(prompt)
        if c and c > n_tokens:  # trim to stay inside the model window
            prompt = word_prompt(max(1, int(n_words * n_tokens / c) - 1), seed)
            c = self.count(prompt)
        return prompt, c


# ---------------------------------------------------------------------------------------------- steps
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


def kv_metrics(samples, names):
    """The decode-side KV counters the check relies on, by configured metric names."""
    src = names["by_source"]
    return {
        "kv_transfer_tokens": metric_sum(samples, src, source=names["source_kv"]),
        "local_compute_tokens": metric_sum(samples, src, source=names["source_local"]),
        "nixl_transfers": metric_sum(samples, names["xfer_count"]),
        # Optional: failed transfers (absent until the first failure on some versions; None = not configured).
        "nixl_failed": metric_sum(samples, names["failed_count"]) if names.get("failed_count") else None,
    }


def _delta(after, before):
    if after is None or before is None:
        return None
    return after - before


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
    after = scrape_all()
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
        if frac is None or frac < float(k["min_transfer_fraction"]):
            errors.append(f"decode computed the prompt itself: kv_transfer {tot['kv_transfer_tokens']:.0f} vs "
                          f"local_compute {tot['local_compute_tokens']:.0f} tokens (transferred fraction {frac}, "
                          f"need >= {k['min_transfer_fraction']})")
    return {"ok": not errors, "direct_instance": direct["name"], "cases": cases, "decode_deltas": per_decode,
            "totals": tot, "transferred_fraction": frac, "errors": errors}


def percentile(values, p):
    """Nearest-rank percentile (the smallest value with at least p % of the values <= it); None if empty."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100.0 * len(s)) - 1))]


def summarize_bench(records, duration_s, ttft_slo_ms, tpot_slo_ms):
    """vllm bench serve's definitions: TTFT; TPOT = (e2e - ttft) / (output_tokens - 1); goodput = req/s meeting both."""
    ok = [r for r in records if "error" not in r]
    ttfts = [r["ttft_s"] * 1000 for r in ok]
    tpots = [(r["e2e_s"] - r["ttft_s"]) * 1000 / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    good = [r for r in ok if r["ttft_s"] * 1000 <= ttft_slo_ms and
            (r["output_tokens"] <= 1 or (r["e2e_s"] - r["ttft_s"]) * 1000 / (r["output_tokens"] - 1) <= tpot_slo_ms)]

    out_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": round(duration_s, 3),
        "mean_ttft_ms": round(statistics.fmean(ttfts), 3) if ttfts else None,
        "median_ttft_ms": round(statistics.median(ttfts), 3) if ttfts else None,
        "p99_ttft_ms": round(percentile(ttfts, 99), 3) if ttfts else None,
        "mean_tpot_ms": round(statistics.fmean(tpots), 3) if tpots else None,
        "median_tpot_ms": round(statistics.median(tpots), 3) if tpots else None,
        "p99_tpot_ms": round(percentile(tpots, 99), 3) if tpots else None,
        "output_throughput_tok_s": round(out_tokens / duration_s, 3) if duration_s > 0 else None,
        "request_throughput_req_s": round(len(ok) / duration_s, 4) if duration_s > 0 else None,
        "goodput_req_s": round(len(good) / duration_s, 4) if duration_s > 0 else None,
        "good_requests": len(good),
    }


def run_bench(url, model, prompts_list, output_len, concurrency, *, api_key=None, timeout=600.0):
    """Closed-loop benchmark: ``concurrency`` workers through the list; returns (records, duration_s)."""
    records = [None] * len(prompts_list)
    lock = threading.Lock()
    nxt = [0]

    def worker():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(prompts_list):
                return
            payload = {"model": model, "prompt": prompts_list[i], "max_tokens": output_len, "temperature": 0.0,
                       "ignore_eos": True, "min_tokens": output_len}
            try:
                records[i] = stream_completion(url + "/v1/completions", payload, timeout=timeout, api_key=api_key)
                records[i].pop("text", None)
            except HttpError as e:
                records[i] = {"error": str(e)}

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _worker in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - t0


def step_sla(cfg, prompts):
    s = cfg["sla"]
    n = int(s["num_prompts"])
    plist = [prompts.make(int(s["input_len"]), 5000 + i)[0] for i in range(n)]
    records, dur = run_bench(cfg["router_url"], cfg["model"], plist, int(s["output_len"]), int(s["concurrency"]),
                             api_key=cfg.get("api_key"), timeout=cfg.get("request_timeout_s", 600))
    ttft_slo_ms, tpot_slo_ms = float(s["ttft_mean_s"]) * 1000, float(s["tpot_mean_ms"])
    summ = summarize_bench(records, dur, ttft_slo_ms, tpot_slo_ms)
    verdicts = {
        "ttft": None if summ["mean_ttft_ms"] is None else summ["mean_ttft_ms"] <= ttft_slo_ms,
        "tpot": None if summ["mean_tpot_ms"] is None else summ["mean_tpot_ms"] <= tpot_slo_ms,
    }
    met = verdicts["ttft"] is True and verdicts["tpot"] is True and summ["failed"] == 0
    errors = [r["error"] for r in records if "error" in r][:5]
    misses = []
    if verdicts["ttft"] is not True:
        misses.append(f"mean TTFT {summ['mean_ttft_ms']} ms > SLA {ttft_slo_ms:.0f} ms")
    if verdicts["tpot"] is not True:
        misses.append(f"mean TPOT {summ['mean_tpot_ms']} ms > SLA {tpot_slo_ms} ms")
    if summ["failed"]:
        misses.append(f"{summ['failed']} request(s) failed: {errors}")
    enforce = bool(s.get("enforce", True))
    return {"ok": met or not enforce, "verdict": "MET" if met else "MISS", "enforced": enforce,
            "goodput_arg": f"ttft:{ttft_slo_ms:.0f} tpot:{tpot_slo_ms:g}",
            "params": {"input_len": int(s["input_len"]), "output_len": int(s["output_len"]),
                       "concurrency": int(s["concurrency"]), "num_prompts": n, "dataset": "random"},
            "sla": {"ttft_mean_ms": ttft_slo_ms, "tpot_mean_ms": tpot_slo_ms}, "result": summ,
            "errors": misses if (enforce and not met) else [], "misses": misses}


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


# ---------------------------------------------------------------------------------------------- driver + report
def run_all(cfg, steps=STEPS, sleep=time.sleep):
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "router_url": cfg["router_url"],
              "model": cfg["model"], "inventory": cfg.get("inventory"), "steps": {}}
    direct = next((i for i in cfg["instances"] if i["name"] == cfg.get("kv_check", {}).get("direct_instance")),
                  cfg["instances"][0])
    prompts = PromptMaker(direct["url"] + "/tokenize", cfg["model"], api_key=key_for(cfg, direct["url"]))
    for step in steps:
        if step not in STEPS:
            raise ValueError(f"unknown step '{step}' (known: {', '.join(STEPS)})")
        if step not in cfg.get("steps", STEPS):
            report["steps"][step] = {"ok": True, "skipped": True}
            continue
        t0 = time.perf_counter()
        try:
            if step == "readiness":
                res = step_readiness(cfg, sleep)
            elif step == "prometheus":
                res = step_prometheus(cfg)
            elif step == "accuracy":
                res = {"ok": False, "errors": [
                    "accuracy: run by roles/pd_verify with lm-evaluation-harness on the control node, not by this "
                    "script; leave it out of the config's steps and merge its result with --merge"]}
            else:
                res = {"warmup": step_warmup, "kv_transfer": step_kv_transfer, "sla": step_sla}[step](cfg, prompts)
        except (HttpError, ValueError, KeyError, OSError) as e:
            res = {"ok": False, "errors": [f"{step}: {type(e).__name__}: {e}"]}
        res["seconds"] = round(time.perf_counter() - t0, 3)
        report["steps"][step] = res
        if step == "readiness" and not res["ok"]:
            for later in steps[steps.index(step) + 1:]:
                report["steps"][later] = {"ok": False, "skipped": True, "not_run": "readiness failed"}
            break
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report["ok"] = all(s["ok"] for s in report["steps"].values())
    report["failures"] = [e for s in report["steps"].values() for e in s.get("errors", [])]
    return report


def render_markdown(rep):
    st = rep["steps"]
    lines = [f"# P/D verify: {rep.get('inventory') or ''} — {'PASS' if rep['ok'] else 'FAIL'}", "",
             f"Router {rep['router_url']}, model `{rep['model']}`, {rep['started']} → {rep['finished']}", "",
             "| step | result | seconds |", "|---|---|---|"]
    for name, s in st.items():
        res = ("not run" if s.get("not_run") else "skipped") if s.get("skipped") else ("ok" if s["ok"] else "FAIL")
        if name == "sla" and "verdict" in s:
            res += f" (SLA {s['verdict']}{', enforced' if s['enforced'] else ', not enforced'})"
        lines.append(f"| {name} | {res} | {s.get('seconds', '')} |")
    if "readiness" in st and st["readiness"].get("targets"):
        lines += ["", "## Readiness", ""] + [
            f"- {t['name']} {t['url']}: {'ready' if t['ok'] else t.get('error')}" for t in st["readiness"]["targets"]]
    if st.get("warmup", {}).get("instances"):
        lines += ["", "## Warm-up of each instance alone (request features, seconds)", ""]
        for i in st["warmup"]["instances"]:
            feats = i.get("features") or {}
            done = ", ".join(f"{f} {v.get('seconds')}" for f, v in feats.items() if v.get("status") == 200)
            skipped = ", ".join(f for f, v in feats.items() if v.get("status") == "skipped")
            lines.append(f"- {i['name']} ({i.get('pool')}): {'ok' if i['ok'] else 'FAIL'}; {done or 'none warmed'}"
                         + (f"; skipped (flags): {skipped}" if skipped else ""))
    if st.get("warmup", {}).get("failed_then_passed"):
        lines += ["", "## Warm-up requests that failed once and passed on retry", ""] + [
            f"- {e}" for e in st["warmup"]["failed_then_passed"]]
    kv = st.get("kv_transfer", {})
    if kv.get("cases") is not None:
        ident = sum(1 for c in kv["cases"] if c.get("identical"))
        lines += ["", "## KV transfer", "",
                  f"- identical token ids P/D vs colocated ({kv.get('direct_instance')}): {ident}/{len(kv['cases'])}",
                  f"- decode deltas: {json.dumps(kv.get('totals'))}; transferred fraction "
                  f"{kv.get('transferred_fraction')}"]
    acc = st.get("accuracy", {})
    if "score" in acc:
        lines += ["", "## Accuracy (lm-evaluation-harness)", "",
                  f"- task `{acc.get('task')}`, {acc.get('metric')} = **{acc['score']}** on {acc.get('n')} of "
                  f"{acc.get('n_available')} items (min {acc['min_score']}), lm_eval {acc.get('lm_eval_version')}, "
                  f"{acc.get('seconds')} s"]
        lines += [f"- wrong: item {f.get('id')}: {json.dumps(f.get('output'))}, "
                  f"expected {json.dumps(f.get('expected'))}" for f in (acc.get("failed_items") or [])[:5]]
        refs = acc.get("reference_scores") or {}
        if refs:
            lines.append("- the recipe's reference scores (full benchmarks, not run by verify: docs/verify.md): "
                         + ", ".join(f"{k} {v}" for k, v in refs.items()))
    sla = st.get("sla", {})
    if "result" in sla:
        r = sla["result"]
        lines += ["", "## SLA", "", f"- params {json.dumps(sla['params'])}, goodput {sla['goodput_arg']}",
                  f"- mean TTFT {r['mean_ttft_ms']} ms (SLA {sla['sla']['ttft_mean_ms']:.0f}), mean TPOT "
                  f"{r['mean_tpot_ms']} ms (SLA {sla['sla']['tpot_mean_ms']}), p99 TTFT {r['p99_ttft_ms']} ms, "
                  f"p99 TPOT {r['p99_tpot_ms']} ms",
                  f"- {r['completed']} completed, {r['failed']} failed, {r['output_throughput_tok_s']} tok/s, "
                  f"goodput {r['goodput_req_s']} req/s → **{sla['verdict']}**"]
        lines += [f"- miss: {m}" for m in sla.get("misses", [])]
    pr = st.get("prometheus", {})
    if "values" in pr:
        lines += ["", "## Prometheus (per pool)", ""] + [f"- {k}: {json.dumps(v)}" for k, v in pr["values"].items()]
        lines += [f"- warning: {w}" for w in pr.get("warnings", [])]
    if rep["failures"]:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in rep["failures"]]
    return "\n".join(lines) + "\n"


def merge_steps(report, step_results):
    """The report with steps run elsewhere (``{name: result}``, e.g. accuracy from the control node) put in their
    place, in STEPS order; ok and failures recomputed."""
    for name, res in step_results.items():
        if name not in STEPS:
            raise ValueError(f"--step-result {name}: unknown step (known: {', '.join(STEPS)})")
        if not isinstance(res, dict) or not isinstance(res.get("ok"), bool):
            raise ValueError(f"--step-result {name}: not a step result (a JSON object with a boolean 'ok')")
    steps = dict(report.get("steps") or {})
    steps.update(step_results)
    ordered = {n: steps[n] for n in STEPS if n in steps}
    ordered.update({n: s for n, s in steps.items() if n not in ordered})
    merged = dict(report, steps=ordered)
    if step_results:
        merged["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    merged["ok"] = all(s["ok"] for s in ordered.values())
    merged["failures"] = [e for s in ordered.values() for e in s.get("errors", [])]
    return merged


def _read_json(path, what):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:
        raise ValueError(f"{what} {path} is not JSON: {e}") from e


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="JSON config (written by roles/pd_verify): run the checks")
    src.add_argument("--merge", metavar="REPORT", help="a JSON report of this script: merge --step-result into it")
    ap.add_argument("--step-result", action="append", default=[], metavar="STEP=FILE",
                    help="with --merge: a step's result (JSON) run elsewhere, e.g. accuracy=accuracy.json")
    ap.add_argument("--json", required=True, help="where to write the JSON report")
    ap.add_argument("--markdown", help="where to write the Markdown report")
    ap.add_argument("--steps", help="comma-separated subset of " + ",".join(STEPS))
    a = ap.parse_args(argv)
    try:
        if a.merge:
            results = {}
            for spec in a.step_result:
                name, sep, path = spec.partition("=")
                if not sep or not path:
                    raise ValueError(f"--step-result {spec!r}: give STEP=FILE, e.g. accuracy=accuracy.json")
                results[name] = _read_json(path, f"--step-result {name}")
            rep = merge_steps(_read_json(a.merge, "--merge report"), results)
        else:
            with open(a.config, encoding="utf-8") as f:
                cfg = json.load(f)
            steps = tuple(a.steps.split(",")) if a.steps else STEPS
            rep = run_all(cfg, steps)
    except (OSError, ValueError, KeyError) as e:
        print(f"pd_verify: bad {'input' if a.merge else 'config'}: {e}", file=sys.stderr)
        return 2
    with open(a.json, "w", encoding="utf-8") as f:
        json.dump(rep, f, indent=2, sort_keys=True)
    if a.markdown:
        with open(a.markdown, "w", encoding="utf-8") as f:
            f.write(render_markdown(rep))
    print(json.dumps({"ok": rep["ok"], "failures": rep["failures"]}))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
