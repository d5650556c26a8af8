"""Prometheus text exposition for pd_verify: parse a /metrics page, sum its samples by name and labels."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text):
    """Prometheus text exposition -> list of (name, {labels}, float value)."""
    out = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        m = _SAMPLE.match(stripped)
        if not m:
            continue
        try:
            val = float(m.group(4))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        out.append((m.group(1), labels, val))
    return out


def metric_sum(samples, name, /, **label_filter):
    """Sum of samples named ``name`` whose labels match ``label_filter``; None if no such sample. (Positional-only:
    a label may itself be called ``name`` or ``samples``.)"""
    vals = [v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in label_filter.items())]
    return sum(vals) if vals else None


def metric_names(samples, pattern):
    rx = re.compile(pattern)
    return sorted({n for n, _labels, _value in samples if rx.search(n)})


def kv_metrics(samples, names):
    """The decode-side KV counters the check relies on, by configured metric names."""
    src = names["by_source"]
    return {
        "kv_transfer_tokens": metric_sum(samples, src, source=names["source_kv"]),
        "local_compute_tokens": metric_sum(samples, src, source=names["source_local"]),
        "nixl_transfers": metric_sum(samples, names["xfer_count"]),
        # Optional: failed transfers (absent until the first failure on some versions; None = not configured).
        "nixl_failed": metric_sum(samples, names["failed_count"]) if names.get("failed_count") else None,
    }
