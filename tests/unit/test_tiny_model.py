"""The generated tiny model (.cache/model-src/tiny-pd, scripts/bootstrap.d/50-tiny-model): config, tokenizer
round-trip, chat template, eval set, manifest and REVISION. Runs after `scripts/bootstrap --local`; fails when
the model is missing unless PD_ALLOW_NO_VLLM=1 (then skips).

Tokenizer and chat template are checked with the `tokenizers` / `jinja2` libraries (present in the control venv
through ansible-core), so these tests need no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from ansible_collections.b300.pd.scripts import make_tiny_model as mtm

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / ".cache" / "model-src"
MODEL = SRC / "tiny-pd"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    if not (MODEL / "config.json").is_file():
        if os.environ.get("PD_ALLOW_NO_VLLM") == "1":
            pytest.skip(f"{MODEL} absent and PD_ALLOW_NO_VLLM=1")
        pytest.fail(f"{MODEL} is missing: run scripts/bootstrap --local (or set PD_ALLOW_NO_VLLM=1 to skip)")
    return MODEL


def _json(p: Path):
    return json.loads(p.read_text())


def test_config_is_a_tiny_llama_with_a_4096_window(model_dir):
    c = _json(model_dir / "config.json")
    assert c["architectures"] == ["LlamaForCausalLM"]
    assert c["model_type"] == "llama"
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]) == (128, 2, 4)
    assert c["max_position_embeddings"] >= 4096  # inventory/local serves --max-model-len 4096
    tok = _json(model_dir / "tokenizer.json")
    assert c["vocab_size"] >= len(tok["model"]["vocab"])
    assert (model_dir / "model.safetensors").stat().st_size > 0


_TOKENIZER_CHECK = r"""
import json, sys
from tokenizers import Tokenizer
d, words, bos, eos = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
tok = Tokenizer.from_file(d + "/tokenizer.json")
out = {"roundtrip": [], "multi": [], "first": tok.encode("cat").ids[0],
       "bos": tok.token_to_id(bos), "eos": tok.token_to_id(eos)}
for text in ["Q: copy cat dog fox\nA: cat dog fox", "\u00dcn\u00efc\u00f6d\u00e9 123 !? \t tabs", "x" * 300]:
    out["roundtrip"].append(tok.decode(tok.encode(text, add_special_tokens=False).ids) == text)
out["multi"] = [w for w in words if len(tok.encode(" " + w, add_special_tokens=False).ids) != 1]
print(json.dumps(out))
"""


def test_tokenizer_round_trip_and_words_are_single_tokens(model_dir):
    """Run with the vLLM venv's python: that is where `tokenizers` (the library vLLM loads it with) lives."""
    py = ROOT / ".cache" / "vllm-venv" / "bin" / "python"
    if not py.exists():
        pytest.fail(f"{py} missing: run scripts/bootstrap --local")
    r = subprocess.run([str(py), "-c", _TOKENIZER_CHECK, str(model_dir), json.dumps(mtm.WORDS), mtm.BOS, mtm.EOS],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["roundtrip"] == [True, True, True]
    assert out["multi"] == [], "these words are not single tokens"
    cfg = _json(model_dir / "config.json")
    assert out["first"] == cfg["bos_token_id"] == out["bos"]
    assert cfg["eos_token_id"] == out["eos"]


def _template(model_dir: Path) -> str:
    tc = _json(model_dir / "tokenizer_config.json")
    if tc.get("chat_template"):
        return tc["chat_template"]
    return (model_dir / "chat_template.jinja").read_text()


def test_chat_template_renders_the_trained_prompt(model_dir):
    tmpl = jinja2.Environment(autoescape=False).from_string(_template(model_dir))  # noqa: S701 (plain text)
    q = "copy cat dog fox"
    out = tmpl.render(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": q}],
                      bos_token=mtm.BOS, eos_token=mtm.EOS, add_generation_prompt=True)
    assert out == mtm.BOS + mtm.prompt_for(q)
    two = tmpl.render(messages=[{"role": "user", "content": q}, {"role": "assistant", "content": "cat dog fox"},
                                {"role": "user", "content": "reverse a b c"}], bos_token=mtm.BOS, eos_token=mtm.EOS)
    assert two == mtm.BOS + "Q: copy cat dog fox\nA: cat dog fox" + mtm.EOS + "\nQ: reverse a b c\nA:"


def test_eval_set_is_held_out_and_checkable(model_dir):
    items = [json.loads(line) for line in (model_dir / "eval.jsonl").read_text().splitlines()]
    assert len(items) >= 100
    report = _json(model_dir / "train_report.json")
    train, held = mtm.split_items(report["seed"], report["eval_items"])
    train_triples = {t for _task, t in train}
    for it in items:
        assert set(it) >= {"prompt", "question", "answer", "task"}
        words = tuple(it["question"].split()[1:])
        assert it["prompt"] == mtm.prompt_for(it["question"])
        assert it["answer"] == mtm.answer_for(it["task"], list(words))
        assert words not in train_triples, f"eval item {it['question']!r} was trained on"
    assert {it["task"] for it in items} == set(mtm.TASKS)
    assert report["eval_accuracy"] >= 0.9


def test_manifest_matches_the_files_and_revision(model_dir):
    m = _json(model_dir / "manifest.json")
    listed = {f["path"]: f for f in m["files"]}
    on_disk = {p.name for p in model_dir.iterdir() if p.is_file() and p.name != "manifest.json"}
    assert set(listed) == on_disk
    for name, f in listed.items():
        data = (model_dir / name).read_bytes()
        assert f["size"] == len(data), name
        assert f["sha256"] == hashlib.sha256(data).hexdigest(), name
    assert (SRC / "tiny-pd.REVISION").read_text().strip() == m["revision"]
    check = subprocess.run([sys.executable, str(ROOT / "scripts" / "model-manifest"), str(model_dir), "--check"],
                           check=False, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip() == m["revision"]


def test_model_files_are_world_readable(model_dir):
    for p in model_dir.iterdir():
        assert p.stat().st_mode & 0o044 == 0o044, f"{p.name} not readable by the vllm user after the copy"
