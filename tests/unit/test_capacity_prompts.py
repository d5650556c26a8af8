"""bench/capacity_prompts.py: the capacity search's prompts (distinct filler words by default, vLLM's random dataset
on request) and the tokenizer count they are sized by."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from ansible_collections.b300.pd.bench import capacity_prompts as cp


def test_words_prompts_are_distinct_reproducible_and_sized_by_tokens_per_word(tmp_path):
    path = cp.write_prompts(tmp_path / "p" / "c3072.jsonl", 3072, 5.0, 40, seed=7)
    texts = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
    assert len(texts) == 40 and len(set(texts)) == 40
    assert {len(t.split()) for t in texts} == {cp.words_for(3072, 5.0)} == {614}
    # no prefix in common beyond a word or two (the prefix cache's blocks are 16 tokens)
    assert len({tuple(t.split()[:4]) for t in texts}) == 40
    again = cp.write_prompts(tmp_path / "again.jsonl", 3072, 5.0, 40, seed=7).read_text()
    assert again == path.read_text()
    assert cp.write_prompts(tmp_path / "other.jsonl", 3072, 5.0, 40, seed=8).read_text() != again


def test_dataset_args_for_each_kind(tmp_path):
    assert cp.dataset_args("random", 256, 32, None) == [
        "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "32",
        "--random-range-ratio", "0"]
    f = tmp_path / "x.jsonl"
    assert cp.dataset_args("words", 256, 32, f) == [
        "--dataset-name", "custom", "--dataset-path", str(f), "--custom-output-len", "32", "--skip-chat-template"]
    with pytest.raises(ValueError, match="prompts file"):
        cp.dataset_args("words", 256, 32, None)


def test_tokens_per_word_runs_the_tokenizer_and_names_it_when_it_fails(monkeypatch):
    seen = {}

    def ok(cmd, **kw):
        seen.update(cmd=cmd, words=len(kw["input"].split()))
        return subprocess.CompletedProcess(cmd, 0, "2600\n", "")

    monkeypatch.setattr(subprocess, "run", ok)
    assert cp.tokens_per_word("/venv/bin/python", "/models/tiny") == 1.3
    assert seen["cmd"][0] == "/venv/bin/python" and seen["cmd"][-1] == "/models/tiny" and seen["words"] == 2000

    def broken(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "OSError: /models/nope is not a tokenizer\n")

    monkeypatch.setattr(subprocess, "run", broken)
    with pytest.raises(cp.PromptError, match=r"--tokenizer /models/nope: .*not a tokenizer.*--prompts random"):
        cp.tokens_per_word("/venv/bin/python", "/models/nope")

    def no_pandas(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 3, "", "")

    monkeypatch.setattr(subprocess, "run", no_pandas)
    with pytest.raises(cp.PromptError, match=r"--vllm-python /venv/bin/python: no pandas.*requirements-vllm-bench"):
        cp.tokens_per_word("/venv/bin/python", "/models/tiny")


def test_the_count_script_exits_3_without_pandas():
    """The calibration script itself, run by a Python without pandas (the control venv's has none)."""
    if importlib.util.find_spec("pandas") is not None:
        pytest.skip("this Python has pandas")
    proc = subprocess.run([sys.executable, "-c", cp._COUNT_TOKENS, "x"], input="a b", capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 3, proc.stderr


def test_tokens_per_word_with_the_tiny_models_tokenizer():
    """The real count, with the vLLM venv's transformers and the tiny model (what CI's search runs)."""
    root = Path(__file__).resolve().parents[2]
    py, tok = root / ".cache" / "vllm-venv" / "bin" / "python", root / ".cache" / "model-src" / "tiny-pd"
    if not (py.exists() and tok.exists()):
        pytest.skip("needs scripts/bootstrap --local (the vLLM venv and the tiny model)")
    assert 4.0 <= cp.tokens_per_word(str(py), str(tok)) <= 6.0  # pd_overload measured 5.0 tokens a word
