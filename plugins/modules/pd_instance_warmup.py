#!/usr/bin/python
# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: pd_instance_warmup
short_description: Warm one vLLM instance on every request feature clients use before it takes traffic
description:
  - Sends one or more requests per request feature straight to one instance's OpenAI API (C(/v1/completions),
    C(/v1/chat/completions)) and times each, so the first client request of a feature does not pay the engine's
    first-use cost (right after a restart the first request with C(logprobs) took 15.5 s instead of 0.02 s).
  - The features and their requests are C(plugins/module_utils/pd_warmup.py)'s. C(completion) runs at every length of
    O(context_tokens), the other features at the shortest. A feature the instance cannot serve by its O(flags) is
    skipped with the reason (C(tools) without C(--enable-auto-tool-choice) and C(--tool-call-parser), C(reasoning)
    without C(--reasoning-parser), C(logprobs) and C(prompt_logprobs) with C(--max-logprobs 0), the chat features
    and C(stream) with C(--skip-tokenizer-init)).
  - A prefill instance (C(kv_producer)) and a decode instance (C(kv_consumer)) both take the requests alone, without
    C(kv_transfer_params); the instance computes the prompt itself, as for the routers' colocated fallback.
  - Prompts are sized with the instance's C(/tokenize) (never longer than asked; without it, a worst-case count of
    the filler words) and clipped to the model window (O(max_model_len), else the C(max_model_len) C(/tokenize)
    answers, else the flags' C(max-model-len)).
  - Fails naming the feature on an answer other than 200 (or a 200 without the choices asked for).
  - Changes nothing on the host; in check mode it validates the input and returns the plan without sending anything.
version_added: "1.0.0"
author: b300-pd contributors (@b300-pd)
options:
  url:
    description: The instance's base URL as the host running the module reaches it (C(http://10.0.0.11:8100)).
    type: str
    required: true
  model:
    description: The served model name (C(pd_served_model_name)).
    type: str
    required: true
  features:
    description:
      - The request features to warm, from the inventory's C(pd_warmup_features). Allowed names C(completion),
        C(logprobs), C(prompt_logprobs), C(n), C(chat), C(tools), C(reasoning), C(structured_output), C(stream);
        another name fails, naming the field C(pd_warmup_features) and the allowed names.
      - Default all of them.
    type: list
    elements: str
  flags:
    description:
      - The instance's vLLM flags as layers merged in order (C(pd_vllm_flags_common), C(pd_vllm_flags_pool[pool]),
        the instance's C(extra_flags)), names with dashes or underscores. They decide which features are skipped.
    type: list
    elements: dict
    default: []
  context_tokens:
    description: The configured context lengths (prompt tokens), e.g. C(pd_sla)'s shortest and longest.
    type: list
    elements: int
    default: []
  max_model_len:
    description: The model window the lengths are clipped to (0 - from C(/tokenize), else the flags' C(max-model-len)).
    type: int
    default: 0
  max_tokens:
    description: Output tokens of each request.
    type: int
    default: 8
  parallel:
    description:
      - Copies of each request sent at once. Give the instance's C(dp_size), so that vLLM's load balancing puts one
        on each data-parallel engine (each has its own first use).
    type: int
    default: 1
  timeout_s:
    description: Seconds each request may take.
    type: int
    default: 300
  wait_s:
    description: Seconds to wait for C(/health) to answer 200 before the first request (0 - no wait).
    type: int
    default: 0
  api_key_file:
    description:
      - A file on the host running the module holding the bearer token the instance wants (first line); never a
        command-line argument. Unset - no C(Authorization) header.
    type: path
extends_documentation_fragment:
  - b300.pd.attributes
  - b300.pd.attributes.info_module
notes:
  - The requests go straight to the instance, never through a proxy from the environment.
"""

EXAMPLES = r"""
- name: Warm prefill-0 on every feature before it goes back into the routers
  b300.pd.pd_instance_warmup:
    url: http://10.237.0.11:8100
    model: tiny-pd
    features: "{{ pd_warmup_features | default(omit) }}"
    flags:
      - "{{ pd_vllm_flags_common }}"
      - "{{ pd_vllm_flags_pool.prefill | default({}) }}"
    context_tokens: [256, 3072]
    parallel: 1
  delegate_to: "{{ groups['router_hosts'][0] }}"
"""

RETURN = r"""
features:
  description:
    - Per feature asked for - C(status) (200 when every request of it answered 200, C(skipped), C(null) in check mode),
      C(seconds) (its requests together), C(skipped_reason), and C(requests) (path, context tokens, prompt tokens by
      the instance's tokenizer, seconds of each).
  returned: always
  type: dict
  sample:
    logprobs:
      status: 200
      seconds: 0.08
      skipped_reason: null
      requests:
        - {path: /v1/completions, context_tokens: 256, prompt_tokens: 250, seconds: 0.05, status: 200}
        - {path: /v1/chat/completions, context_tokens: 256, prompt_tokens: 250, seconds: 0.03, status: 200}
    tools:
      status: skipped
      seconds: 0
      skipped_reason: "the instance runs without --enable-auto-tool-choice and --tool-call-parser: ..."
      requests: []
warmed:
  description: The features whose requests were sent and answered, in order.
  returned: always
  type: list
  elements: str
skipped_features:
  description: Feature -> why it was not sent (not C(skipped), which Ansible reads as the task's own state).
  returned: always
  type: dict
seconds:
  description: Seconds of all warm-up requests.
  returned: always
  type: float
context_tokens:
  description: The context lengths used, clipped to the model window.
  returned: always
  type: list
  elements: int
"""

import json  # noqa: E402 (community.general layout: imports after DOCUMENTATION)
import time  # noqa: E402
import urllib.error  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible.module_utils.urls import ConnectionError as UrlConnectionError  # noqa: E402
from ansible.module_utils.urls import open_url  # noqa: E402
from ansible_collections.b300.pd.plugins.module_utils.pd_warmup import (  # noqa: E402
    FIELD,
    WarmupError,
    check_features,
    check_response,
    merge_flags,
    warmup_plan,
)

_HTTP_ERRORS = (urllib.error.URLError, UrlConnectionError, OSError, ValueError)


def _headers(api_key):
    h = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def post(url, body, api_key, timeout):
    """POST JSON -> (status, text). Connection problems -> (None, reason)."""
    try:
        with open_url(url, data=json.dumps(body), headers=_headers(api_key), method="POST", timeout=timeout,
                      use_proxy=False, follow_redirects="none") as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except _HTTP_ERRORS as e:
        return None, str(getattr(e, "reason", e))


def healthy(url, api_key):
    try:
        with open_url(url, headers=_headers(api_key), timeout=5, use_proxy=False) as resp:
            return resp.status == 200
    except (urllib.error.HTTPError, *_HTTP_ERRORS):
        return False


class Tokenizer:
    """The instance's /tokenize: count(text) -> tokens or None; max_model_len as it answers."""

    def __init__(self, base, model, api_key, timeout):
        self.base, self.model, self.api_key, self.timeout = base, model, api_key, timeout
        self.max_model_len, self.works = None, True

    def count(self, text):
        if not self.works:
            return None
        status, out = post(self.base + "/tokenize", {"model": self.model, "prompt": text}, self.api_key, self.timeout)
        try:
            doc = json.loads(out) if status == 200 else None
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or not isinstance(doc.get("count"), int):
            self.works = False
            return None
        if isinstance(doc.get("max_model_len"), int):
            self.max_model_len = doc["max_model_len"]
        return doc["count"]


def read_key(module, path):
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except OSError as e:
        module.fail_json(msg=f"pd_instance_warmup: cannot read api_key_file {path}: {e}")
    if not key:
        module.fail_json(msg=f"pd_instance_warmup: api_key_file {path} is empty")
    return key


def wait_healthy(module, base, api_key, wait_s, *, clock=time.monotonic, sleep=time.sleep):
    start = clock()
    while not healthy(base + "/health", api_key):
        if clock() - start >= wait_s:
            module.fail_json(msg=f"pd_instance_warmup: {base}/health did not answer 200 within {wait_s} s; "
                                 "nothing was warmed")
        sleep(min(2.0, max(0.1, wait_s / 10)))


def send(base, req, api_key, timeout, parallel):
    """One warm-up request, ``parallel`` copies at once -> (status, seconds, problem or None)."""
    url = base + req["path"]

    def one(_i):
        t0 = time.perf_counter()
        status, text = post(url, req["body"], api_key, timeout)
        return status, time.perf_counter() - t0, text

    if parallel == 1:
        results = [one(0)]
    else:
        with ThreadPoolExecutor(max_workers=parallel) as ex:
            results = list(ex.map(one, range(parallel)))
    seconds = max(r[1] for r in results)
    for status, _s, text in results:
        if status is None:
            return None, seconds, f"no answer: {text}"
        problem = check_response(req["feature"], req["body"], status, text)
        if problem:
            return status, seconds, problem
    return 200, seconds, None


def run(module, p, *, sender=send):
    api_key = None if module.check_mode else read_key(module, p["api_key_file"])
    base = p["url"].rstrip("/")
    try:
        features = check_features(p["features"], FIELD)
        flags = merge_flags(*(p["flags"] or []))
    except WarmupError as e:
        module.fail_json(msg=f"pd_instance_warmup: {e}")
    if p["max_tokens"] < 1 or p["parallel"] < 1 or p["timeout_s"] < 1 or p["wait_s"] < 0:
        module.fail_json(msg="pd_instance_warmup: max_tokens, parallel and timeout_s must be >= 1, wait_s >= 0")
    tokenizer = None
    if not module.check_mode:
        if p["wait_s"] > 0:
            wait_healthy(module, base, api_key, p["wait_s"])
        tokenizer = Tokenizer(base, p["model"], api_key, min(60, p["timeout_s"]))
        tokenizer.count("warm-up")  # learns the window before the lengths are clipped
    window = p["max_model_len"] or (tokenizer.max_model_len if tokenizer else None) or flags.get("max-model-len")
    try:
        plan = warmup_plan(features, p["model"], p["context_tokens"], flags=flags, max_tokens=p["max_tokens"],
                           max_model_len=window, count=tokenizer.count if tokenizer and tokenizer.works else None)
    except WarmupError as e:
        module.fail_json(msg=f"pd_instance_warmup: {e}")
    result = {f: {"status": "skipped" if f in plan["skipped"] else None, "seconds": 0,
                  "skipped_reason": plan["skipped"].get(f), "requests": []} for f in features}
    lengths = sorted({r["context_tokens"] for r in plan["requests"]})
    out = {"changed": False, "features": result, "skipped_features": plan["skipped"], "warmed": [], "seconds": 0.0,
           "context_tokens": lengths}
    entries = []
    for req in plan["requests"]:
        entry = {"path": req["path"], "context_tokens": req["context_tokens"], "prompt_tokens": req["prompt_tokens"],
                 "seconds": None, "status": None}
        result[req["feature"]]["requests"].append(entry)
        entries.append(entry)
    if module.check_mode:
        out["msg"] = "check mode: nothing sent"
        return out
    for i, req in enumerate(plan["requests"]):
        entry = entries[i]
        status, seconds, problem = sender(base, req, api_key, p["timeout_s"], p["parallel"])
        entry.update(status=status, seconds=round(seconds, 3))
        feat = result[req["feature"]]
        feat["seconds"] = round(feat["seconds"] + seconds, 3)
        out["seconds"] = round(out["seconds"] + seconds, 3)
        if problem:
            feat["status"] = status
            out["warmed"] = [f for f in features if result[f]["status"] == 200]
            module.fail_json(
                msg=(f"pd_instance_warmup: {base}: the warm-up of feature '{req['feature']}' failed "
                     f"(POST {req['path']}, {req['context_tokens']} context tokens): {problem}. Remove the feature "
                     f"from {FIELD} if the instance is not meant to serve it, or fix the instance's flags."),
                **{k: v for k, v in out.items() if k != "changed"})
        if all(e["status"] == 200 for e in feat["requests"]):
            feat["status"] = 200
    out["warmed"] = [f for f in features if result[f]["status"] == 200]
    return out


def main():
    module = AnsibleModule(
        argument_spec={
            "url": {"type": "str", "required": True},
            "model": {"type": "str", "required": True},
            "features": {"type": "list", "elements": "str"},
            "flags": {"type": "list", "elements": "dict", "default": []},
            "context_tokens": {"type": "list", "elements": "int", "default": [], "no_log": False},
            "max_model_len": {"type": "int", "default": 0},
            "max_tokens": {"type": "int", "default": 8, "no_log": False},
            "parallel": {"type": "int", "default": 1},
            "timeout_s": {"type": "int", "default": 300},
            "wait_s": {"type": "int", "default": 0},
            "api_key_file": {"type": "path"},
        },
        supports_check_mode=True,
    )
    module.exit_json(**run(module, module.params))


if __name__ == "__main__":
    main()
