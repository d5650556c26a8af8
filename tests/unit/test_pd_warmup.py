"""plugins/module_utils/pd_warmup.py and plugins/modules/pd_instance_warmup.py: the warm-up of one instance on every
request feature clients use (issue #31: right after a restart the first request with logprobs took 15.5 s, the next
0.02 s, and no warm-up sent logprobs). Request bodies per feature, features skipped by the instance's flags, the
validation of pd_warmup_features, and the module against a stub instance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from ansible_collections.b300.pd.plugins.module_utils import pd_warmup as w
from ansible_collections.b300.pd.tests.unit.pd_testlib import (
    ROOT,
    VLLM_VENV_PY,
    load_inventory,
    load_library,
    need_vllm_venv,
    run_module,
)

mod = load_library("pd_instance_warmup")
TOOLS = {"enable-auto-tool-choice": True, "tool-call-parser": "glm47", "reasoning-parser": "glm45"}


def by_feature(reqs):
    out = {}
    for r in reqs:
        out.setdefault(r["feature"], []).append(r)
    return out


# ------------------------------------------------------------------------------------------- request bodies
def test_every_feature_has_its_request_and_logprobs_are_sent():
    reqs = by_feature(w.warmup_requests(None, "m", [256, 3072], flags=TOOLS, max_tokens=8))
    assert list(reqs) == list(w.FEATURES)
    comp, chat = w.COMPLETIONS, w.CHAT
    assert [(r["path"], r["context_tokens"]) for r in reqs["completion"]] == [(comp, 256), (comp, 3072)]
    (lp_comp, lp_chat) = reqs["logprobs"]
    assert lp_comp["path"] == comp and lp_comp["body"]["logprobs"] == 1
    assert lp_chat["path"] == chat and lp_chat["body"]["logprobs"] is True and lp_chat["body"]["top_logprobs"] == 1
    assert reqs["prompt_logprobs"][0]["body"]["prompt_logprobs"] == 1
    n = reqs["n"][0]["body"]
    assert n["n"] == 2 and n["temperature"] > 0 and isinstance(n["seed"], int)
    assert reqs["chat"][0]["body"]["messages"][0]["role"] == "user"
    tools = reqs["tools"][0]["body"]
    assert tools["tool_choice"] == "auto" and tools["tools"][0]["function"]["name"] == "get_weather"
    assert reqs["reasoning"][0]["path"] == chat
    assert reqs["structured_output"][0]["body"]["response_format"]["type"] == "json_schema"
    assert [(r["path"], r["body"]["stream"], r["body"]["stream_options"]) for r in reqs["stream"]] == [
        (comp, True, {"include_usage": True}), (chat, True, {"include_usage": True})]
    # every other feature at the shortest context; all with the model and max_tokens
    for r in (r for f, rs in reqs.items() if f != "completion" for r in rs):
        assert r["context_tokens"] == 256, r["feature"]
    for r in (r for rs in reqs.values() for r in rs):
        assert r["body"]["model"] == "m" and r["body"]["max_tokens"] == 8
        assert not any(k in r["body"] for k in ("kv_transfer_params", "api_key")), r


def test_context_lengths_are_clipped_to_the_window_and_default_to_a_short_prompt():
    reqs = w.warmup_requests(["completion"], "m", [3072, 256, 9000], flags={"max_model_len": 4096}, max_tokens=16)
    assert [r["context_tokens"] for r in reqs] == [256, 3072, 4096 - 16 - w.WINDOW_MARGIN]
    # the explicit window wins over the flags'
    reqs = w.warmup_requests(["completion"], "m", [3072], flags={"max-model-len": 4096}, max_model_len=2048)
    assert reqs[0]["context_tokens"] == 2048 - 8 - w.WINDOW_MARGIN
    assert [r["context_tokens"] for r in w.warmup_requests(["completion", "chat"], "m")] == [w.SHORT_PROMPT_TOKENS] * 2
    with pytest.raises(w.WarmupError, match="no room"):
        w.warmup_requests(["completion"], "m", [100], max_model_len=50)
    with pytest.raises(w.WarmupError, match="context_tokens"):
        w.warmup_requests(["completion"], "m", [0])


def test_prompts_are_sized_with_the_tokenizer_and_never_longer():
    calls = []

    def count(text):  # a tokenizer of two tokens per word
        calls.append(text)
        return 2 * len(text.split())

    text, tokens = w.make_prompt(1000, 7, count)
    assert tokens <= 1000 and tokens >= 990 and count(text) == tokens
    assert w.make_prompt(1000, 7, count)[0] == text  # reproducible
    # without a tokenizer: the worst-case count, so even a byte-level tokenizer stays below the target
    text, tokens = w.make_prompt(1000, 7)
    assert tokens is None and sum(len(word) + 1 for word in text.split()) <= 1000
    reqs = w.warmup_requests(["completion"], "m", [64, 512], count=count)
    assert [r["prompt_tokens"] for r in reqs] == [64, 512]


# ------------------------------------------------------------------------------------------- skipping by flags
@pytest.mark.parametrize(("flags", "skipped"), [
    ({}, {"tools", "reasoning"}),
    ({"enable-auto-tool-choice": True}, {"tools", "reasoning"}),
    ({"tool_call_parser": "hermes"}, {"tools", "reasoning"}),
    ({"enable_auto_tool_choice": "true", "tool-call-parser": "hermes"}, {"reasoning"}),
    ({"reasoning-parser": "glm45"}, {"tools"}),
    (TOOLS, set()),
    (dict(TOOLS, **{"max-logprobs": 0}), {"logprobs", "prompt_logprobs"}),
    (dict(TOOLS, **{"skip-tokenizer-init": True}), {"chat", "tools", "reasoning", "structured_output", "stream"}),
])
def test_features_the_flags_cannot_serve_are_skipped_with_the_reason(flags, skipped):
    plan = w.warmup_plan(None, "m", [64], flags=flags)
    assert set(plan["skipped"]) == skipped
    assert {r["feature"] for r in plan["requests"]} == set(w.FEATURES) - skipped
    for feature, reason in plan["skipped"].items():
        assert reason.startswith("the instance runs"), (feature, reason)
    if "tools" in skipped and not flags.get("skip-tokenizer-init"):
        assert "--tool-call-parser" in plan["skipped"]["tools"] or "--enable-auto-tool-choice" in plan["skipped"][
            "tools"]
    if "reasoning" in skipped and not flags.get("skip-tokenizer-init"):
        assert "--reasoning-parser" in plan["skipped"]["reasoning"]


def test_flag_layers_merge_in_recipe_order():
    flags = w.merge_flags({"reasoning_parser": "a", "max-model-len": 10}, None, {"reasoning-parser": "b"})
    assert flags == {"reasoning-parser": "b", "max-model-len": 10}
    with pytest.raises(w.WarmupError, match="mapping"):
        w.merge_flags(["x"])


@pytest.mark.parametrize("inv", ["local", "b300"])
def test_the_default_list_on_the_inventories(inv):
    """The embedded default (tiny model, no tool or reasoning parser) warms everything else; b300 (glm47 tool parser,
    glm45 reasoning parser) warms every feature; decode's and prefill's flags alike."""
    recipe = load_inventory(inv)["recipe"]
    for pool in ("prefill", "decode"):
        flags = w.merge_flags(recipe["pd_vllm_flags_common"], (recipe["pd_vllm_flags_pool"] or {}).get(pool))
        plan = w.warmup_plan(None, "m", [256, 3072], flags=flags)
        assert set(plan["skipped"]) == ({"tools", "reasoning"} if inv == "local" else set()), (pool, plan["skipped"])


# ------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(("value", "match"), [
    (["completion", "logprob"], "unknown feature\\(s\\) 'logprob'"),
    ("logprobs", "must be a list"),
    ([1], "unknown feature\\(s\\) 1"),
])
def test_unknown_features_are_refused_naming_the_field_and_the_allowed_names(value, match):
    with pytest.raises(w.WarmupError, match=match) as e:
        w.check_features(value)
    assert "pd_warmup_features" in str(e.value) and ", ".join(w.FEATURES) in str(e.value)


def test_feature_list_defaults_to_all_and_drops_duplicates():
    assert w.check_features(None) == list(w.FEATURES)
    assert w.check_features(["logprobs", "completion", "logprobs"]) == ["logprobs", "completion"]
    assert w.warmup_requests([], "m") == []


def test_answers_are_checked():
    assert w.check_response("x", {}, 200, '{"choices": [{"text": "a"}]}') is None
    assert "HTTP 400" in w.check_response("x", {}, 400, "bad")
    assert "no choices" in w.check_response("x", {}, 200, '{"choices": []}')
    assert "1 choices for n: 2" in w.check_response("n", {"n": 2}, 200, '{"choices": [{}]}')
    assert w.check_response("s", {"stream": True}, 200, 'data: {"choices": []}\n\ndata: [DONE]\n\n') is None
    assert "[DONE]" in w.check_response("s", {"stream": True}, 200, 'data: {"choices": []}\n\n')


def test_the_bodies_are_valid_vllm_requests():
    """vLLM's own request models (the pinned venv) accept every body and turn it into sampling params with the
    feature on: what the instance would parse."""
    need_vllm_venv()
    reqs = w.warmup_requests(None, "m", [64, 512], flags=TOOLS)
    script = """
import json, sys
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
out = []
for r in json.load(sys.stdin):
    cls = ChatCompletionRequest if "chat" in r["path"] else CompletionRequest
    sp = cls.model_validate(r["body"]).to_sampling_params(8, {})
    out.append([r["feature"], sp.logprobs, sp.prompt_logprobs, sp.n, sp.structured_outputs is not None])
print(json.dumps(out))
"""
    p = subprocess.run([str(VLLM_VENV_PY), "-c", script], input=json.dumps(reqs), capture_output=True, text=True,
                       timeout=300, check=False, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    got = set(map(tuple, json.loads(p.stdout.splitlines()[-1])))
    assert ("logprobs", 1, None, 1, False) in got and ("prompt_logprobs", None, 1, 1, False) in got
    assert ("n", None, None, 2, False) in got and ("structured_output", None, None, 1, True) in got


# ------------------------------------------------------------------------------------------- the module
class Instance:
    """A stub vLLM instance: /health, /tokenize (one token per word, window 4096), completions and chat (stream
    too); fields in ``refuse`` answered 400; every request logged with its Authorization header."""

    def __init__(self):
        self.log, self.refuse, self.health = [], (), 200
        inst = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code, text, ctype="application/json"):
                body = text.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802 - the stdlib's name
                self._send(inst.health if self.path == "/health" else 404, "{}")

            def do_POST(self):  # noqa: N802 - the stdlib's name
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                inst.log.append((self.path, req, self.headers.get("Authorization")))
                if self.path == "/tokenize":
                    return self._send(200, json.dumps({"count": len(req["prompt"].split()), "max_model_len": 4096}))
                if any(k in req for k in inst.refuse):
                    return self._send(400, json.dumps({"error": {"message": "not supported"}}))
                if req.get("stream"):
                    return self._send(200, 'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n',
                                      "text/event-stream")
                return self._send(200, json.dumps({"choices": [{"index": i, "text": "a"}
                                                               for i in range(req.get("n") or 1)]}))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def posts(self):
        return [(path, req) for path, req, _auth in self.log if path != "/tokenize"]


@pytest.fixture()
def inst():
    i = Instance()
    yield i
    i.server.shutdown()


def margs(url, **kw):
    return dict({"url": url, "model": "m", "context_tokens": [256, 3072], "max_tokens": 4}, **kw)


def test_module_warms_every_feature_and_times_each(inst, monkeypatch):
    res, failed = run_module(mod.main, margs(inst.url, flags=[{"reasoning-parser": "x"}]), monkeypatch=monkeypatch)
    assert not failed, res
    assert res["warmed"] == [f for f in w.FEATURES if f != "tools"]
    assert res["skipped_features"] == {"tools": res["features"]["tools"]["skipped_reason"]}
    assert "--tool-call-parser" in res["skipped_features"]["tools"] and "skipped" not in res
    for f in res["warmed"]:
        feat = res["features"][f]
        assert feat["status"] == 200 and feat["skipped_reason"] is None and feat["seconds"] >= 0, f
        assert all(r["status"] == 200 and r["seconds"] is not None for r in feat["requests"]), f
    assert res["features"]["tools"] == {"status": "skipped", "seconds": 0, "requests": [],
                                        "skipped_reason": res["skipped_features"]["tools"]}
    # prompts sized with the instance's tokenizer: 256 and 3072 tokens at most, clipped below its window
    assert res["context_tokens"] == [256, 3072]
    sizes = [r["prompt_tokens"] for r in res["features"]["completion"]["requests"]]
    assert sizes[0] <= 256 and 3000 <= sizes[1] <= 3072, sizes
    posted = inst.posts()
    assert len(posted) == sum(len(res["features"][f]["requests"]) for f in res["warmed"])
    assert posted[2][1].get("logprobs") == 1  # logprobs right after the plain completions
    assert all(auth is None for _p, _r, auth in inst.log)  # no key file: no Authorization header


def test_module_fails_naming_the_feature(inst, monkeypatch):
    inst.refuse = ("response_format",)
    res, failed = run_module(mod.main, margs(inst.url), monkeypatch=monkeypatch)
    assert failed
    assert "the warm-up of feature 'structured_output' failed (POST /v1/chat/completions" in res["msg"]
    assert "HTTP 400" in res["msg"] and "pd_warmup_features" in res["msg"]
    assert res["features"]["structured_output"]["status"] == 400
    assert "logprobs" in res["warmed"] and "stream" not in res["warmed"]


def test_module_refuses_unknown_features_before_sending(inst, monkeypatch):
    res, failed = run_module(mod.main, margs(inst.url, features=["logprobs", "beam_search"]), monkeypatch=monkeypatch)
    assert failed and "pd_warmup_features" in res["msg"] and "'beam_search'" in res["msg"]
    assert "structured_output" in res["msg"]  # the allowed names
    assert inst.log == []


def test_check_mode_sends_nothing(inst, monkeypatch):
    res, failed = run_module(mod.main, margs(inst.url, features=["logprobs", "tools"]), check_mode=True,
                             monkeypatch=monkeypatch)
    assert not failed and inst.log == []
    assert res["features"]["logprobs"]["status"] is None and len(res["features"]["logprobs"]["requests"]) == 2
    assert res["features"]["tools"]["status"] == "skipped" and res["warmed"] == []


def test_module_reads_the_key_from_a_file_and_sends_copies_in_parallel(inst, monkeypatch, tmp_path):
    key = tmp_path / "api-key"
    key.write_text("sk-secret\n")
    res, failed = run_module(mod.main, margs(inst.url, features=["logprobs"], parallel=3, api_key_file=str(key)),
                             monkeypatch=monkeypatch)
    assert not failed, res
    assert len(inst.posts()) == 2 * 3  # each request once per data-parallel engine
    assert {auth for _p, _r, auth in inst.log} == {"Bearer sk-secret"}
    assert "sk-secret" not in json.dumps(res)
    key.write_text("")
    res, failed = run_module(mod.main, margs(inst.url, api_key_file=str(key)), monkeypatch=monkeypatch)
    assert failed and "is empty" in res["msg"]


def test_module_waits_for_health_and_gives_up(inst, monkeypatch):
    inst.health = 503
    res, failed = run_module(mod.main, margs(inst.url, wait_s=1), monkeypatch=monkeypatch)
    assert failed and "did not answer 200 within 1 s" in res["msg"] and inst.log == []


def test_module_without_tokenize_falls_back_to_a_safe_prompt_size(monkeypatch):
    calls = []

    def sender(base, req, api_key, timeout, parallel):
        calls.append(req)
        return 200, 0.01, None

    class M:
        check_mode = False

        def fail_json(self, **kw):
            raise AssertionError(kw)

    params = {"url": "http://127.0.0.1:9", "model": "m", "features": ["completion"], "flags": [{"max-model-len": 512}],
              "context_tokens": [4096], "max_model_len": 0, "max_tokens": 8, "parallel": 1, "timeout_s": 5,
              "wait_s": 0, "api_key_file": None}
    res = mod.run(M(), params, sender=sender)
    assert res["context_tokens"] == [512 - 8 - w.WINDOW_MARGIN] and len(calls) == 1
    assert sum(len(word) + 1 for word in calls[0]["body"]["prompt"].split()) <= 512


def test_ansible_doc_renders():
    p = subprocess.run([str(ROOT / ".venv" / "bin" / "ansible-doc"), "-M", str(ROOT / "plugins" / "modules"),
                        "b300.pd.pd_instance_warmup"], capture_output=True, text=True, timeout=120, check=False,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "pd_warmup_features" in p.stdout and "api_key_file" in p.stdout


# ------------------------------------------------------------------------------------------- roles/pd_verify
VERIFY_PLAYBOOK = """
- name: The per-instance warm-up of roles/pd_verify
  hosts: r
  gather_facts: false
  vars:
    _pd_verify_config: {warmup: {output_tokens: 4}}
    _pd_verify_instances:
      - {name: prefill-0, pool: prefill, host: hp, url: "{{ p_url }}"}
      - {name: decode-0, pool: decode, host: hd, url: "{{ d_url }}"}
  tasks:
    - name: Warm
      ansible.builtin.include_role: {name: b300.pd.pd_verify, tasks_from: warmup.yml}
    - name: Keep the script's config
      ansible.builtin.copy:
        content: "{{ _pd_verify_config | to_json }}"
        dest: "{{ out }}"
        mode: "0600"
"""


def verify_inventory(tmp_path, p_inst, d_inst):
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inv = {"all": {"vars": {"pd_served_model_name": "m", "pd_verify_workdir": str(tmp_path / "work"),
                            "pd_verify_api_key": "sk-verify", "pd_router_api_key": "wk-verify",
                            "pd_sla": {"context_min_tokens": 16, "context_max_tokens": 128},
                            "pd_verify_max_model_len": 4096, "pd_verify_ready_retries": 1,
                            "pd_verify_ready_delay_s": 1, "pd_warmup_features": ["completion", "logprobs",
                                                                                 "prompt_logprobs", "tools"],
                            "p_url": p_inst.url, "d_url": d_inst.url, "out": str(tmp_path / "cfg.json")},
                   "hosts": {"r": local,
                             "hp": dict(local, pd_vllm_flags_common={"tool-call-parser": "hermes"},
                                        pd_vllm_flags_pool={"prefill": {"enable_auto_tool_choice": True}},
                                        pd_instances=[{"name": "prefill-0", "pool": "prefill", "dp_size": 2}]),
                             "hd": dict(local, pd_instances=[{"name": "decode-0", "pool": "decode"}])}}}
    (tmp_path / "inv.yml").write_text(yaml.safe_dump(inv))
    (tmp_path / "pb.yml").write_text(VERIFY_PLAYBOOK)


def run_verify_warmup(tmp_path, *extra):
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"))
    p = subprocess.run([str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", str(tmp_path / "inv.yml"),
                        str(tmp_path / "pb.yml"), *extra], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    return p


@pytest.mark.skipif(os.geteuid() != 0, reason="the role's work directory is owned by root")
def test_pd_verify_warms_every_instance_and_hands_the_results_to_the_script(tmp_path):
    p_inst, d_inst = Instance(), Instance()
    d_inst.refuse = ("prompt_logprobs",)
    verify_inventory(tmp_path, p_inst, d_inst)
    p = run_verify_warmup(tmp_path)
    assert "sk-verify" not in p.stdout and "wk-verify" not in p.stdout
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert cfg["warmup"]["output_tokens"] == 4  # the rest of the config kept
    pre, dec = cfg["warmup"]["instances"]
    # prefill-0: its host's flags (common + pool) serve tools; two copies of each request (dp_size 2)
    assert pre["ok"] and pre["error"] == "" and pre["context_tokens"] == [16, 128]
    served = [f for f, v in pre["features"].items() if v["status"] == 200]
    assert served == ["completion", "logprobs", "prompt_logprobs", "tools"]
    assert len(p_inst.posts()) == 2 * (2 + 2 + 1 + 1)
    # the workers' key (pd_router_api_key), which the instances require; never the front door's client key
    assert {auth for _p, _r, auth in p_inst.log} == {"Bearer wk-verify"}
    # decode-0: no tool parser (skipped), and its refusal of prompt_logprobs is its error for the report
    assert not dec["ok"] and "the warm-up of feature 'prompt_logprobs' failed" in dec["error"]
    assert dec["features"]["tools"]["status"] == "skipped" and "--tool-call-parser" in dec["skipped"]["tools"]
    assert oct((tmp_path / "work" / "worker-api-key").stat().st_mode & 0o777) == "0o600"


def test_pd_verify_warmup_in_check_mode_sends_nothing(tmp_path):
    p_inst, d_inst = Instance(), Instance()
    verify_inventory(tmp_path, p_inst, d_inst)
    run_verify_warmup(tmp_path, "--check")
    assert p_inst.log == [] and d_inst.log == []
    assert not (tmp_path / "work" / "worker-api-key").exists()


# ---- pd_verify's direct calls to the instances send the workers' key, the router calls the client key (issue 32) --

class _KeyedServer:
    """A server that answers /v1/* only with its one bearer key (401 otherwise), /health always, like vLLM with
    VLLM_API_KEY set (or the front door with its client key)."""

    def __init__(self, key, model="m"):
        seen = self.seen = []

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self):
                seen.append((self.path, self.headers.get("Authorization")))
                if self.path.startswith("/v1") and self.headers.get("Authorization") != f"Bearer {key}":
                    code, body = 401, {"error": "Unauthorized"}
                elif self.path == "/v1/models":
                    code, body = 200, {"data": [{"id": model}]}
                else:
                    code, body = 200, {"choices": [{"text": "x"}]}
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._answer()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_pd_verify_sends_the_workers_key_to_instances_and_the_client_key_to_the_router():
    from ansible_collections.b300.pd.roles.pd_verify.files.pd_verify.steps import _completion, step_readiness

    worker, router = _KeyedServer("W0rker"), _KeyedServer("Cl1ent")
    try:
        cfg = {"router_url": router.url, "model": "m", "api_key": "Cl1ent", "worker_api_key": "W0rker",
               "instances": [{"name": "prefill-0", "url": worker.url}],
               "readiness": {"retries": 1, "delay_s": 0, "timeout_s": 5}}
        res = step_readiness(cfg, sleep=lambda s: None)
        assert res["ok"], res
        # the colocated side of the KV-transfer check goes to the instance itself
        assert _completion(worker.url, "m", "hi", 1, cfg)["choices"]
        assert _completion(router.url, "m", "hi", 1, cfg)["choices"]
        # neither key goes where the other belongs
        assert {a for p, a in worker.seen if p.startswith("/v1")} == {"Bearer W0rker"}
        assert {a for p, a in router.seen if p.startswith("/v1")} == {"Bearer Cl1ent"}
    finally:
        worker.httpd.shutdown()
        router.httpd.shutdown()
