"""pd_verify's report: run the steps in order, merge steps run elsewhere, render the Markdown."""

from __future__ import annotations

import json
import time

from .client import HttpError
from .prompts import PromptMaker
from .sla import step_sla
from .steps import key_for, step_kv_transfer, step_prometheus, step_readiness, step_warmup

STEPS = ("readiness", "warmup", "kv_transfer", "accuracy", "sla", "prometheus")


def run_all(cfg, steps=STEPS, sleep=time.sleep):
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "router_url": cfg["router_url"],
              "model": cfg["model"], "inventory": cfg.get("inventory"), "steps": {}}
    direct = next((i for i in cfg["instances"] if i["name"] == cfg.get("kv_check", {}).get("direct_instance")),
                  cfg["instances"][0])
    prompts = PromptMaker(direct["url"] + "/tokenize", cfg["model"], api_key=key_for(cfg, direct["url"]))
    for step in steps:
        if step not in STEPS:
            raise ValueError(f"unknown step '{step}' (known: {', '.join(STEPS)})")
        if step not in cfg.get("steps", STEPS):
            report["steps"][step] = {"ok": True, "skipped": True}
            continue
        t0 = time.perf_counter()
        try:
            if step == "readiness":
                res = step_readiness(cfg, sleep)
            elif step == "prometheus":
                res = step_prometheus(cfg)
            elif step == "accuracy":
                res = {"ok": False, "errors": [
                    "accuracy: run by roles/pd_verify with lm-evaluation-harness on the control node, not by this "
                    "script; leave it out of the config's steps and merge its result with --merge"]}
            else:
                res = {"warmup": step_warmup, "kv_transfer": step_kv_transfer, "sla": step_sla}[step](cfg, prompts)
        except (HttpError, ValueError, KeyError, OSError) as e:
            res = {"ok": False, "errors": [f"{step}: {type(e).__name__}: {e}"]}
        res["seconds"] = round(time.perf_counter() - t0, 3)
        report["steps"][step] = res
        if step == "readiness" and not res["ok"]:
            for later in steps[steps.index(step) + 1:]:
                report["steps"][later] = {"ok": False, "skipped": True, "not_run": "readiness failed"}
            break
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report["ok"] = all(s["ok"] for s in report["steps"].values())
    report["failures"] = [e for s in report["steps"].values() for e in s.get("errors", [])]
    return report


def render_markdown(rep):
    st = rep["steps"]
    lines = [f"# P/D verify: {rep.get('inventory') or ''} — {'PASS' if rep['ok'] else 'FAIL'}", "",
             f"Router {rep['router_url']}, model `{rep['model']}`, {rep['started']} → {rep['finished']}", "",
             "| step | result | seconds |", "|---|---|---|"]
    for name, s in st.items():
        res = ("not run" if s.get("not_run") else "skipped") if s.get("skipped") else ("ok" if s["ok"] else "FAIL")
        if name == "sla" and "verdict" in s:
            res += f" (SLA {s['verdict']}{', enforced' if s['enforced'] else ', not enforced'})"
        lines.append(f"| {name} | {res} | {s.get('seconds', '')} |")
    if "readiness" in st and st["readiness"].get("targets"):
        lines += ["", "## Readiness", ""] + [
            f"- {t['name']} {t['url']}: {'ready' if t['ok'] else t.get('error')}" for t in st["readiness"]["targets"]]
    if st.get("warmup", {}).get("instances"):
        lines += ["", "## Warm-up of each instance alone (request features, seconds)", ""]
        for i in st["warmup"]["instances"]:
            feats = i.get("features") or {}
            done = ", ".join(f"{f} {v.get('seconds')}" for f, v in feats.items() if v.get("status") == 200)
            skipped = ", ".join(f for f, v in feats.items() if v.get("status") == "skipped")
            lines.append(f"- {i['name']} ({i.get('pool')}): {'ok' if i['ok'] else 'FAIL'}; {done or 'none warmed'}"
                         + (f"; skipped (flags): {skipped}" if skipped else ""))
    if st.get("warmup", {}).get("failed_then_passed"):
        lines += ["", "## Warm-up requests that failed once and passed on retry", ""] + [
            f"- {e}" for e in st["warmup"]["failed_then_passed"]]
    kv = st.get("kv_transfer", {})
    if kv.get("cases") is not None:
        ident = sum(1 for c in kv["cases"] if c.get("identical"))
        lines += ["", "## KV transfer", "",
                  f"- identical token ids P/D vs colocated ({kv.get('direct_instance')}): {ident}/{len(kv['cases'])}",
                  f"- decode deltas: {json.dumps(kv.get('totals'))}; transferred fraction "
                  f"{kv.get('transferred_fraction')}"]
        lines += [f"- {name}: {(delta or {}).get('nixl_transfers')} NIXL transfers, "
                  f"{(delta or {}).get('kv_transfer_tokens')} tokens by KV transfer"
                  for name, delta in sorted((kv.get("decode_deltas") or {}).items())]
        if (kv.get("decode_probes") or {}).get("sent"):
            lines.append(f"- {kv['decode_probes']['sent']} more P/D request(s) until every decode instance pulled KV")
    acc = st.get("accuracy", {})
    if "score" in acc:
        lines += ["", "## Accuracy (lm-evaluation-harness)", "",
                  f"- task `{acc.get('task')}`, {acc.get('metric')} = **{acc['score']}** on {acc.get('n')} of "
                  f"{acc.get('n_available')} items (min {acc['min_score']}), lm_eval {acc.get('lm_eval_version')}, "
                  f"{acc.get('seconds')} s"]
        lines += [f"- wrong: item {f.get('id')}: {json.dumps(f.get('output'))}, "
                  f"expected {json.dumps(f.get('expected'))}" for f in (acc.get("failed_items") or [])[:5]]
        refs = acc.get("reference_scores") or {}
        if refs:
            lines.append("- the recipe's reference scores (full benchmarks, not run by verify: docs/verify.md): "
                         + ", ".join(f"{k} {v}" for k, v in refs.items()))
    sla = st.get("sla", {})
    if "result" in sla:
        r = sla["result"]
        lines += ["", "## SLA", "", f"- params {json.dumps(sla['params'])}, goodput {sla['goodput_arg']}",
                  f"- mean TTFT {r['mean_ttft_ms']} ms (SLA {sla['sla']['ttft_mean_ms']:.0f}), mean TPOT "
                  f"{r['mean_tpot_ms']} ms (SLA {sla['sla']['tpot_mean_ms']}), p99 TTFT {r['p99_ttft_ms']} ms, "
                  f"p99 TPOT {r['p99_tpot_ms']} ms",
                  f"- {r['completed']} completed, {r['failed']} failed, {r['output_throughput_tok_s']} tok/s, "
                  f"goodput {r['goodput_req_s']} req/s → **{sla['verdict']}**"]
        lines += [f"- miss: {m}" for m in sla.get("misses", [])]
    pr = st.get("prometheus", {})
    if "values" in pr:
        lines += ["", "## Prometheus (per pool)", ""] + [f"- {k}: {json.dumps(v)}" for k, v in pr["values"].items()]
        lines += [f"- warning: {w}" for w in pr.get("warnings", [])]
    if rep["failures"]:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in rep["failures"]]
    return "\n".join(lines) + "\n"


def merge_steps(report, step_results):
    """The report with steps run elsewhere (``{name: result}``, e.g. accuracy from the control node) put in their
    place, in STEPS order; ok and failures recomputed."""
    for name, res in step_results.items():
        if name not in STEPS:
            raise ValueError(f"--step-result {name}: unknown step (known: {', '.join(STEPS)})")
        if not isinstance(res, dict) or not isinstance(res.get("ok"), bool):
            raise ValueError(f"--step-result {name}: not a step result (a JSON object with a boolean 'ok')")
    steps = dict(report.get("steps") or {})
    steps.update(step_results)
    ordered = {n: steps[n] for n in STEPS if n in steps}
    ordered.update({n: s for n, s in steps.items() if n not in ordered})
    merged = dict(report, steps=ordered)
    if step_results:
        merged["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    merged["ok"] = all(s["ok"] for s in ordered.values())
    merged["failures"] = [e for s in ordered.values() for e in s.get("errors", [])]
    return merged
