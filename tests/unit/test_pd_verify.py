"""roles/pd_verify/files/pd_verify (the package) against stdlib fake vLLM servers (real HTTP on 127.0.0.1).

The fakes speak the parts of vLLM's API the script uses (/health, /v1/models, /v1/completions with
return_token_ids and SSE streaming, /v1/chat/completions, /tokenize, /metrics) and Prometheus' /api/v1/query.
A fake "router" answers like the P/D path: it bumps the decode instance's KV counters (kv_transfer + NIXL
count) — or, when told to, recomputes (local_compute only) or corrupts a token — so every check can fail.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import yaml
from ansible_collections.b300.pd.roles.pd_verify.files import pd_verify as pv
from ansible_collections.b300.pd.roles.pd_verify.files.pd_verify.client import HttpError
from ansible_collections.b300.pd.roles.pd_verify.files.pd_verify.metrics import metric_sum, parse_prometheus
from ansible_collections.b300.pd.roles.pd_verify.files.pd_verify.sla import summarize_bench
from ansible_collections.b300.pd.roles.pd_verify.files.pd_verify.steps import _warm, context_lengths, step_prometheus

ROOT = Path(__file__).resolve().parents[2]

MODEL = "tiny-pd"


def gen_ids(prompt, n):
    base = sum(ord(c) for c in prompt)
    return [(base + 7 * i) % 997 for i in range(n)]


class DecodeCounters:
    """One decode instance's KV counters as its /metrics shows them."""

    def __init__(self):
        self.kv_transfer = 0.0
        self.local_compute = 0.0
        self.nixl = 0
        self.nixl_failed = None  # None: counter not exposed yet


class State:
    def __init__(self, decodes=("decode-0",)):
        self.lock = threading.Lock()
        self.kv = {d: DecodeCounters() for d in decodes}
        self.starved = set()  # decode instances the router never picks (a router that lost them)
        self.picks = 0
        self.fail_transfers = False
        self.pd_corrupt_at = None  # position where the P/D path returns a different token
        self.recompute = False  # P/D path computes locally instead of transferring
        self.expose_kv_metrics = True
        self.models = {"prefill-0": [MODEL], "router": [MODEL], **{d: [MODEL] for d in decodes}}
        self.health = {"prefill-0": 200, "router": 200, **{d: 200 for d in decodes}}
        self.router_igw = False  # router answers /v1/models as vllm-router in IGW mode does
        self.answers = {}  # prompt -> text the model answers
        self.ttft_s = 0.0
        self.token_s = 0.0
        self.requests = []

    def pick_decode(self) -> DecodeCounters:
        """The router's round robin over the decode instances it has."""
        live = [d for d in self.kv if d not in self.starved]
        self.picks += 1
        return self.kv[live[(self.picks - 1) % len(live)]]


def make_handler(name, st):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, body, ctype="application/json"):
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            path = urlparse(self.path).path
            if path == "/health":
                return self._send(st.health[name], {})
            if path == "/v1/models":
                if name == "router" and st.router_igw:  # vllm-router --enable-igw's own shape
                    return self._send(200, {"models": st.models[name]})
                return self._send(200, {"object": "list", "data": [{"id": m} for m in st.models[name]]})
            if path == "/metrics" and name in st.kv:
                kv = st.kv[name]
                lines = ["# HELP vllm:num_requests_running x", f'vllm:num_requests_running{{model_name="{MODEL}"}} 0']
                if st.expose_kv_metrics:
                    lines += [
                        "# TYPE vllm:prompt_tokens_by_source_total counter",
                        f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="{MODEL}",'
                        f'source="external_kv_transfer"}} {kv.kv_transfer}',
                        f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="{MODEL}",source="local_compute"}} '
                        f"{kv.local_compute}",
                        f'vllm:prompt_tokens_by_source_total{{engine="0",model_name="{MODEL}",'
                        'source="local_cache_hit"} 0.0',
                        f'vllm:nixl_xfer_time_seconds_count{{engine="0",model_name="{MODEL}"}} {kv.nixl}',
                        f'vllm:nixl_xfer_time_seconds_sum{{engine="0",model_name="{MODEL}"}} {kv.nixl * 0.01}',
                    ]
                    if kv.nixl_failed is not None:
                        lines.append(f'vllm:nixl_num_failed_transfers_total{{engine="0",model_name="{MODEL}"}} '
                                     f"{kv.nixl_failed}")
                return self._send(200, "\n".join(lines) + "\n", "text/plain")
            return self._send(404, {"error": "not found"})

        def do_POST(self):
            path = urlparse(self.path).path
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            st.requests.append((name, path, body))
            if path == "/tokenize":
                toks = [len(w) for w in body["prompt"].split()]
                return self._send(200, {"count": len(toks), "tokens": toks, "max_model_len": 4096})
            if path == "/v1/chat/completions":
                q = body["messages"][-1]["content"]
                msg = {"role": "assistant", "content": st.answers.get(q, "?")}
                return self._send(200, {"choices": [{"message": msg}]})
            if path != "/v1/completions":
                return self._send(404, {"error": "no route"})
            prompt, n = body["prompt"], int(body["max_tokens"])
            ids = gen_ids(prompt, n)
            if name == "router":
                ntok = len(prompt.split())
                with st.lock:
                    kv = st.pick_decode()
                    if st.recompute:
                        kv.local_compute += ntok
                    else:
                        kv.kv_transfer += ntok - 1
                        kv.local_compute += 1
                        kv.nixl += 1
                        if st.fail_transfers:
                            kv.nixl_failed = (kv.nixl_failed or 0) + 1
                if st.pd_corrupt_at is not None and st.pd_corrupt_at < len(ids):
                    ids[st.pd_corrupt_at] += 1
            text = st.answers.get(prompt, " ".join(f"w{i}" for i in ids))
            if body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                time.sleep(st.ttft_s)
                for k, i in enumerate(ids):
                    if k:
                        time.sleep(st.token_s)
                    self.wfile.write(f'data: {json.dumps({"choices": [{"text": f" w{i}"}]})}\n\n'.encode())
                    self.wfile.flush()
                usage = {"choices": [], "usage": {"completion_tokens": len(ids), "prompt_tokens": len(prompt.split())}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
                return None
            return self._send(200, {"choices": [{"text": text, "token_ids": ids, "finish_reason": "length"}],
                                    "usage": {"completion_tokens": n}})

    return H


class Cluster:
    def __init__(self, decodes=("decode-0",)):
        self.st = State(decodes)
        self.decodes = decodes
        self.servers = {}
        for name in ("prefill-0", *decodes, "router"):
            srv = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(name, self.st))
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            self.servers[name] = srv

    def url(self, name):
        return f"http://127.0.0.1:{self.servers[name].server_address[1]}"

    def config(self, **over):
        cfg = {
            "inventory": "test", "router_url": self.url("router"), "model": MODEL, "max_model_len": 4096,
            # accuracy runs on the control node (lm_eval, tests/unit/test_pd_verify_lmeval.py), not in the script.
            "request_timeout_s": 30, "steps": [s for s in pv.STEPS if s != "accuracy"],
            "instances": [{"name": "prefill-0", "pool": "prefill", "host": "h1", "url": self.url("prefill-0")},
                          *({"name": d, "pool": "decode", "host": "h2", "url": self.url(d)} for d in self.decodes)],
            "readiness": {"retries": 2, "delay_s": 0.01, "timeout_s": 2},
            "warmup": {"concurrency": [1, 2], "output_tokens": 4, "context_min_tokens": 32,
                       "context_max_tokens": 256, "context_points": 3},
            "kv_check": {"prompts": 2, "prompt_tokens": 64, "max_tokens": 8, "direct_instance": "prefill-0",
                         "min_transfer_fraction": 0.8,
                         "metrics": {"by_source": "vllm:prompt_tokens_by_source_total",
                                     "source_kv": "external_kv_transfer", "source_local": "local_compute",
                                     "xfer_count": "vllm:nixl_xfer_time_seconds_count",
                                     "failed_count": "vllm:nixl_num_failed_transfers_total"}},
            "sla": {"input_len": 32, "output_len": 5, "concurrency": 2, "num_prompts": 4, "ttft_mean_s": 2.5,
                    "tpot_mean_ms": 20.0, "enforce": True},
            "prometheus": {"url": "http://127.0.0.1:9", "required": False, "queries": {}},
        }
        for k, v in over.items():
            if isinstance(v, dict) and isinstance(cfg.get(k), dict):
                cfg[k].update(v)
            else:
                cfg[k] = v
        return cfg

    def close(self):
        for s in self.servers.values():
            s.shutdown()
            s.server_close()


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.close()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_healthy_pd_passes_readiness_warmup_and_kv_check(cluster):
    rep = pv.run_all(cluster.config(), steps=("readiness", "warmup", "kv_transfer"))
    assert rep["ok"], rep["failures"]
    kv = rep["steps"]["kv_transfer"]
    assert all(c["identical"] and c["basis"] == "token_ids" for c in kv["cases"])
    assert kv["totals"]["nixl_transfers"] == 2
    assert kv["transferred_fraction"] > 0.9
    # Warmup covered each concurrency level and the context range through the router.
    w = rep["steps"]["warmup"]
    assert [r["concurrency"] for r in w["runs"] if r["kind"] == "batch"] == [1, 2]
    assert w["context_lengths"] == [32, 91, 256]
    router_bodies = [b for n, p, b in cluster.st.requests if n == "router" and p == "/v1/completions"]
    assert len(router_bodies) == 1 + 2 + 3 + 2  # warmup batches, warmup contexts, kv prompts


def test_token_id_mismatch_between_pd_and_colocated_is_detected(cluster):
    cluster.st.pd_corrupt_at = 3
    rep = pv.run_all(cluster.config(), steps=("readiness", "kv_transfer"))
    assert not rep["ok"]
    kv = rep["steps"]["kv_transfer"]
    assert [c["identical"] for c in kv["cases"]] == [False, False]
    assert kv["cases"][0]["first_mismatch"] == 3
    assert any("token ids differ" in e and "position 3" in e for e in kv["errors"])


def test_recomputed_prompt_is_not_a_kv_transfer(cluster):
    cluster.st.recompute = True
    rep = pv.run_all(cluster.config(), steps=("kv_transfer",))
    errs = rep["steps"]["kv_transfer"]["errors"]
    assert not rep["ok"]
    assert any("no NIXL transfer" in e for e in errs)
    assert any("computed the prompt itself" in e for e in errs)


def test_failed_nixl_transfers_fail_the_check(cluster):
    rep = pv.run_all(cluster.config(), steps=("kv_transfer",))
    assert rep["ok"] and rep["steps"]["kv_transfer"]["totals"]["nixl_failed"] == 0
    # The failure counter appears (vLLM creates it lazily) and counts one failure per P/D request.
    cluster.st.fail_transfers = True
    rep = pv.run_all(cluster.config(), steps=("kv_transfer",))
    assert not rep["ok"]
    assert any("2 failed NIXL transfer(s)" in e for e in rep["failures"])


def test_missing_kv_metrics_are_reported_with_what_exists(cluster):
    cluster.st.expose_kv_metrics = False
    rep = pv.run_all(cluster.config(), steps=("kv_transfer",))
    assert not rep["ok"]
    assert any("decode /metrics lacks" in e and "decode-0" in e for e in rep["failures"])


@pytest.fixture
def two_decodes():
    c = Cluster(decodes=("decode-0", "decode-1"))
    yield c
    c.close()


def test_every_decode_instance_must_pull_kv_not_only_the_pool(two_decodes):
    # Round robin over both: the 2 compared prompts reach each decode instance once, no probe needed.
    rep = pv.run_all(two_decodes.config(kv_check={"decode_probes": 4}), steps=("kv_transfer",))
    kv = rep["steps"]["kv_transfer"]
    assert rep["ok"], rep["failures"]
    assert {d: v["nixl_transfers"] for d, v in kv["decode_deltas"].items()} == {"decode-0": 1, "decode-1": 1}
    assert kv["decode_probes"] == {"sent": 0, "limit": 8}


def test_probes_reach_a_decode_instance_the_compared_prompts_missed(two_decodes):
    # One compared prompt reaches decode-0 only; one probe through the router then reaches decode-1.
    rep = pv.run_all(two_decodes.config(kv_check={"prompts": 1, "decode_probes": 4}), steps=("kv_transfer",))
    kv = rep["steps"]["kv_transfer"]
    assert rep["ok"], rep["failures"]
    assert kv["decode_probes"]["sent"] == 1
    assert kv["decode_deltas"]["decode-1"]["nixl_transfers"] == 1


def test_a_decode_instance_the_routers_never_pick_fails_the_check_by_name(two_decodes):
    # The pool's totals look healthy (decode-0 pulls every prompt's KV): only the per-instance check sees decode-1.
    two_decodes.st.starved = {"decode-1"}
    rep = pv.run_all(two_decodes.config(kv_check={"decode_probes": 3}), steps=("kv_transfer",))
    kv = rep["steps"]["kv_transfer"]
    assert not rep["ok"]
    assert kv["transferred_fraction"] > 0.9 and kv["decode_probes"] == {"sent": 6, "limit": 6}
    assert rep["failures"] == [
        "decode instance decode-1 received no KV over NIXL in 8 P/D requests through the router (its transfer count "
        "did not move, the others' did): the routers do not send it requests, or its NIXL handshake with the prefill "
        "pool fails"]


def test_one_decode_instance_sends_no_probe(cluster):
    rep = pv.run_all(cluster.config(kv_check={"decode_probes": 4}), steps=("kv_transfer",))
    assert rep["ok"] and rep["steps"]["kv_transfer"]["decode_probes"] == {"sent": 0, "limit": 0}


def test_instance_down_is_named_and_later_steps_do_not_run(cluster):
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = cluster.config()
    cfg["instances"].append({"name": "prefill-1", "pool": "prefill", "host": "h1", "url": dead})
    rep = pv.run_all(cfg)
    assert not rep["ok"]
    errs = rep["steps"]["readiness"]["errors"]
    assert len(errs) == 1 and errs[0].startswith(f"prefill-1 ({dead}) not ready after 2 attempt(s)")
    assert rep["steps"]["sla"]["skipped"] and not rep["steps"]["sla"]["ok"]
    assert rep["failures"] == errs  # the cause once, not one line per step that did not run
    assert "| sla | not run |" in pv.render_markdown(rep)
    assert not any(p == "/v1/completions" for _name, p, _body in cluster.st.requests)


def test_wrong_model_and_unhealthy_router_are_named(cluster):
    cluster.st.models["decode-0"] = ["other-model"]
    cluster.st.health["router"] = 503
    rep = pv.run_all(cluster.config(), steps=("readiness",))
    errs = " | ".join(rep["steps"]["readiness"]["errors"])
    assert "decode-0" in errs and "not the served model 'tiny-pd'" in errs
    assert "router" in errs and "HTTP 503" in errs
    assert "prefill-0" not in errs


@pytest.mark.parametrize("served", [True, False])
def test_readiness_reads_the_igw_routers_model_list(cluster, served):
    cluster.st.router_igw = True
    if not served:
        cluster.st.models["router"] = ["other-model"]
    rep = pv.run_all(cluster.config(readiness={"retries": 1, "delay_s": 0}), steps=("readiness",))
    assert rep["ok"] is served, rep["failures"]
    if not served:
        assert "router" in " | ".join(rep["steps"]["readiness"]["errors"])


def test_readiness_retries_until_ready(cluster):
    cluster.st.health["decode-0"] = 503
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        cluster.st.health["decode-0"] = 200

    cfg = cluster.config(readiness={"retries": 3, "delay_s": 0.5})
    rep = pv.run_all(cfg, steps=("readiness",), sleep=sleep)
    assert rep["ok"], rep["failures"]
    dec = next(t for t in rep["steps"]["readiness"]["targets"] if t["name"] == "decode-0")
    assert dec["attempts"] == 2 and sleeps == [0.5]


def test_summarize_bench_uses_vllm_bench_definitions():
    recs = [{"ttft_s": 0.1, "e2e_s": 1.1, "output_tokens": 11},  # tpot 100 ms
            {"ttft_s": 0.3, "e2e_s": 0.8, "output_tokens": 11},  # tpot 50 ms
            {"error": "boom"}]
    s = summarize_bench(recs, duration_s=2.0, ttft_slo_ms=200, tpot_slo_ms=60)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_tpot_ms"] == pytest.approx(75.0)
    assert s["good_requests"] == 0  # first misses TPOT, second misses TTFT
    assert s["output_throughput_tok_s"] == pytest.approx(11.0)
    s = summarize_bench(recs[:2], duration_s=2.0, ttft_slo_ms=300, tpot_slo_ms=100)
    assert s["good_requests"] == 2 and s["goodput_req_s"] == pytest.approx(1.0)


def test_sla_met_miss_and_enforcement(cluster):
    cluster.st.ttft_s, cluster.st.token_s = 0.05, 0.01
    sla = pv.run_all(cluster.config(), steps=("sla",))["steps"]["sla"]
    assert sla["verdict"] == "MET" and sla["ok"], sla
    assert 40 <= sla["result"]["mean_ttft_ms"] < 1000
    assert 8 <= sla["result"]["mean_tpot_ms"] < 200
    assert sla["result"]["completed"] == 4 and sla["goodput_arg"] == "ttft:2500 tpot:20"
    # A TTFT SLA of 10 ms cannot be met by a 50 ms first token: MISS, enforced -> fail.
    sla = pv.run_all(cluster.config(sla={"ttft_mean_s": 0.01}), steps=("sla",))["steps"]["sla"]
    assert sla["verdict"] == "MISS" and not sla["ok"] and "mean TTFT" in sla["errors"][0]
    # Same MISS, not enforced (local inventory): reported, not failed.
    rep = pv.run_all(cluster.config(sla={"ttft_mean_s": 0.01, "enforce": False}), steps=("sla",))
    assert rep["ok"] and rep["steps"]["sla"]["verdict"] == "MISS" and rep["steps"]["sla"]["misses"]
    streamed = [b for n, p, b in cluster.st.requests if n == "router" and b.get("stream")]
    assert streamed and all(b["ignore_eos"] and b["max_tokens"] == 5 for b in streamed)


def test_parse_prometheus_real_exposition():
    text = (
        "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.\n"
        "# TYPE vllm:prompt_tokens_by_source_total counter\n"
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-pd",source="external_kv_transfer"} 496.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-pd",source="local_compute"} 3.0\n'
        'vllm:nixl_xfer_time_seconds_bucket{engine="0",le="0.001",model_name="tiny-pd"} 2.0\n'
        'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny-pd"} 3.0\n'
        'weird{label="a \\"quoted\\" b"} 1e3\n'
    )
    s = parse_prometheus(text)
    assert metric_sum(s, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 496.0
    assert metric_sum(s, "vllm:prompt_tokens_by_source_total") == 499.0
    assert metric_sum(s, "vllm:nixl_xfer_time_seconds_count") == 3.0
    assert metric_sum(s, "nope") is None
    assert metric_sum(s, "weird") == 1000.0


def test_context_lengths_clip_to_window_and_refuse_impossible():
    cfg = {"max_model_len": 4096, "warmup": {"output_tokens": 16, "context_min_tokens": 256,
                                             "context_max_tokens": 262144, "context_points": 3}}
    lengths = context_lengths(cfg)
    assert lengths[0] == 256 and lengths[-1] == 4096 - 16 - 8 and len(lengths) == 3
    cfg["max_model_len"] = 16
    with pytest.raises(ValueError, match="does not fit the model window 16"):
        context_lengths(cfg)


def test_prometheus_per_pool_values():
    class P(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            q = parse_qs(urlparse(self.path).query)["query"][0]
            res = [] if "empty" in q else [{"metric": {"pool": "prefill"}, "value": [0, "0.25"]},
                                           {"metric": {"pool": "decode"}, "value": [0, "NaN"]}]
            data = json.dumps({"status": "success", "data": {"resultType": "vector", "result": res}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), P)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        res = step_prometheus({"prometheus": {"url": url, "required": True,
                                              "queries": {"ttft": "ttft_q", "tpot": "empty_q"}}})
        assert res["values"]["ttft"] == {"prefill": 0.25, "decode": None}
        assert not res["ok"] and "tpot: no series" in res["errors"][0]
        res = step_prometheus({"prometheus": {"url": url, "required": False, "queries": {"tpot": "empty_q"}}})
        assert res["ok"] and res["warnings"]
    finally:
        srv.shutdown()
        srv.server_close()


def test_cli_writes_reports_and_exit_code(cluster, tmp_path):
    cfg = cluster.config(steps=["readiness", "kv_transfer"])
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    rc = pv.main(["--config", str(tmp_path / "c.json"), "--json", str(tmp_path / "r.json"),
                  "--markdown", str(tmp_path / "r.md")])
    rep = json.loads((tmp_path / "r.json").read_text())
    md = (tmp_path / "r.md").read_text()
    assert rc == 0 and rep["ok"] and rep["steps"]["sla"]["skipped"]
    assert "— PASS" in md and "identical token ids P/D vs colocated (prefill-0): 2/2" in md
    cluster.st.pd_corrupt_at = 0
    rc = pv.main(["--config", str(tmp_path / "c.json"), "--json", str(tmp_path / "r.json"),
                  "--markdown", str(tmp_path / "r.md")])
    assert rc == 1 and "— FAIL" in (tmp_path / "r.md").read_text()
    assert pv.main(["--config", str(tmp_path / "missing.json"), "--json", str(tmp_path / "x.json")]) == 2


def test_warmup_request_is_retried_once_and_reported():
    calls = []

    def flaky(fails):
        def fn():
            calls.append(1)
            if len(calls) <= fails:
                raise HttpError("POST /v1/completions: HTTP 500 (handshake_setup_failed)")
            return {}
        return fn

    # first contact fails (NIXL handshake timeout), the retry passes: reported, not a failure
    first, final = _warm(flaky(1), sleep=lambda _s: None)
    assert "handshake_setup_failed" in first and final is None
    calls.clear()
    first, final = _warm(flaky(2), sleep=lambda _s: None)
    assert first and final  # failed twice: the step fails
    calls.clear()
    assert _warm(flaky(0), sleep=lambda _s: None) == (None, None) and len(calls) == 1


def test_warmup_step_reports_each_instance_alone_and_fails_on_one(cluster):
    """roles/pd_verify warms every instance alone on each request feature (module pd_instance_warmup, issue #31) and
    hands the results in as warmup.instances: shown per instance in the report, a failed one fails the step."""
    feats = {"logprobs": {"status": 200, "seconds": 0.05, "skipped_reason": None, "requests": []},
             "tools": {"status": "skipped", "seconds": 0, "skipped_reason": "no --tool-call-parser", "requests": []}}
    good = {"name": "prefill-0", "pool": "prefill", "ok": True, "error": "", "seconds": 0.05,
            "context_tokens": [32, 256], "features": feats}
    rep = pv.run_all(cluster.config(warmup={"instances": [good]}), steps=("readiness", "warmup"))
    assert rep["ok"], rep["failures"]
    inst = rep["steps"]["warmup"]["instances"]
    assert inst[0]["features"]["logprobs"] == {"status": 200, "seconds": 0.05, "skipped_reason": None}
    md = pv.render_markdown(rep)
    assert "- prefill-0 (prefill): ok; logprobs 0.05; skipped (flags): tools" in md
    bad = dict(good, name="decode-0", pool="decode", ok=False,
               error="pd_instance_warmup: the warm-up of feature 'logprobs' failed: HTTP 500")
    rep = pv.run_all(cluster.config(warmup={"instances": [good, bad]}), steps=("readiness", "warmup"))
    assert not rep["ok"]
    assert rep["failures"] == ["warmup instance decode-0: pd_instance_warmup: the warm-up of feature 'logprobs' "
                               "failed: HTTP 500"]
    # the warmup through the router still ran
    assert [r["concurrency"] for r in rep["steps"]["warmup"]["runs"] if r["kind"] == "batch"] == [1, 2]


def test_the_package_run_yml_installs_runs_with_a_bare_python(tmp_path):
    """The router host has only what run.yml copies into pd_verify_workdir (every .py of files/pd_verify, the glob of
    its loop) and runs `python3 -m pd_verify` there with the system python3, without the collection."""
    tasks = {t["name"]: t for t in yaml.safe_load((ROOT / "roles/pd_verify/tasks/run.yml").read_text())}
    assert "'/files/pd_verify/*.py'" in tasks["Install the verify package"]["loop"]
    run = tasks["Run readiness, warmup, KV-transfer, accuracy, SLA and Prometheus checks"]["ansible.builtin.command"]
    assert run["argv"][1:3] == ["-m", "pd_verify"] and run["chdir"] == "{{ pd_verify_workdir }}"
    package = tmp_path / "workdir" / "pd_verify"
    package.mkdir(parents=True)
    for src in (ROOT / "roles/pd_verify/files/pd_verify").glob("*.py"):
        shutil.copy(src, package / src.name)
    out = subprocess.run(["/usr/bin/python3", "-m", "pd_verify", "--help"], cwd=package.parent,
                         env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 0 and "--merge REPORT" in out.stdout, out
