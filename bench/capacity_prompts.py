"""The prompts of a capacity run: what each `vllm bench serve` run sends.

``words`` (the default): distinct prompts of the context's length made of pd_verify's reproducible filler words
(roles/pd_verify/files/pd_verify/prompts.py: the prompts of verify, bench/pd_load.py and bench/pd_overload.py), one
seed per request, written to a JSONL file for vLLM's ``custom`` dataset. No two share a prefix, so the prefix cache
serves none of them, as it serves none of pd_overload's: the search's max rate and the overload's goodput are
measured on the same kind of request.

``random``: vLLM's random dataset. Its request i is the token sequence (offset_i + i + k) mod vocab, which repeats
every vocab tokens; on a small vocabulary two requests often start at the same token and are then the same prompt
(the tiny model's 512 tokens: 32-36 % of the prompt tokens of a search's point were prefix-cache hits, 2026-12-07),
so it measures a lighter load than distinct prompts. On a large vocabulary (GLM-5.2) collisions are rare.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from ansible_collections.b300.pd.bench.pd_load_request import request_prompt
from ansible_collections.b300.pd.roles.pd_verify.files.pd_verify.prompts import word_prompt

PROMPT_KINDS = ("words", "random")
_CALIBRATION_WORDS = 2000
_CALIBRATION_SEED = 12345
# Tokens of the text on stdin by the tokenizer in argv[1], run with the vLLM venv's Python (transformers is there);
# first, pandas, which `vllm bench serve` reads the prompts file with (exit 3 without it: said before any point runs).
_COUNT_TOKENS = ("import sys\ntry:\n    import pandas  # noqa: F401\nexcept ImportError:\n    sys.exit(3)\n"
                 "from transformers import AutoTokenizer\n"
                 "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
                 "print(len(tok(sys.stdin.read(), add_special_tokens=False)['input_ids']))\n")
_REQUIREMENTS = "bench/requirements-vllm-bench.txt"


class PromptError(RuntimeError):
    """The tokenizer could not be run or gave no count: the message says which and how to fix it."""


def tokens_per_word(vllm_python: str, tokenizer: str) -> float:
    """Tokens per filler word by --tokenizer (measured once per run on 2000 words)."""
    text = word_prompt(_CALIBRATION_WORDS, _CALIBRATION_SEED)
    proc = subprocess.run([vllm_python, "-c", _COUNT_TOKENS, tokenizer], input=text, capture_output=True,
                          text=True, check=False, timeout=300)
    out = (proc.stdout or "").strip()
    if proc.returncode == 3:
        raise PromptError(f"--vllm-python {vllm_python}: no pandas there, which `vllm bench serve` reads --prompts "
                          f"words with (vLLM's bench extra): pip install --no-deps --require-hashes -r {_REQUIREMENTS} "
                          "into that venv (scripts/bootstrap --local does on the control node), or --prompts random")
    if proc.returncode != 0 or not out.isdigit() or int(out) <= 0:
        tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
        raise PromptError(f"--tokenizer {tokenizer}: counting the prompts' tokens with {vllm_python} failed "
                          f"(exit {proc.returncode}: {tail}); give a model directory or HF id its transformers "
                          "can load, or --prompts random")
    return int(out) / _CALIBRATION_WORDS


def words_for(context: int, per_word: float) -> int:
    """Filler words for a prompt of about `context` tokens."""
    return max(1, round(context / per_word))


def write_prompts(path: Path, context: int, per_word: float, num_prompts: int, seed: int) -> Path:
    """num_prompts distinct prompts of about `context` tokens as vLLM's custom dataset (one {"prompt": ...} per
    line); request i's prompt is pd_load's request_prompt(words, seed, i), so a run is reproducible from its seed."""
    n_words = words_for(context, per_word)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i in range(num_prompts):
            f.write(json.dumps({"prompt": request_prompt(n_words, seed, i)}) + "\n")
    return path


def dataset_args(kind: str, context: int, output_len: int, prompts_file: Path | None) -> list[str]:
    """`vllm bench serve` dataset arguments for one run."""
    if kind == "random":
        return ["--dataset-name", "random", "--random-input-len", str(context),
                "--random-output-len", str(output_len), "--random-range-ratio", "0"]
    if kind != "words" or prompts_file is None:
        raise ValueError(f"prompts {kind!r}: one of {PROMPT_KINDS}, words with a prompts file")
    # The prompts as they are (no chat template: /v1/completions), each asked for output_len tokens.
    return ["--dataset-name", "custom", "--dataset-path", str(prompts_file), "--custom-output-len", str(output_len),
            "--skip-chat-template"]
