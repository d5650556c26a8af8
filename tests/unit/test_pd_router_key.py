"""The workers' key reaches the vLLM instances through the real vllm-router 0.1.17 in both of its modes (issue 32).

The launcher (roles/pd_router/files/pd_router_launch.py) reads the key from the systemd credential. The regular
router sends its `--api-key` (set on the parsed arguments); the vLLM P/D path sends `Authorization: Bearer
$OPENAI_API_KEY` from its environment instead (vllm_pd_router.rs). Found live: with only `--api-key`, every P/D
request reached the prefill with an empty Bearer and vLLM answered 401.
"""

from __future__ import annotations

import json
import os
import threading
from http.server import ThreadingHTTPServer

from ansible_collections.b300.pd.tests.unit.test_pd_router_workers import (
    ROLE,
    ROUTER_VENV,
    QuietJSONHandler,
    call,
    router,
)

KEY = "k" * 40


class KeyedWorker:
    """A vLLM-like worker that answers /v1 only with the key (as vLLM with VLLM_API_KEY) and logs what it got."""

    def __init__(self, name):
        self.name, self.seen, self.paths = name, [], []
        worker = self

        class H(QuietJSONHandler):
            def do_GET(self):
                return self._send(200, {}) if self.path == "/health" else self._send(404, {})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                auth = self.headers.get("Authorization") or ""
                worker.seen.append(auth)
                worker.paths.append(self.path)
                if auth != f"Bearer {KEY}":
                    return self._send(401, {"error": "Unauthorized"})
                kv = req.get("kv_transfer_params") or {}
                out = {"id": "c", "object": "text_completion", "model": "m",
                       "choices": [{"index": 0, "text": worker.name, "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
                if kv.get("do_remote_decode"):
                    out["kv_transfer_params"] = {"do_remote_prefill": True, "remote_engine_id": "e",
                                                 "remote_block_ids": [1], "remote_host": "h", "remote_port": 1}
                return self._send(200, out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def launched(tmp_path, *args):
    """The real router started through the role's launcher, the key in a systemd-like credential directory."""
    cred = tmp_path / "cred"
    cred.mkdir(exist_ok=True)
    (cred / "worker-api-key").write_text(KEY + "\n")
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    return router(*args, command=[str(ROUTER_VENV / "bin" / "python"), str(ROLE / "files" / "pd_router_launch.py")],
                  env={**env, "CREDENTIALS_DIRECTORY": str(cred)})


def _complete(base):
    return call("POST", base + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2})


def test_pd_path_sends_the_key_to_prefill_and_decode(tmp_path):
    p, d = KeyedWorker("p"), KeyedWorker("d")
    with launched(tmp_path, "--vllm-pd-disaggregation", "--prefill", p.url, "none", "--decode", d.url) as base:
        status, text = _complete(base)
    assert status == 200 and json.loads(text)["choices"][0]["text"] == "d", text
    assert p.seen and d.seen and set(p.seen + d.seen) == {f"Bearer {KEY}"}, (p.seen, d.seen)


def test_regular_router_forwards_the_front_doors_header_only(tmp_path):
    """The regular router (the colocated backup path) sends its --api-key only with its render call, then forwards
    the request's own Authorization with the completion: without a header the worker gets none (401); with the
    header the front door sets (roles/pd_frontdoor: worker-auth.conf) the completion goes through."""
    w = KeyedWorker("w")
    with launched(tmp_path, "--worker-urls", w.url) as base:
        bare = _complete(base)
        keyed = call("POST", base + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2},
                     headers={"Authorization": f"Bearer {KEY}"})
    assert bare[0] == 401 and ("/v1/completions", "") in list(zip(w.paths, w.seen, strict=True)), (bare, w.seen)
    assert keyed[0] == 200, keyed
