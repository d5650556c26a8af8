"""Prompts of about N tokens for pd_verify: reproducible filler words, calibrated with the server's /tokenize."""

from __future__ import annotations

import random

from .client import HttpError, http_post_json

_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango uniform victor whiskey xray yankee zulu river stone cloud light north "
          "south green amber copper silver garden window market valley harbor signal").split()


def word_prompt(n_words, seed):
    """n_words random words (about 1.0-1.3 tokens each), reproducible from seed."""
    rng = random.Random(seed)  # noqa: S311 - reproducible filler text, not crypto
    return " ".join(rng.choice(_WORDS) for _word in range(max(1, n_words)))


class PromptMaker:
    """Builds prompts of about N tokens, calibrated with the server's /tokenize when available."""

    def __init__(self, tokenize_url=None, model=None, timeout=30.0, api_key=None):
        self.tokenize_url, self.model, self.timeout, self.api_key = tokenize_url, model, timeout, api_key
        self.tokens_per_word = None

    def count(self, prompt):
        if not self.tokenize_url:
            return None
        try:
            r = http_post_json(self.tokenize_url, {"model": self.model, "prompt": prompt},
                               timeout=self.timeout, api_key=self.api_key)
        except HttpError:
            return None
        return r.get("count") if isinstance(r.get("count"), int) else len(r.get("tokens") or [])

    def make(self, n_tokens, seed):
        if self.tokens_per_word is None:
            probe = word_prompt(200, 12345)
            c = self.count(probe)
            self.tokens_per_word = (c / 200.0) if c else 1.3
        n_words = max(1, int(n_tokens / self.tokens_per_word))
        prompt = word_prompt(n_words, seed)
        c = self.count(prompt)
        if c and c > n_tokens:  # trim to stay inside the model window
            prompt = word_prompt(max(1, int(n_words * n_tokens / c) - 1), seed)
            c = self.count(prompt)
        return prompt, c
