# Copyright: b300-pd contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The warm-up of one vLLM instance before it takes traffic: which requests, for which request features.

A vLLM engine compiles or first runs some code paths only when a request needs them: right after a restart the first
request with ``logprobs: 1`` took 15.5 s on a prefill instance of the embedded default, the next 0.02 s (issue #31).
The warm-up that pd_verify and pd_rollout run before an instance goes (back) into the routers therefore sends one
request per feature clients use. The feature list is inventory data (``pd_warmup_features``, default: all of
FEATURES); a feature the instance cannot serve by its flags (a tools request without --enable-auto-tool-choice and a
--tool-call-parser, a reasoning request without --reasoning-parser) is skipped with the reason, never sent.

Pure functions, no I/O: plugins/modules/pd_instance_warmup.py sends the requests (and sizes the prompts with the
instance's /tokenize through ``count``).
"""

from __future__ import annotations

import json
import random

FIELD = "pd_warmup_features"
# The request features, in the order they are warmed (plain completions first, at every configured context length).
FEATURES = ("completion", "logprobs", "prompt_logprobs", "n", "chat", "tools", "reasoning", "structured_output",
            "stream")
DEFAULT_FEATURES = FEATURES
FEATURE_HELP = {
    "completion": "plain /v1/completions, greedy, at every configured context length",
    "logprobs": "/v1/completions with logprobs: 1 and /v1/chat/completions with logprobs, top_logprobs: 1",
    "prompt_logprobs": "/v1/completions with prompt_logprobs: 1 (vLLM's extension)",
    "n": "/v1/completions with n: 2, a seed and temperature 0.8 (parallel sampling)",
    "chat": "/v1/chat/completions (the chat template)",
    "tools": ("/v1/chat/completions with a tools list and tool_choice auto (--enable-auto-tool-choice, "
              "--tool-call-parser)"),
    "reasoning": "/v1/chat/completions through the reasoning parser (--reasoning-parser)",
    "structured_output": "/v1/chat/completions with response_format json_schema (vLLM's structured outputs)",
    "stream": "/v1/completions and /v1/chat/completions with stream and stream_options.include_usage",
}
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# Tokens kept free below the model window besides the output tokens: a chat template's own tokens, the BOS token.
WINDOW_MARGIN = 64
# The prompt of the features warmed at the shortest context when no context length is configured.
SHORT_PROMPT_TOKENS = 32
# Without the instance's /tokenize: the most tokens a word of the filler text can take (byte-level BPE: one token per
# byte, the longest word has 7 letters, plus its space), so a prompt never exceeds the window.
WORST_TOKENS_PER_WORD = 8.0

_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango uniform victor whiskey xray yankee zulu river stone cloud light north "
          "south green amber copper silver garden window market valley harbor signal").split()

WARMUP_TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
WARMUP_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "pd_warmup",
        "schema": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    },
}


class WarmupError(ValueError):
    """The warm-up input is unusable; the message names the field and the fix."""


def check_features(features, field=FIELD):
    """The feature list, validated (a list of known names; duplicates dropped, order kept). Raises WarmupError
    naming ``field`` and the allowed names."""
    allowed = ", ".join(FEATURES)
    if features is None:
        return list(DEFAULT_FEATURES)
    if isinstance(features, (str, bytes)) or not isinstance(features, (list, tuple)):
        raise WarmupError(f"field {field}: must be a list of feature names (allowed: {allowed}), got "
                          f"{type(features).__name__} {features!r}")
    unknown = [f for f in features if not isinstance(f, str) or f not in FEATURES]
    if unknown:
        raise WarmupError(f"field {field}: unknown feature(s) {', '.join(repr(f) for f in unknown)}; allowed: "
                          f"{allowed}")
    out = []
    for f in features:
        if f not in out:
            out.append(f)
    return out


def merge_flags(*layers):
    """One instance's vLLM flags from layers in the order pd_recipe.build_flags applies them (pd_vllm_flags_common,
    pd_vllm_flags_pool[pool], the instance's extra_flags): long names with dashes, a later layer wins."""
    flags = {}
    for layer in layers:
        if layer is None:
            continue
        if not isinstance(layer, dict):
            raise WarmupError(f"flags: each layer must be a mapping of flag name -> value, got {layer!r}")
        for key, value in layer.items():
            flags[str(key).replace("_", "-")] = value
    return flags


def _on(value):
    if isinstance(value, str):
        return value.strip().lower() in ("true", "yes", "on", "1")
    return bool(value)


def _set(value):
    return value is not None and value is not False and str(value).strip() != ""


def _int(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def skip_reason(feature, flags):
    """Why the instance with these flags cannot serve ``feature`` (None: it can)."""
    flags = merge_flags(flags)
    chat_based = feature in ("chat", "tools", "reasoning", "structured_output")
    if _on(flags.get("skip-tokenizer-init")) and (chat_based or feature == "stream"):
        return "the instance runs --skip-tokenizer-init: no chat template, no detokenized text"
    if feature in ("logprobs", "prompt_logprobs") and _int(flags.get("max-logprobs")) == 0:
        return "the instance runs --max-logprobs 0: it refuses every logprobs request"
    if feature == "tools":
        missing = [f"--{f}" for f in ("enable-auto-tool-choice", "tool-call-parser")
                   if not (_on(flags.get(f)) if f == "enable-auto-tool-choice" else _set(flags.get(f)))]
        if missing:
            return (f"the instance runs without {' and '.join(missing)}: it refuses tool_choice auto "
                    "(set both in pd_vllm_flags_common to serve tool calls)")
    if feature == "reasoning" and not _set(flags.get("reasoning-parser")):
        return "the instance runs without --reasoning-parser: no reasoning path to warm"
    return None


def context_plan(context_tokens, max_model_len, max_tokens):
    """The configured context lengths (tokens), clipped to the model window minus the output tokens and a margin,
    sorted, unique. Empty input: [] (the features then use a short prompt)."""
    lengths = []
    for value in context_tokens or []:
        n = _int(value)
        if n is None or n < 1:
            raise WarmupError(f"context_tokens: {value!r} is not a positive number of tokens")
        lengths.append(n)
    window = _int(max_model_len)
    if window:
        limit = window - int(max_tokens) - WINDOW_MARGIN
        if limit < 1:
            raise WarmupError(f"max_model_len {window} leaves no room for a prompt and {max_tokens} output tokens")
        lengths = [min(n, limit) for n in lengths]
    return sorted(set(lengths))


def word_prompt(n_words, seed):
    """n_words filler words, reproducible from seed (the same text on every instance and run)."""
    rng = random.Random(seed)  # noqa: S311 - reproducible filler text, not crypto
    return " ".join(rng.choice(_WORDS) for _word in range(max(1, int(n_words))))


def make_prompt(n_tokens, seed, count=None):
    """A prompt of about n_tokens (never more when ``count`` answers): ``count(text) -> tokens or None`` is the
    instance's tokenizer; without it the words are counted at WORST_TOKENS_PER_WORD. Returns (text, tokens or None)."""
    per_word = None
    if count is not None:
        probe = count(word_prompt(200, 12345))
        if probe:
            per_word = probe / 200.0
    if not per_word:
        return word_prompt(max(1, int(n_tokens / WORST_TOKENS_PER_WORD)), seed), None
    n_words = max(1, int(n_tokens / per_word))
    text = word_prompt(n_words, seed)
    tokens = count(text)
    for _attempt in range(3):
        if not tokens or tokens <= n_tokens or n_words == 1:
            break
        n_words = max(1, int(n_words * n_tokens / tokens) - 1)
        text = word_prompt(n_words, seed)
        tokens = count(text)
    return text, tokens


def warmup_plan(features, model, context_tokens=(), *, flags=None, max_tokens=8, max_model_len=None, count=None):
    """The warm-up of one instance: {"requests": [{"feature", "path", "body", "context_tokens"}], "skipped":
    {feature: reason}, "features": [the validated list]}.

    completion runs at every configured context length (the longest included), every other feature at the shortest
    (a short prompt when none is configured). flags: the instance's vLLM flags (a dict; merge_flags for layers);
    max_model_len: the window the lengths are clipped to (default the flags' max-model-len); count: the instance's
    tokenizer (make_prompt)."""
    features = check_features(features)
    flags = merge_flags(flags or {})
    max_tokens = int(max_tokens)
    if max_tokens < 1:
        raise WarmupError(f"max_tokens: {max_tokens} must be >= 1")
    window = max_model_len if _int(max_model_len) else flags.get("max-model-len")
    lengths = context_plan(context_tokens, window, max_tokens)
    shortest = lengths[0] if lengths else SHORT_PROMPT_TOKENS
    prompts = {}

    def prompt(n_tokens):
        if n_tokens not in prompts:
            prompts[n_tokens] = make_prompt(n_tokens, 100 + n_tokens, count)
        return prompts[n_tokens][0]

    def completion(n_tokens, **extra):
        return dict({"model": model, "prompt": prompt(n_tokens), "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True}, **extra)

    def chat(n_tokens, **extra):
        return dict({"model": model, "messages": [{"role": "user", "content": prompt(n_tokens)}],
                     "max_tokens": max_tokens, "temperature": 0}, **extra)

    stream = {"stream": True, "stream_options": {"include_usage": True}}
    build = {
        "completion": lambda: [(COMPLETIONS, n, completion(n)) for n in (lengths or [shortest])],
        "logprobs": lambda: [(COMPLETIONS, shortest, completion(shortest, logprobs=1)),
                             (CHAT, shortest, chat(shortest, logprobs=True, top_logprobs=1))],
        "prompt_logprobs": lambda: [(COMPLETIONS, shortest, completion(shortest, prompt_logprobs=1))],
        "n": lambda: [(COMPLETIONS, shortest, completion(shortest, n=2, seed=1234, temperature=0.8))],
        "chat": lambda: [(CHAT, shortest, chat(shortest))],
        "tools": lambda: [(CHAT, shortest, chat(shortest, tools=WARMUP_TOOLS, tool_choice="auto"))],
        "reasoning": lambda: [(CHAT, shortest, chat(shortest, include_reasoning=True))],
        "structured_output": lambda: [(CHAT, shortest, chat(shortest, response_format=WARMUP_SCHEMA))],
        "stream": lambda: [(COMPLETIONS, shortest, completion(shortest, **stream)),
                           (CHAT, shortest, chat(shortest, **stream))],
    }
    requests, skipped = [], {}
    for feature in features:
        reason = skip_reason(feature, flags)
        if reason:
            skipped[feature] = reason
            continue
        for path, n_tokens, body in build[feature]():
            requests.append({"feature": feature, "path": path, "body": body, "context_tokens": n_tokens,
                             "prompt_tokens": prompts[n_tokens][1]})
    return {"features": features, "requests": requests, "skipped": skipped}


def warmup_requests(features, model, context_tokens=(), **kw):
    """The requests of warmup_plan (features skipped by the instance's flags left out)."""
    return warmup_plan(features, model, context_tokens, **kw)["requests"]


def check_response(feature, body, status, text):
    """The problem with one warm-up answer, or None. A 200 must carry choices (n: as many as asked; a stream: data
    chunks and [DONE])."""
    if status != 200:
        return f"HTTP {status}: {text[:300]}"
    if body.get("stream"):
        chunks = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        if not chunks or chunks[-1] != "[DONE]":
            return f"the stream did not end with data: [DONE]: {text[-300:]!r}"
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return f"the answer is not JSON: {text[:300]!r}"
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or not choices:
        return f"the answer has no choices: {text[:300]}"
    want = int(body.get("n") or 1)
    if len(choices) != want:
        return f"{len(choices)} choices for n: {want}"
    return None
