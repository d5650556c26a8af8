"""Verify a vLLM P/D deployment from a cluster peer (the router host). Standard library only.

Steps (each returns a JSON-able dict with ``ok`` and details):
  readiness    every instance: GET /health == 200 and /v1/models lists the served model; the router likewise
  warmup       every instance alone on every request feature (logprobs, chat, structured output, ...: roles/pd_verify
               runs module pd_instance_warmup before the script and hands its results in as warmup.instances), then
               through the router: concurrency 1..N at the shortest context, then the context range; a request
               that fails is retried once after 5 s (first NIXL handshake under load) and reported
  kv_transfer  the same greedy prompts via the router (P/D) and directly to one instance (colocated):
               identical token ids; decode /metrics deltas show KV transferred, not recomputed
  accuracy     not run here: roles/pd_verify runs lm-evaluation-harness on the control node (its module
               pd_verify_lmeval) and merges that step into this report with --merge (below)
  sla          a streaming benchmark through the router: mean TTFT / TPOT and goodput vs the SLA
  prometheus   per-pool TTFT / TPOT read back from Prometheus (informational unless required)

Usage (from the directory that holds this package): python3 -m pd_verify --config cfg.json --json out.json
       --markdown out.md;  python3 -m pd_verify --merge report.json --step-result accuracy=acc.json --json out.json
       --markdown out.md
The exit code is 0 when every enforced step passed, 1 otherwise, 2 on bad config or input.

Modules: client (HTTP and streaming), metrics (Prometheus text), prompts, steps (readiness, warmup, kv_transfer,
prometheus), sla, report (run_all, Markdown, --merge), cli (the command line; __main__ runs it). roles/pd_verify/
tasks/run.yml copies the package into pd_verify_workdir on the router host, where a bare python3 runs it with -m from
that directory; the collection's own code (plugins/plugin_utils/pd_rollout.py, bench/, tests/unit) imports it as
ansible_collections.b300.pd.roles.pd_verify.files.pd_verify.
"""

from __future__ import annotations

from .cli import main
from .client import http_get
from .metrics import metric_sum, parse_prometheus
from .prompts import PromptMaker, word_prompt
from .report import STEPS, merge_steps, render_markdown, run_all
from .sla import percentile, run_bench, summarize_bench
from .steps import step_readiness

# What the collection's other code imports from pd_verify.
__all__ = ["STEPS", "PromptMaker", "http_get", "main", "merge_steps", "metric_sum", "parse_prometheus", "percentile",
           "render_markdown", "run_all", "run_bench", "step_readiness", "summarize_bench", "word_prompt"]
