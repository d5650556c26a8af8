"""roles/pd_verify's accuracy step: lm-evaluation-harness (module pd_verify_lmeval, tasks in
templates/lm_eval_tasks).

Pure parts (items, argv from both inventories, results parsing, scoring, report merge) in-process; then the real
lm_eval of .cache/lmeval-venv (scripts/bootstrap.d/47-lm-eval; PD_LMEVAL names another one) run by the module's
main() against a stdlib fake OpenAI server over real HTTP: the key arrives as a Bearer header and never in argv,
wrong answers lower the score and fail the threshold, chat mode sends the chat_template_kwargs.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jinja2
import pytest
import yaml
from ansible_collections.b300.pd.plugins.modules import pd_verify_lmeval as lm
from ansible_collections.b300.pd.roles.pd_verify.files import pd_verify as pv
from ansible_collections.b300.pd.roles.pd_verify.files.lm_eval_tasks import pd_scoring as scoring
from ansible_collections.b300.pd.tests.unit.pd_testlib import load_inventory, run_module

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "pd_verify"
TEMPLATES = ROLE / "templates" / "lm_eval_tasks"
LM_EVAL = Path(os.environ.get("PD_LMEVAL", ROOT / ".cache" / "lmeval-venv" / "bin" / "lm_eval"))
KEY = "k" * 64


@functools.cache
def shipped_tasks() -> Path:
    """The shipped lm_eval tasks as tasks/accuracy.yml writes them: the templates rendered as Ansible renders them
    (Jinja2 with trim_blocks), beside files/lm_eval_tasks/pd_scoring.py."""
    out = Path(tempfile.mkdtemp(prefix="pd-lm-eval-tasks-"))
    env = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True, autoescape=False)  # noqa: S701 - YAML
    for template in TEMPLATES.glob("*.yaml.j2"):
        (out / template.name.removesuffix(".j2")).write_text(env.from_string(template.read_text()).render())
    shutil.copy(ROLE / "files" / "lm_eval_tasks" / "pd_scoring.py", out)
    return out


def params(inv_name, **over):
    """The module's parameters as tasks/accuracy.yml renders them from an inventory's verify.yml + role defaults."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    gv = {**defaults, **load_inventory(inv_name)["group_vars"]}
    p = {"lm_eval": "/repo/.cache/lmeval-venv/bin/lm_eval", "base_url": "http://10.237.0.13:8000", "model": "m",
         "task": gv["pd_verify_accuracy_task"], "include_path": str(shipped_tasks()),
         "chat": gv["pd_verify_accuracy_chat"],
         "max_items": gv["pd_verify_accuracy_max_items"], "max_tokens": gv["pd_verify_accuracy_max_tokens"],
         "gen_kwargs": gv["pd_verify_accuracy_gen_kwargs"], "concurrency": gv["pd_verify_accuracy_concurrency"],
         "request_timeout_s": gv["pd_verify_request_timeout_s"], "timeout_s": gv["pd_verify_accuracy_timeout_s"]}
    p.update(over)
    return p


def opt(argv, flag):
    return argv[argv.index(flag) + 1]


# ------------------------------------------------------------------------------------------ argv and items
def test_local_inventory_argv_runs_tiny_pd_as_completions_limited():
    argv = lm.build_argv(params("local"), "/w/out")
    assert argv[:4] == ["timeout", "--kill-after=10", "900", "/repo/.cache/lmeval-venv/bin/lm_eval"]
    assert argv[4] == "run" and opt(argv, "--model") == "local-completions" and opt(argv, "--tasks") == "tiny_pd"
    margs = json.loads(opt(argv, "--model_args"))
    assert margs == {"model": "m", "base_url": "http://10.237.0.13:8000/v1/completions", "num_concurrent": 2,
                     "max_retries": 3, "timeout": 600, "tokenizer_backend": None, "tokenized_requests": False}
    assert json.loads(opt(argv, "--gen_kwargs")) == {"max_gen_toks": 12}
    assert opt(argv, "--limit") == "30" and opt(argv, "--include_path") == str(shipped_tasks())
    assert "--apply_chat_template" not in argv and opt(argv, "--output_path") == "/w/out"


def test_b300_inventory_argv_asks_chat_turns_with_thinking_off():
    argv = lm.build_argv(params("b300", base_url="http://192.0.2.13:8000/"), "/w/out")
    assert opt(argv, "--model") == "local-chat-completions" and "--apply_chat_template" in argv
    assert opt(argv, "--tasks") == "pd_smoke_qa" and "--limit" not in argv
    assert json.loads(opt(argv, "--model_args"))["base_url"] == "http://192.0.2.13:8000/v1/chat/completions"
    assert json.loads(opt(argv, "--gen_kwargs")) == {"chat_template_kwargs": {"enable_thinking": False},
                                                     "max_gen_toks": 64}


def test_argv_carries_no_key_and_the_environment_does():
    argv = lm.build_argv(params("local"), "/w/out")
    assert not any(KEY in a for a in argv)
    env = lm.lm_eval_environ(KEY, "/w")
    assert env["OPENAI_API_KEY"] == KEY and env["HF_DATASETS_OFFLINE"] == "1" and env["HF_HOME"] == "/w/hf"


def test_items_from_eval_jsonl_and_inline():
    jsonl = ('{"task": "copy", "prompt": "Q: copy a b c\\nA:", "question": "copy a b c", "answer": "a b c"}\n\n'
             '{"question": "x?", "answers": ["1", "one"], "id": 7}\n')
    assert lm.parse_items(items_jsonl=jsonl) == [
        {"id": "1", "prompt": "Q: copy a b c\nA:", "answers": ["a b c"]},
        {"id": "7", "prompt": "x?", "answers": ["1", "one"]}]
    assert lm.parse_items(items=[{"question": "17*23?", "answer": 391}]) == [
        {"id": "1", "prompt": "17*23?", "answers": ["391"]}]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"items_jsonl": '{"prompt": "x"}\n', "source": "h:/m/eval.jsonl"}, "h:/m/eval.jsonl line 1 has no 'answer'"),
    ({"items_jsonl": '{"prompt": "x", "answer": "y"}\nnot json\n'}, "items line 2 is not JSON"),
    ({"items": [{"answer": "y"}], "source": "pd_verify_accuracy_items"},
     "pd_verify_accuracy_items item 1 has no 'prompt'"),
    ({"items": []}, "has no eval items"),
])
def test_bad_items_are_named(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        lm.parse_items(**kwargs)


def test_shipped_tasks_read_the_file_the_module_writes():
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: f"!function {node.value}")
    for task, fn in (("tiny_pd", "process_results_prefix"), ("pd_smoke_qa", "process_results_contains")):
        cfg = yaml.load((shipped_tasks() / f"{task}.yaml").read_text(), Loader=Loader)  # noqa: S506 - SafeLoader subclass
        assert cfg["task"] == task and cfg["dataset_path"] == "json"
        assert cfg["dataset_kwargs"]["data_files"] == {cfg["test_split"]: lm.DATA_FILE}
        assert cfg["process_results"] == f"!function pd_scoring.{fn}" and hasattr(scoring, fn)
        assert cfg["generation_kwargs"]["temperature"] == 0.0 and cfg["generation_kwargs"]["do_sample"] is False


# ------------------------------------------------------------------------------------------ scoring
@pytest.mark.parametrize(("output", "answers", "fn", "acc"), [
    (" cat dog fox</s>", ["cat dog fox"], "process_results_prefix", 1.0),
    (" fox dog cat", ["cat dog fox"], "process_results_prefix", 0.0),
    ("The answer is 391.", ["391"], "process_results_contains", 1.0),
    ("The answer is 3910.", ["391"], "process_results_contains", 0.0),
    ("canberra", ["Canberra"], "process_results_exact", 1.0),
    ("canberra city", ["Canberra"], "process_results_exact", 0.0),
])
def test_scoring_matches_the_old_prefix_contains_exact(output, answers, fn, acc):
    assert getattr(scoring, fn)({"answers": answers}, [output]) == {"acc": acc}


# ------------------------------------------------------------------------------------------ results
def results_doc(task="tiny_pd", acc=0.75, n=4, original=200):
    return {"results": {task: {"alias": task, "acc,none": acc, "acc_stderr,none": 0.2}},
            "n-samples": {task: {"original": original, "effective": n}}, "lm_eval_version": "0.4.13",
            "total_evaluation_time_seconds": "12.5"}


def test_summarize_score_threshold_and_wrong_items():
    samples = [{"doc": {"id": "1", "prompt": "Q: copy a b c\nA:", "answers": ["a b c"]}, "filtered_resps": [" a b c"],
                "acc": 1.0},
               {"doc": {"id": "2", "prompt": "Q: reverse a b c\nA:", "answers": ["c b a"]},
                "filtered_resps": [" a b c"], "acc": 0.0}]
    step = lm.summarize(results_doc(), samples, task="tiny_pd", metric="acc,none", min_score=0.8,
                        reference_scores={"aime_2025": 86.67})
    assert not step["ok"] and step["score"] == 0.75 and step["n"] == 4 and step["n_available"] == 200
    assert step["errors"] == ["accuracy 0.750 (tiny_pd, acc,none) below pd_verify_accuracy_min 0.8"]
    assert step["failed_items"] == [{"id": "2", "prompt": "Q: reverse a b c\nA:", "output": " a b c",
                                     "expected": ["c b a"]}]
    assert step["reference_scores"] == {"aime_2025": 86.67}
    assert lm.summarize(results_doc(acc=0.8), [], task="tiny_pd", metric="acc,none", min_score=0.8,
                        reference_scores={})["ok"]


@pytest.mark.parametrize(("results", "rc", "message"), [
    (None, 124, "did not finish within pd_verify_accuracy_timeout_s"),
    (None, 1, "lm_eval exited with status 1 and wrote no result; its last output: boom"),
    ("group", 0, "results have no task 'tiny_pd' (it has ['pd_smoke_qa'])"),
    ("metric", 0, "task 'tiny_pd' has no metric 'acc,none' (it has ['exact_match,strict-match'])"),
])
def test_summarize_failures_say_why(results, rc, message):
    if results == "group":
        results = results_doc(task="pd_smoke_qa")
    elif results == "metric":
        results = results_doc()
        results["results"]["tiny_pd"] = {"exact_match,strict-match": 1.0, "exact_match_stderr,strict-match": 0}
    step = lm.summarize(results, [], task="tiny_pd", metric="acc,none", min_score=0.8, reference_scores={}, rc=rc,
                        output_tail="boom")
    assert not step["ok"] and message in step["errors"][0]


# ------------------------------------------------------------------------------------------ report merge
def script_report(tmp_path):
    rep = {"started": "t0", "finished": "t1", "router_url": "http://r:8000", "model": "m", "inventory": "local",
           "steps": {"readiness": {"ok": True}, "warmup": {"ok": True}, "kv_transfer": {"ok": True},
                     "accuracy": {"ok": True, "skipped": True}, "sla": {"ok": True}},
           "ok": True, "failures": []}
    (tmp_path / "router.json").write_text(json.dumps(rep))
    return tmp_path / "router.json"


def test_merge_puts_accuracy_in_place_and_fails_the_report(tmp_path):
    step = lm.summarize(results_doc(), [], task="tiny_pd", metric="acc,none", min_score=0.8,
                        reference_scores={"aime_2025": 86.67, "gpqa_diamond": 92.89})
    (tmp_path / "acc.json").write_text(json.dumps(step))
    rc = pv.main(["--merge", str(script_report(tmp_path)), "--step-result", f"accuracy={tmp_path / 'acc.json'}",
                  "--json", str(tmp_path / "out.json"), "--markdown", str(tmp_path / "out.md")])
    out = json.loads((tmp_path / "out.json").read_text())
    md = (tmp_path / "out.md").read_text()
    rows = [line.split("|")[1].strip() for line in md.splitlines() if line.startswith("| ") and "step" not in line]
    assert rc == 1 and not out["ok"] and rows == ["readiness", "warmup", "kv_transfer", "accuracy", "sla"]
    assert out["failures"] == ["accuracy 0.750 (tiny_pd, acc,none) below pd_verify_accuracy_min 0.8"]
    assert "| accuracy | FAIL |" in md and "task `tiny_pd`, acc,none = **0.75** on 4 of 200 items" in md
    assert "reference scores (full benchmarks, not run by verify: docs/verify.md): aime_2025 86.67, gpqa_diamond" in md


@pytest.mark.parametrize(("spec", "message"), [("nonsense=x.json", "unknown step"), ("accuracy", "give STEP=FILE")])
def test_merge_refuses_bad_step_results(tmp_path, capsys, spec, message):
    (tmp_path / "x.json").write_text('{"ok": true}')
    spec = spec.replace("x.json", str(tmp_path / "x.json"))
    rc = pv.main(["--merge", str(script_report(tmp_path)), "--step-result", spec, "--json", str(tmp_path / "out.json")])
    assert rc == 2 and message in capsys.readouterr().err


def test_the_script_no_longer_scores_accuracy_itself():
    rep = pv.run_all({"router_url": "http://127.0.0.1:9", "model": "m", "steps": ["accuracy"],
                      "instances": [{"name": "p", "pool": "prefill", "url": "http://127.0.0.1:9"}]},
                     steps=("accuracy",))
    assert not rep["ok"] and "run by roles/pd_verify with lm-evaluation-harness" in rep["failures"][0]
    assert not hasattr(pv, "step_accuracy") and not hasattr(pv, "score_answer")


# ------------------------------------------------------------------------------------------ real lm_eval
class FakeOpenAI:
    """/v1/completions and /v1/chat/completions answering copy/reverse prompts; ``wrong`` prompts get a bad answer."""

    def __init__(self, wrong=()):
        self.requests, self.wrong = [], set(wrong)
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, self.headers.get("Authorization"), body))
                prompt = body.get("prompt") or body["messages"][-1]["content"]
                m = re.search(r"(copy|reverse) (\w+) (\w+) (\w+)", prompt)
                words = list(m.group(2, 3, 4))
                text = " " + " ".join(words[::-1] if (m.group(1) == "reverse") != (prompt in outer.wrong) else words)
                choice = {"index": 0, "finish_reason": "stop"}
                choice.update({"message": {"role": "assistant", "content": text}} if "messages" in body else
                              {"text": text})
                data = json.dumps({"choices": [choice]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


def need_lm_eval():
    if LM_EVAL.exists():
        return
    if os.environ.get("PD_ALLOW_NO_LMEVAL") == "1":
        pytest.skip(f"{LM_EVAL} absent and PD_ALLOW_NO_LMEVAL=1")
    pytest.fail(f"{LM_EVAL} is missing: run scripts/bootstrap (or set PD_ALLOW_NO_LMEVAL=1 to skip)")


ITEMS = [{"task": t, "prompt": f"Q: {t} {w}\nA:", "question": f"{t} {w}",
          "answer": w if t == "copy" else " ".join(w.split()[::-1])}
         for t, w in (("copy", "gold peach cherry"), ("reverse", "pink date dog"), ("copy", "fox pink frog"),
                      ("reverse", "red black melon"), ("copy", "cat owl lime"))]


def test_real_lm_eval_scores_tiny_pd_through_a_fake_front_door(tmp_path, monkeypatch):
    need_lm_eval()
    fake = FakeOpenAI(wrong={ITEMS[1]["prompt"]})
    try:
        args = dict(params("local", lm_eval=str(LM_EVAL), base_url=fake.url, model="tiny-pd", max_items=4),
                    items_jsonl="".join(json.dumps(i) + "\n" for i in ITEMS), items_source="h:/m/eval.jsonl",
                    metric="acc,none", min_score=0.8, reference_scores={}, workdir=str(tmp_path / "w"), api_key=KEY)
        result, failed = run_module(lm.main, args, monkeypatch=monkeypatch)
    finally:
        fake.close()
    acc = result["accuracy"]
    assert not failed and not result["changed"], result
    assert acc["rc"] == 0 and acc["score"] == 0.75 and acc["n"] == 4 and acc["n_available"] == 5, acc
    assert not acc["ok"] and "below pd_verify_accuracy_min 0.8" in acc["errors"][0]
    assert [f["id"] for f in acc["failed_items"]] == ["2"] and acc["failed_items"][0]["output"] == " pink date dog"
    assert len(fake.requests) == 4 and {r[0] for r in fake.requests} == {"/v1/completions"}
    assert {r[1] for r in fake.requests} == {f"Bearer {KEY}"}
    assert all(r[2]["temperature"] == 0.0 and r[2]["max_tokens"] == 12 and r[2]["model"] == "tiny-pd"
               for r in fake.requests)
    assert KEY not in json.dumps(result) and KEY not in (tmp_path / "w" / "accuracy.json").read_text()
    assert json.loads((tmp_path / "w" / "accuracy.json").read_text())["score"] == 0.75


def test_real_lm_eval_chat_mode_sends_chat_turns_with_template_kwargs(tmp_path, monkeypatch):
    need_lm_eval()
    fake = FakeOpenAI()
    try:
        args = dict(params("b300", lm_eval=str(LM_EVAL), base_url=fake.url, model="glm", task="pd_smoke_qa",
                           max_items=0, concurrency=2),
                    items=[{"question": i["question"], "answer": i["answer"]} for i in ITEMS[:3]],
                    metric="acc,none", min_score=0.9, reference_scores={"aime_2025": 86.67},
                    workdir=str(tmp_path / "w"), api_key=KEY)
        result, failed = run_module(lm.main, args, monkeypatch=monkeypatch)
    finally:
        fake.close()
    acc = result["accuracy"]
    assert not failed and acc["ok"] and acc["score"] == 1.0 and acc["n"] == 3, acc
    assert {r[0] for r in fake.requests} == {"/v1/chat/completions"}
    body = fake.requests[0][2]
    assert body["messages"][-1]["role"] == "user" and body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["max_tokens"] == 64 and acc["reference_scores"] == {"aime_2025": 86.67}


def test_check_mode_validates_items_and_sends_nothing(tmp_path, monkeypatch):
    fake_lm_eval = tmp_path / "lm_eval"
    fake_lm_eval.write_text("#!/bin/sh\nexit 3\n")
    fake_lm_eval.chmod(0o755)
    args = dict(params("local", lm_eval=str(fake_lm_eval)), items=[{"prompt": "x", "answer": "y"}],
                metric="acc,none", min_score=0.8, reference_scores={}, workdir=str(tmp_path / "w"), api_key=KEY)
    result, failed = run_module(lm.main, args, check_mode=True, monkeypatch=monkeypatch)
    assert not failed and result["accuracy"]["skipped"] and opt(result["argv"], "--tasks") == "tiny_pd"
    assert not (tmp_path / "w").exists()
    args["items"] = [{"prompt": "x"}]
    result, failed = run_module(lm.main, args, check_mode=True, monkeypatch=monkeypatch)
    assert failed and "item 1 has no 'answer'" in result["msg"]
    args.update(items=[{"prompt": "x", "answer": "y"}], lm_eval=str(tmp_path / "absent"))
    result, failed = run_module(lm.main, args, check_mode=True, monkeypatch=monkeypatch)
    assert failed and "run scripts/bootstrap (stage 47-lm-eval" in result["msg"]
