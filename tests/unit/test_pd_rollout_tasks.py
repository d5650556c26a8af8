"""roles/pd_rollout task files run by ansible-playbook on localhost against the real vllm-router 0.1.17 (IGW) and
stub vLLM instances: route.yml (drain, colocated fallback, back), wait_idle.yml (drain wait on /metrics, bounded
with a clear error), ready.yml and smoke.yml (warm-up, P/D through the instance with kv_transfer_params, token
comparison, KV-transfer counter), instance.yml's failures before any restart. The restart and restore.yml need
systemd and vllm_serve on a real host: tests/integration/test_local_stack.py runs them through site.yml.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from datetime import datetime
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from ansible_collections.b300.pd.tests.unit.test_pd_router_workers import QuietJSONHandler, call, router  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
from ansible_collections.b300.pd.bench.pd_cluster import view_from  # noqa: E402

TOOL = ROOT / "roles" / "pd_router" / "files" / "pd_router_workers.py"


class Instance:
    """A stub vLLM instance: /health, /v1/models, /metrics (queue, KV-transfer counter), /v1/completions with
    the NIXL P/D protocol (prefill answers kv_transfer_params, decode consumes them). Greedy output is the same
    text whichever way a request is served."""

    def __init__(self, name, text="tok tok tok"):
        self.name, self.text, self.log = name, text, []
        self.running, self.kv_tokens = 0, 0.0
        self.pd_text, self.count_kv = None, True  # faults: P/D answer differs, no KV-transfer counted
        self.kv_usage, self.metrics_gets = [0.0], 0  # vllm:kv_cache_usage_perc per /metrics read (last one stays)
        self.requests, self.refuse = [], ()  # every POST (path, body); request fields answered with a 400
        inst = self

        class H(QuietJSONHandler):

            def do_GET(self):
                if self.path == "/health":
                    return self._send(200, {})
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})
                if self.path == "/metrics":
                    inst.metrics_gets += 1
                    usage = inst.kv_usage.pop(0) if len(inst.kv_usage) > 1 else inst.kv_usage[0]
                    return self._send(200, (
                        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}\n'
                        f'vllm:num_requests_running{{engine="0",model_name="m"}} {inst.running}.0\n'
                        'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
                        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} '
                        f'{inst.kv_tokens}\n'), "text/plain")
                return self._send(404, {})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                inst.requests.append((self.path, req))
                if self.path == "/tokenize":  # as vLLM: a count and the window (one token per word here)
                    return self._send(200, {"count": len(req["prompt"].split()), "max_model_len": 4096,
                                            "tokens": []})
                if inst.refuse and any(k in req for k in inst.refuse):
                    return self._send(400, {"error": {"message": f"{inst.refuse} not supported"}})
                if req.get("stream"):
                    inst.log.append("whole")
                    return self._send(200, 'data: {"choices": [{"index": 0, "text": "tok"}]}\n\n'
                                           'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n'
                                           "data: [DONE]\n\n", "text/event-stream")
                kv = req.get("kv_transfer_params")
                n = int(req.get("max_tokens") or 1)
                out = {"id": "c", "object": "text_completion", "model": "m",
                       "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}}
                if kv and kv.get("do_remote_decode"):
                    inst.log.append("prefill")
                    out["kv_transfer_params"] = {"do_remote_prefill": True, "remote_engine_id": inst.name,
                                                 "remote_block_ids": [1], "remote_host": "h", "remote_port": 1}
                    text = inst.text.split()[0]
                else:
                    inst.log.append(f"decode-after-{kv['remote_engine_id']}" if kv else "whole")
                    if kv and inst.count_kv:
                        inst.kv_tokens += 5
                    text = inst.pd_text if kv and inst.pd_text else inst.text
                out["choices"] = [{"index": i, "text": text, "finish_reason": "length"}
                                  for i in range(req.get("n") or 1)]
                return self._send(200, out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


PLAYBOOK = """
- name: State of the stub instances
  hosts: vllm_hosts
  gather_facts: false
  tasks:
    - name: Every instance has compatibility key k
      ansible.builtin.set_fact:
        pd_rollout_state: "{{ dict(pd_instances | map(attribute='name') | zip([{'key': 'k', 'python': '/p',
                              'venv': '/v', 'vllm': '1', 'nixl': '1'}] * (pd_instances | length))) }}"

- name: Register the topology
  hosts: hp
  gather_facts: false
  tasks:
    - name: Route with nothing out
      ansible.builtin.include_role: {name: b300.pd.pd_rollout, tasks_from: route.yml}
      vars: {_pd_rollout_out: []}

- name: One decode instance out, checked, back
  hosts: hd
  gather_facts: false
  vars:
    _pd_rollout_inst: "{{ pd_instances[0] }}"
    _pd_rollout_url: "http://127.0.0.1:{{ pd_instances[0].http_port }}"
    _pd_rollout_topology: "{{ pd_cluster | b300.pd.pd_rollout_topology(groups['vllm_hosts']) }}"
    _pd_rollout_req: {model: m, prompt: hi, max_tokens: 3, temperature: 0, ignore_eos: true}
  tasks:
    - name: Drain
      ansible.builtin.include_role: {name: b300.pd.pd_rollout, tasks_from: route.yml}
      vars: {_pd_rollout_out: [decode-0], _pd_rollout_target_key: k}
    - name: Mode while out
      ansible.builtin.copy:
        content: >-
          {{ {'mode': _pd_rollout_wanted | b300.pd.pd_rollout_routing_mode, 'route': _pd_rollout_route} | to_json }}
        dest: "{{ out_dir }}/out.json"
        mode: "0644"
    - name: Wait idle
      ansible.builtin.include_role: {name: b300.pd.pd_rollout, tasks_from: wait_idle.yml}
    - name: Ready
      ansible.builtin.include_role: {name: b300.pd.pd_rollout, tasks_from: ready.yml}
      vars: {_pd_rollout_unit: "vllm-{{ _pd_rollout_inst.name }}.service"}  # instance.yml: the record's unit
    - name: Smoke
      ansible.builtin.include_role: {name: b300.pd.pd_rollout, tasks_from: smoke.yml}
      vars: {_pd_rollout_key: k}
    - name: Back
      ansible.builtin.include_role: {name: b300.pd.pd_rollout, tasks_from: route.yml}
      vars: {_pd_rollout_out: [], _pd_rollout_target_key: k}
    - name: Mode after
      ansible.builtin.copy:
        content: "{{ {'mode': _pd_rollout_wanted | b300.pd.pd_rollout_routing_mode, 'route': _pd_rollout_route,
                      'partner': _pd_rollout_partner} | to_json }}"
        dest: "{{ out_dir }}/in.json"
        mode: "0644"
"""


def inventory(tmp_path, p0, p1, d0, router_url):
    common = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
              "ansible_host": "127.0.0.1"}
    inv = {"all": {
        "vars": {"pd_served_model_name": "m", "pd_rollout_router_host": "hp", "pd_rollout_router_urls": [router_url],
                 "pd_rollout_router_python": sys.executable, "pd_rollout_router_tool": str(TOOL),
                 "pd_rollout_drain_settle_s": 0, "pd_rollout_drain_poll_s": 1, "pd_rollout_smoke_max_tokens": 3,
                 # the warm-up's context lengths and the flags that decide its skipped features
                 "pd_sla": {"context_min_tokens": 16, "context_max_tokens": 64},
                 "pd_vllm_flags_common": {"reasoning-parser": "deepseek_r1"},
                 "out_dir": str(tmp_path)},
        "children": {
            "vllm_hosts": {"hosts": {
                "hp": {**common, "pd_instances": [
                    {"name": "prefill-0", "pool": "prefill", "http_port": p0.port, "nixl_side_channel_port": 5600},
                    {"name": "prefill-1", "pool": "prefill", "http_port": p1.port, "nixl_side_channel_port": 5610}]},
                "hd": {**common, "pd_instances": [{"name": "decode-0", "pool": "decode", "http_port": d0.port,
                                                   "nixl_side_channel_port": 5700}]},
            }},
            # Every inventory has one (validate.yml requires it); the argument_spec's defaults name it.
            "router_hosts": {"hosts": {"hp": {}}}}}}
    # The cluster view validate.yml would publish (the task files read pd_cluster), composed by the same code.
    hosts = inv["all"]["children"]["vllm_hosts"]["hosts"]
    inv["all"]["vars"]["pd_cluster"] = view_from({"all": list(hosts), "vllm_hosts": list(hosts)}, hosts)
    path = tmp_path / "inv.yml"
    path.write_text(yaml.safe_dump(inv))
    return path


def run(tmp_path, inv, playbook, extra=()):
    pb = tmp_path / "pb.yml"
    pb.write_text(textwrap.dedent(playbook))
    # ready.yml asks systemd for the unit's state (plugins/modules/pd_instance_ready.py); there is none here: a
    # systemctl that reports every unit running, never restarted (the module's own tests cover failed and
    # crash-looping units).
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    (fake_bin / "systemctl").write_text("#!/bin/sh\nprintf 'ActiveState=active\\nSubState=running\\nNRestarts=0\\n'\n")
    (fake_bin / "systemctl").chmod(0o755)
    env = dict(os.environ, ANSIBLE_CONFIG=str(ROOT / "ansible.cfg"),
               ANSIBLE_CACHE_PLUGIN="memory", PATH=f"{fake_bin}:{os.environ.get('PATH', '')}")
    return subprocess.run([str(ROOT / ".venv" / "bin" / "ansible-playbook"), "-i", str(inv), str(pb), *extra],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=600, check=False)


def test_drain_decode_fallback_checks_and_back(tmp_path):
    p0, p1, d0 = Instance("p0"), Instance("p1"), Instance("d0")
    with router("--enable-igw") as base:
        inv = inventory(tmp_path, p0, p1, d0, base)
        p = run(tmp_path, inv, PLAYBOOK)
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
        out = json.loads((tmp_path / "out.json").read_text())
        back = json.loads((tmp_path / "in.json").read_text())
        assert out["mode"] == "colocated" and out["route"]["broken_states"] == 1
        assert back["mode"] == "pd" and back["partner"] in ("prefill-0", "prefill-1")
        # The P/D smoke went through the decode instance with a prefill partner; the warm-up ran alone.
        assert "whole" in d0.log and any(x.startswith("decode-after-p") for x in d0.log)
        assert "prefill" in p0.log + p1.log
        # Before the P/D smoke the instance alone was warmed on every feature its flags serve (issue #31): logprobs
        # (completions and chat), prompt_logprobs, n, chat, reasoning, structured output, streams; completion at
        # both context lengths (one token per word in the stub's /tokenize); tools skipped (no tool parser).
        warm = [(path, body) for path, body in d0.requests
                if path != "/tokenize" and not body.get("kv_transfer_params")]
        assert ("/v1/completions", 1) in [(path, body.get("logprobs")) for path, body in warm]
        assert ("/v1/chat/completions", True) in [(path, body.get("logprobs")) for path, body in warm]
        assert any(body.get("prompt_logprobs") == 1 for _path, body in warm)
        assert any(body.get("n") == 2 for _path, body in warm)
        assert any(body.get("response_format", {}).get("type") == "json_schema" for _path, body in warm)
        assert any(body.get("include_reasoning") for _path, body in warm)
        assert not any("tools" in body for _path, body in warm)
        assert {path for path, body in warm if body.get("stream")} == {"/v1/completions", "/v1/chat/completions"}
        plain = {"model", "prompt", "max_tokens", "temperature", "ignore_eos"}
        lengths = sorted(len(body["prompt"].split()) for path, body in warm
                         if path == "/v1/completions" and set(body) == plain)
        assert lengths[0] <= 16 and lengths[-1] >= 60, lengths
        said = " ".join(p.stdout.split())
        assert "pd_rollout: decode-0 warmed in" in said, p.stdout[-3000:]
        assert "(seconds per feature): completion " in said, said[said.index("warmed in"):][:600]
        assert 'skipped: {"tools": "the instance runs without --enable-auto-tool-choice' in said
        status, text = call("GET", base + "/workers")
        reg = {w["url"]: w["worker_type"] for w in json.loads(text)["workers"]}
        assert reg == {f"http://127.0.0.1:{p0.port}": "prefill", f"http://127.0.0.1:{p1.port}": "prefill",
                       f"http://127.0.0.1:{d0.port}": "decode"}


@pytest.mark.parametrize("fault", ["busy", "pd_text", "no_kv", "logprobs"])
def test_failures_stop_with_a_clear_message(tmp_path, fault):
    p0, p1, d0 = Instance("p0"), Instance("p1"), Instance("d0")
    pb = PLAYBOOK
    if fault == "logprobs":
        d0.refuse = ("logprobs",)
        want = "the warm-up of feature 'logprobs' failed (POST /v1/completions"
    elif fault == "busy":
        d0.running = 3
        pb = PLAYBOOK.replace("    - name: Wait idle\n",
                              "    - name: Wait idle\n      vars: {pd_rollout_drain_timeout_s: 2}\n")
        want = "still has 3 running + waiting requests 2 s after it left the router"
    elif fault == "pd_text":
        d0.pd_text = "garbage after transfer"
        want = 'vs alone "tok tok tok"'
    else:
        d0.count_kv = False
        want = "external_kv_transfer prompt tokens 0.0 -> 0.0"
    with router("--enable-igw") as base:
        p = run(tmp_path, inventory(tmp_path, p0, p1, d0, base), pb)
    assert p.returncode != 0
    assert want in " ".join(p.stdout.split()), p.stdout[-3000:]


INSTANCE_PLAYBOOK = """
- name: What the stub instances run
  hosts: vllm_hosts
  gather_facts: false
  tasks:
    - name: Every instance has compatibility key k
      ansible.builtin.set_fact:
        pd_rollout_state: "{{ dict(pd_instances | map(attribute='name') | zip([{'key': 'k', 'python': '/p',
                              'venv': '/v', 'vllm': '1', 'nixl': '1', 'revision': 'r1'}] * (pd_instances | length))) }}"

- name: Register the topology
  hosts: hp
  gather_facts: false
  tasks:
    - name: Route with nothing out
      ansible.builtin.include_role: {name: b300.pd.pd_rollout, tasks_from: route.yml}
      vars: {_pd_rollout_out: []}

- name: Change the decode instance (it never goes idle, so the drain fails before any restart)
  hosts: hd
  gather_facts: false
  tasks:
    - name: Roll
      ansible.builtin.include_role: {name: b300.pd.pd_rollout, tasks_from: instance}
      vars:
        pd_rollout_instance: "{{ pd_instances[0] }}"
        pd_rollout_target_record: {python: /q/bin/python, venv: /q, vllm_version: "1", nixl_version: "1",
                                   compat_key: k, model_revision: r2}
        pd_rollout_pending_path: /nonexistent/.decode-0.restart-pending
        pd_rollout_rollback_files: []
        pd_rollout_drain_timeout_s: 2
"""


def test_instance_failure_before_the_restart_puts_it_back_and_says_nothing_restarted(tmp_path):
    p0, p1, d0 = Instance("p0"), Instance("p1"), Instance("d0")
    d0.running = 3
    with router("--enable-igw") as base:
        p = run(tmp_path, inventory(tmp_path, p0, p1, d0, base), INSTANCE_PLAYBOOK)
        status, text = call("GET", base + "/workers")
    out = " ".join(p.stdout.split())
    assert p.returncode != 0
    assert "pd_rollout: decode-0 on hd failed at stage 'drain'" in out, p.stdout[-3000:]
    assert "Nothing was restarted; decode-0 is back in the router." in out
    reg = {w["url"]: w["worker_type"] for w in json.loads(text)["workers"]}
    assert reg[f"http://127.0.0.1:{d0.port}"] == "decode" and len(reg) == 3


def test_instance_with_another_nixl_is_refused_before_the_drain(tmp_path):
    p0, p1, d0 = Instance("p0"), Instance("p1"), Instance("d0")
    with router("--enable-igw") as base:
        p = run(tmp_path, inventory(tmp_path, p0, p1, d0, base), INSTANCE_PLAYBOOK,
                extra=["-e", "pd_nixl_version=9.9.9"])
        status, text = call("GET", base + "/workers")
    out = " ".join(p.stdout.split())
    assert p.returncode != 0 and "the inventory pins pd_nixl_version 9.9.9" in out, p.stdout[-3000:]
    assert "Nothing was drained or restarted" in out
    reg = {w["url"]: w["worker_type"] for w in json.loads(text)["workers"]}
    assert reg[f"http://127.0.0.1:{d0.port}"] == "decode" and len(reg) == 3  # never taken out


SETTLE_PLAYBOOK = """
- name: Drain wait of one instance
  hosts: "{{ which }}"
  gather_facts: false
  vars:
    _pd_rollout_inst: "{{ pd_instances[0] }}"
  tasks:
    - name: Wait idle
      ansible.builtin.include_role: {name: b300.pd.pd_rollout, tasks_from: wait_idle.yml}
      vars: {pd_rollout_drain_settle_s: "{{ settle }}"}
"""


@pytest.mark.parametrize("which,usage,settle,reads", [
    # a prefill instance whose last KV blocks are pulled after two polls: waits for that, not the whole bound
    ("hp", [0.0, 0.25, 0.25, 0.0], 20, 5),
    # blocks never released (a decode died mid-pull): the bound, then on to the restart as before
    ("hp", [0.25], 3, 6),
    # a drained decode instance has no pull left: no KV wait at all, even with its usage up
    ("hd", [0.25], 20, 2),
])
def test_drain_waits_for_a_prefills_kv_blocks_bounded(tmp_path, which, usage, settle, reads):
    p0, p1, d0 = Instance("p0"), Instance("p1"), Instance("d0")
    inst = p0 if which == "hp" else d0
    inst.kv_usage = list(usage)
    inv = inventory(tmp_path, p0, p1, d0, "http://127.0.0.1:1")
    p = run(tmp_path, inv, SETTLE_PLAYBOOK, ("-e", f"which={which}", "-e", f"settle={settle}"))
    assert p.returncode == 0, p.stdout[-3000:]
    # reads of /metrics: the queue wait, the KV polls (until 0, or 1 + ceil(settle / poll) of them), the idle check
    assert inst.metrics_gets == reads


class Alertmanager:
    """A stub of Alertmanager's API v2 silences: POST /api/v2/silences answers a silenceID, DELETE
    /api/v2/silence/<id> expires it; every call is logged."""

    def __init__(self):
        self.calls = []
        am = self

        class H(QuietJSONHandler):

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                am.calls.append(("POST", self.path, body))
                self._send(200, {"silenceID": f"s{len(am.calls)}"})

            def do_DELETE(self):
                am.calls.append(("DELETE", self.path, None))
                self._send(200, {})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_restart_silences_the_instances_alerts_and_a_failure_ends_the_silence(tmp_path):
    p0, p1, d0 = Instance("p0"), Instance("p1"), Instance("d0")
    d0.running = 3  # the drain fails: the rescue must expire the silence it posted
    am = Alertmanager()
    with router("--enable-igw") as base:
        p = run(tmp_path, inventory(tmp_path, p0, p1, d0, base), INSTANCE_PLAYBOOK,
                extra=["-e", json.dumps({"pd_rollout_alertmanager_url": am.url, "pd_rollout_alertmanager_host": "hp",
                                         "pd_rollout_silence_s": 600})])
    assert p.returncode != 0 and "failed at stage 'drain'" in " ".join(p.stdout.split()), p.stdout[-3000:]
    (post, path, body), (delete, del_path, _del_body) = am.calls
    assert (post, path, delete, del_path) == ("POST", "/api/v2/silences", "DELETE", "/api/v2/silence/s1")
    assert body["matchers"] == [{"name": "instance_name", "value": "decode-0", "isRegex": False, "isEqual": True},
                                {"name": "host", "value": "hd", "isRegex": False, "isEqual": True}]
    assert body["createdBy"] == "pd_rollout" and "decode-0 (decode) on hd" in body["comment"]
    starts, ends = (datetime.strptime(body[k], "%Y-%m-%dT%H:%M:%SZ") for k in ("startsAt", "endsAt"))
    assert (ends - starts).total_seconds() == 600


def test_a_restart_goes_on_without_a_silence_when_alertmanager_does_not_answer(tmp_path):
    p0, p1, d0 = Instance("p0"), Instance("p1"), Instance("d0")
    d0.running = 3
    with router("--enable-igw") as base:
        p = run(tmp_path, inventory(tmp_path, p0, p1, d0, base), INSTANCE_PLAYBOOK,
                extra=["-e", json.dumps({"pd_rollout_alertmanager_url": "http://127.0.0.1:9",
                                         "pd_rollout_alertmanager_host": "hp"})])
    out = " ".join(p.stdout.split())
    assert "WARNING pd_rollout: no Alertmanager silence for decode-0 on hd" in out, p.stdout[-3000:]
    # the rollout itself went on to its drain (which fails here, as the stub never goes idle), nothing else changed
    assert "failed at stage 'drain'" in out and "Nothing was restarted; decode-0 is back in the router." in out
