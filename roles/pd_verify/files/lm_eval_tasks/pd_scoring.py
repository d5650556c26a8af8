"""Scoring of the pd_verify lm-evaluation-harness tasks (tiny_pd, pd_smoke_qa), loaded by their YAML.

The same normalisation the hand-written accuracy loop used before (lower case, punctuation other than '.' and '-'
to spaces, whitespace collapsed), so scores stay comparable with earlier verify reports:
  prefix    the normalised reply starts with a normalised answer (tiny_pd: the model copies or reverses three
            words, then stops)
  contains  a normalised answer appears in the normalised reply as a whole word or number (pd_smoke_qa: a chat
            model may write a short sentence around the answer)
Each item of pd_verify_accuracy.jsonl carries ``answers``: the accepted answers (the role writes that file).
"""

from __future__ import annotations

import re


def normalize(text):
    return re.sub(r"\s+", " ", re.sub(r"[^0-9a-z\s.-]", " ", str(text).lower())).strip()


def matches(output, answers, mode):
    """True when ``output`` matches one of ``answers`` under ``mode`` (prefix, contains or exact)."""
    out = normalize(output)
    for answer in answers:
        want = normalize(answer)
        if not want:
            continue
        if mode == "exact" and out == want:
            return True
        if mode == "prefix" and out.startswith(want):
            return True
        if mode == "contains" and re.search(r"(^|[^0-9a-z])" + re.escape(want) + r"($|[^0-9a-z])", out):
            return True
    return False


def _answers(doc):
    ans = doc.get("answers")
    if ans is None:
        ans = doc.get("answer")
    return ans if isinstance(ans, list) else [ans]


def process_results_prefix(doc, results):
    return {"acc": float(matches(results[0], _answers(doc), "prefix"))}


def process_results_contains(doc, results):
    return {"acc": float(matches(results[0], _answers(doc), "contains"))}


def process_results_exact(doc, results):
    return {"acc": float(matches(results[0], _answers(doc), "exact"))}
