#!/usr/bin/python
# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
---
module: pd_verify_lmeval
short_description: Score a P/D deployment with lm-evaluation-harness through its front door
description:
  - Writes the eval items to C(pd_verify_accuracy.jsonl) in O(workdir), runs C(lm_eval run) there with its
    OpenAI-compatible model (C(local-completions), or C(local-chat-completions) with C(--apply_chat_template)
    when O(chat)) against O(base_url), and compares the task's O(metric) with O(min_score).
  - The tasks shipped with roles/pd_verify (C(tiny_pd), C(pd_smoke_qa) in C(templates/lm_eval_tasks), which the role
    renders into O(include_path)) read that file from lm_eval's working directory, so they need no download; any
    other lm_eval task (O(include_path) or built in) works too where its data set can be reached.
  - The API key goes to lm_eval in its environment (C(OPENAI_API_KEY), which its local models send as
    C(Authorization Bearer)), never in its argv; it is masked in everything the module returns.
  - Returns the accuracy step of the verify report in RV(accuracy) and writes it to C(accuracy.json) in
    O(workdir). A run that failed (lm_eval exit status, no result, score below O(min_score)) is reported there
    with C(ok=false), not as a failed task, so the report is written first; bad input fails the task.
version_added: "1.0.0"
author: b300-pd contributors (@b300-pd)
options:
  lm_eval:
    description: The C(lm_eval) executable (C(.cache/lmeval-venv/bin/lm_eval), made by scripts/bootstrap).
    type: path
    required: true
  base_url:
    description: The front door, C(http://host:port); C(/v1/completions) or C(/v1/chat/completions) is appended.
    type: str
    required: true
  model:
    description: Served model name (the request's C(model)).
    type: str
    required: true
  task:
    description: The lm_eval task to run (one task, not a group).
    type: str
    required: true
  include_path:
    description: Directory of extra lm_eval task YAMLs (C(--include_path)); empty for built-in tasks only.
    type: path
    default: ""
  items:
    description:
      - "Eval items: C(prompt) (or C(question)) and C(answer) (or C(answers), a list of accepted answers)."
      - Mutually exclusive with O(items_jsonl); one of them is required.
    type: list
    elements: dict
  items_jsonl:
    description: The same items as JSON lines (an eval.jsonl file's content).
    type: str
  items_source:
    description: Where the items came from, for messages (e.g. C(host:/path/eval.jsonl)).
    type: str
    default: items
  chat:
    description: Ask as a chat turn (C(local-chat-completions), C(--apply_chat_template)) instead of a prompt.
    type: bool
    default: false
  max_items:
    description: Score only the first N items (C(--limit)); 0 scores all.
    type: int
    default: 0
  max_tokens:
    description: Output tokens per item (C(max_gen_toks)); 0 keeps the task's own.
    type: int
    default: 0
  gen_kwargs:
    description: "Extra request fields (C(--gen_kwargs)), e.g. C({chat_template_kwargs: {enable_thinking: false}})."
    type: dict
    default: {}
  concurrency:
    description: Parallel requests (C(num_concurrent)).
    type: int
    default: 1
  request_timeout_s:
    description: Per-request timeout (s).
    type: int
    default: 600
  timeout_s:
    description: Limit of the whole lm_eval run (s); it is killed past it and the step fails naming the limit.
    type: int
    default: 900
  metric:
    description: Key of the task's result compared with O(min_score), as lm_eval writes it (C(metric,filter)).
    type: str
    default: acc,none
  min_score:
    description: Lowest passing value of O(metric) (0-1).
    type: float
    required: true
  reference_scores:
    description: Published reference scores, reported beside the result.
    type: dict
    default: {}
  workdir:
    description: Directory on the machine running the module for the items, lm_eval's output and C(accuracy.json).
    type: path
    required: true
  api_key:
    description: Bearer key of the front door (empty for none).
    type: str
    default: ""
extends_documentation_fragment:
  - b300.pd.attributes
attributes:
  check_mode:
    support: full
    details: Validates the items and returns the argv it would run; sends no request and writes nothing.
  diff_mode:
    support: none
notes:
  - Read-only against the deployment (C(changed) is always false); the files in O(workdir) are artifacts.
"""

EXAMPLES = r"""
- name: Score the tiny model's held-out items through the front door
  b300.pd.pd_verify_lmeval:
    lm_eval: "{{ playbook_dir }}/../.cache/lmeval-venv/bin/lm_eval"
    base_url: http://10.237.0.13:8000
    model: tiny-pd
    task: tiny_pd
    include_path: "{{ pd_verify_control_dir }}/lm_eval_tasks"
    items_jsonl: "{{ eval_raw.content | b64decode }}"
    max_items: 30
    max_tokens: 12
    concurrency: 2
    min_score: 0.8
    workdir: /srv/b300-pd/.cache/pd-verify/local
    api_key: "{{ pd_verify_api_key }}"
  delegate_to: localhost
  register: acc
"""

RETURN = r"""
accuracy:
  description: The accuracy step of the verify report.
  returned: always
  type: dict
  contains:
    ok: {description: Passed (score >= min_score and lm_eval succeeded)., type: bool}
    score: {description: The task's O(metric) (null when lm_eval gave none)., type: float}
    n: {description: Items scored., type: int}
    n_available: {description: Items in the task's data set., type: int}
    failed_items: {description: "Up to 10 items scored 0 (id, prompt, output, expected).", type: list}
    errors: {description: Why the step failed., type: list}
  sample: {ok: true, task: tiny_pd, metric: "acc,none", score: 1.0, min_score: 0.8, n: 30, n_available: 200}
argv:
  description: The lm_eval command (no key in it).
  returned: always
  type: list
  elements: str
result_file:
  description: Where RV(accuracy) was written (not in check mode).
  returned: when run
  type: str
"""

import glob  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402 (community.general layout)

DATA_FILE = "pd_verify_accuracy.jsonl"
OUTPUT_DIR = "lm_eval-output"
RESULT_FILE = "accuracy.json"
TIMEOUT_RC = 124  # coreutils timeout: the command ran past its limit


def parse_items(items=None, items_jsonl=None, source="items"):
    """Eval items -> [{id, prompt, answers}]; ValueError naming the item and the field on bad input."""
    raw = []
    if items_jsonl is not None:
        for n, line in enumerate(items_jsonl.splitlines(), 1):
            if not line.strip():
                continue
            try:
                raw.append((f"{source} line {n}", json.loads(line)))
            except ValueError as e:
                raise ValueError(f"{source} line {n} is not JSON ({e}): give one JSON object per line") from e
    else:
        raw = [(f"{source} item {n}", it) for n, it in enumerate(items or [], 1)]
    out = []
    for where, it in raw:
        if not isinstance(it, dict):
            raise ValueError(f"{where} is {type(it).__name__}, not a mapping with prompt/question and answer")
        prompt = it.get("prompt") or it.get("question")
        answers = it.get("answers", it.get("answer"))
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where} has no 'prompt' (or 'question') text: add the text the model is asked")
        if not isinstance(answers, list):
            answers = [answers]
        answers = [a for a in answers if a is not None and str(a).strip()]
        if not answers:
            raise ValueError(f"{where} has no 'answer' (or 'answers' list): add the accepted answer(s)")
        out.append({"id": str(it.get("id", len(out) + 1)), "prompt": prompt, "answers": [str(a) for a in answers]})
    if not out:
        raise ValueError(f"{source} has no eval items: set pd_verify_accuracy_items or the eval file")
    return out


def build_argv(p, output_dir):
    """The lm_eval argv for the module's parameters ``p`` (never the key: lm_eval reads OPENAI_API_KEY)."""
    endpoint = "/v1/chat/completions" if p["chat"] else "/v1/completions"
    model_args = {
        "model": p["model"],
        "base_url": p["base_url"].rstrip("/") + endpoint,
        "num_concurrent": max(1, int(p["concurrency"])),
        "max_retries": 3,
        "timeout": int(p["request_timeout_s"]),
        # Plain-text requests, no tokenizer download: the front door's model tokenizes.
        "tokenizer_backend": None,
        "tokenized_requests": False,
    }
    gen_kwargs = dict(p.get("gen_kwargs") or {})
    if int(p.get("max_tokens") or 0) > 0:
        gen_kwargs["max_gen_toks"] = int(p["max_tokens"])
    argv = ["timeout", "--kill-after=10", str(int(p["timeout_s"])), p["lm_eval"], "run",
            "--model", "local-chat-completions" if p["chat"] else "local-completions",
            "--model_args", json.dumps(model_args, sort_keys=True),
            "--tasks", p["task"]]
    if p["chat"]:
        argv.append("--apply_chat_template")
    if p.get("include_path"):
        argv += ["--include_path", p["include_path"]]
    if gen_kwargs:
        argv += ["--gen_kwargs", json.dumps(gen_kwargs, sort_keys=True)]
    if int(p.get("max_items") or 0) > 0:
        argv += ["--limit", str(int(p["max_items"]))]
    argv += ["--output_path", output_dir, "--log_samples"]
    return argv


def lm_eval_environ(api_key, workdir):
    """lm_eval's environment: the key, and Hugging Face caches kept in workdir and offline (the data is local)."""
    return {
        "OPENAI_API_KEY": api_key or "",
        "HF_HOME": os.path.join(workdir, "hf"),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _newest(pattern):
    files = glob.glob(pattern, recursive=True)
    return max(files, key=os.path.getmtime) if files else None


def read_outputs(output_dir, task):
    """(results document, list of sample records) lm_eval wrote under output_dir; (None, []) when none."""
    results_file = _newest(os.path.join(output_dir, "**", "results_*.json"))
    if results_file is None:
        return None, []
    with open(results_file, encoding="utf-8") as f:
        results = json.load(f)
    samples = []
    samples_file = _newest(os.path.join(output_dir, "**", f"samples_{task}_*.jsonl"))
    if samples_file:
        with open(samples_file, encoding="utf-8") as f:
            samples = [json.loads(line) for line in f if line.strip()]
    return results, samples


def _failed_items(samples, metric_name, limit=10):
    out = []
    for s in samples:
        value = s.get(metric_name)
        if value is None or float(value) >= 1.0:
            continue
        doc = s.get("doc") or {}
        resp = s.get("filtered_resps") or s.get("resps") or [""]
        while isinstance(resp, list):
            resp = resp[0] if resp else ""
        out.append({"id": doc.get("id", s.get("doc_id")), "prompt": str(doc.get("prompt", ""))[:200],
                    "output": str(resp)[:200], "expected": doc.get("answers", s.get("target"))})
        if len(out) >= limit:
            break
    return out


def summarize(results, samples, *, task, metric, min_score, reference_scores, rc=0, output_tail=""):
    """The verify report's accuracy step from lm_eval's results (None when it wrote none) and exit status."""
    step = {"ok": False, "task": task, "metric": metric, "score": None, "min_score": float(min_score),
            "n": None, "n_available": None, "failed_items": [], "reference_scores": dict(reference_scores or {}),
            "errors": []}
    if rc == TIMEOUT_RC:
        step["errors"].append("accuracy: lm_eval did not finish within pd_verify_accuracy_timeout_s; "
                              f"its last output: {output_tail}")
        return step
    if results is None:
        step["errors"].append(f"accuracy: lm_eval exited with status {rc} and wrote no result; its last output: "
                              f"{output_tail}")
        return step
    if rc != 0:
        step["errors"].append(f"accuracy: lm_eval exited with status {rc}; its last output: {output_tail}")
        return step
    task_results = (results.get("results") or {}).get(task)
    if task_results is None:
        step["errors"].append(f"accuracy: lm_eval's results have no task '{task}' (it has "
                              f"{sorted((results.get('results') or {}).keys())}); pd_verify_accuracy_task must "
                              "name one task, not a group")
        return step
    if metric not in task_results:
        have = sorted(k for k in task_results if "," in k and "_stderr" not in k)
        step["errors"].append(f"accuracy: task '{task}' has no metric '{metric}' (it has {have}); set "
                              "pd_verify_accuracy_metric to one of them")
        return step
    score = float(task_results[metric])
    counts = (results.get("n-samples") or {}).get(task) or {}
    step.update({"score": round(score, 4), "n": counts.get("effective", len(samples)),
                 "n_available": counts.get("original"), "lm_eval_version": results.get("lm_eval_version"),
                 "evaluation_seconds": round(float(results.get("total_evaluation_time_seconds") or 0), 1),
                 "failed_items": _failed_items(samples, metric.split(",")[0])})
    if score < float(min_score):
        step["errors"].append(f"accuracy {score:.3f} ({task}, {metric}) below pd_verify_accuracy_min {min_score}")
    step["ok"] = not step["errors"]
    return step


def mask(text, secret):
    return text.replace(secret, "********") if secret else text


def run_module():
    module = AnsibleModule(
        argument_spec=dict(
            lm_eval=dict(type="path", required=True),
            base_url=dict(type="str", required=True),
            model=dict(type="str", required=True),
            task=dict(type="str", required=True),
            include_path=dict(type="path", default=""),
            items=dict(type="list", elements="dict"),
            items_jsonl=dict(type="str"),
            items_source=dict(type="str", default="items"),
            chat=dict(type="bool", default=False),
            max_items=dict(type="int", default=0),
            max_tokens=dict(type="int", default=0, no_log=False),  # a token count, not a secret
            gen_kwargs=dict(type="dict", default={}),
            concurrency=dict(type="int", default=1),
            request_timeout_s=dict(type="int", default=600),
            timeout_s=dict(type="int", default=900),
            metric=dict(type="str", default="acc,none"),
            min_score=dict(type="float", required=True),
            reference_scores=dict(type="dict", default={}),
            workdir=dict(type="path", required=True),
            api_key=dict(type="str", default="", no_log=True),
        ),
        mutually_exclusive=[("items", "items_jsonl")],
        required_one_of=[("items", "items_jsonl")],
        supports_check_mode=True,
    )
    p = module.params
    try:
        items = parse_items(p["items"], p["items_jsonl"], p["items_source"])
    except ValueError as e:
        module.fail_json(msg=f"pd_verify_lmeval: {e}")
    if not 0.0 <= p["min_score"] <= 1.0:
        module.fail_json(msg=f"pd_verify_lmeval: min_score {p['min_score']} is not in 0..1 "
                             "(pd_verify_accuracy_min is a fraction, e.g. 0.8)")
    if p["include_path"] and not os.path.isdir(p["include_path"]):
        module.fail_json(msg=f"pd_verify_lmeval: include_path {p['include_path']} is not a directory")
    output_dir = os.path.join(p["workdir"], OUTPUT_DIR)
    argv = build_argv(p, output_dir)
    if not (os.path.isfile(p["lm_eval"]) and os.access(p["lm_eval"], os.X_OK)):
        module.fail_json(msg=f"pd_verify_lmeval: {p['lm_eval']} is not an executable: run scripts/bootstrap "
                             "(stage 47-lm-eval makes .cache/lmeval-venv) or set pd_verify_accuracy_lm_eval",
                         argv=argv)
    if module.check_mode:
        module.exit_json(changed=False, argv=argv, items=len(items),
                         accuracy={"ok": True, "skipped": True, "task": p["task"], "n_available": len(items)})

    os.makedirs(p["workdir"], mode=0o700, exist_ok=True)
    with open(os.path.join(p["workdir"], DATA_FILE), "w", encoding="utf-8") as f:
        for it in items:
            f.write(json.dumps(it, sort_keys=True) + "\n")
    shutil.rmtree(output_dir, ignore_errors=True)  # only this run's results are read back
    t0 = time.monotonic()
    rc, out, err = module.run_command(argv, cwd=p["workdir"],
                                      environ_update=lm_eval_environ(p["api_key"], p["workdir"]))
    seconds = round(time.monotonic() - t0, 1)
    tail = mask(((out or "") + (err or ""))[-1500:], p["api_key"])
    results, samples = read_outputs(output_dir, p["task"])
    step = summarize(results, samples, task=p["task"], metric=p["metric"], min_score=p["min_score"],
                     reference_scores=p["reference_scores"], rc=rc, output_tail=tail)
    step.update({"seconds": seconds, "argv": argv, "rc": rc, "items_source": p["items_source"],
                 "output_dir": output_dir})
    result_file = os.path.join(p["workdir"], RESULT_FILE)
    with open(result_file, "w", encoding="utf-8") as f:
        json.dump(step, f, indent=2, sort_keys=True)
    module.exit_json(changed=False, argv=argv, accuracy=step, result_file=result_file)


def main():
    run_module()


if __name__ == "__main__":
    main()
