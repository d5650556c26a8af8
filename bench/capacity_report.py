"""The report of a capacity run: report.json read back (--compare-with, bench/capacity_compare.py), report.md
rendered, and the TTFT, TPOT and goodput plots against the request rate."""

from __future__ import annotations

import json
from pathlib import Path

from ansible_collections.b300.pd.bench.capacity_plan import UsageError
from ansible_collections.b300.pd.bench.capacity_points import rate_summary


def load_report(path: str, mode: str | None = None, flag: str = "") -> dict:
    """A report.json read back (--compare-with, bench/capacity_compare.py); with `mode`, it must be one of that
    mode. `flag` names the option that gave the path in the error."""
    where = f"{flag} {path}".strip()
    try:
        rep = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{where}: not a readable report.json ({exc})") from exc
    if mode and (rep.get("mode") != mode or not isinstance(rep.get("contexts"), list)):
        raise UsageError(f"{where}: not a {mode} report (mode {rep.get('mode')!r}); give the {mode}'s report.json")
    return rep


def _fmt(v, spec=".0f"):
    return "n/a" if v is None else format(v, spec)


def _pools(prom: dict, key: str, scale: float, spec: str) -> str:
    vals = prom.get(key) or {}
    if "error" in vals:
        return "error"
    return ", ".join(f"{p} {format(v * scale, spec)}" for p, v in sorted(vals.items())) or "n/a"


def _fit_cell(fit: dict | None, bold: bool = False) -> str:
    if not fit or fit.get("rate") is None:
        return f"n/a ({fit['why']})" if fit else "n/a"
    ci = fit.get("ci90")
    rate = f"{fit['rate']:.3g}"
    return ((f"**{rate}**" if bold else rate) + (f" ({ci[0]:.3g}-{ci[1]:.3g})" if ci else " (no interval)")
            + (" extrapolated" if fit.get("extrapolated") else ""))


def _prompts(rep: dict) -> str:
    # Reports made before --prompts had the random dataset.
    if rep.get("prompts", "random") == "random":
        return "vLLM's random dataset"
    return f"distinct filler-word prompts, {rep.get('tokens_per_word') or 0:.2f} tokens a word"


def render_markdown(rep: dict) -> str:
    sla = rep["sla"]
    lines = [f"# SLA capacity {rep['mode']}: {rep['inventory']} ({rep['started']})", "",
             f"SLA ({rep.get('sla_source', 'inventory pd_sla')}): mean TTFT <= {sla['ttft_mean_ms']:g} ms, "
             f"mean TPOT <= {sla['tpot_mean_ms']:g} ms; "
             f"output {rep['output_len']} tokens per request; load `vllm bench serve` ({_prompts(rep)}, fixed "
             f"lengths, Poisson arrivals) through {rep['base_url']}.", ""]
    if rep["mode"] == "search":
        lines += [f"Search: start {rep['params']['start_rate']:g} req/s, doubling then geometric bisection to "
                  f"{rep['params']['precision']:.0%} relative precision.", "",
                  "| context (tokens) | SLA crossing, fit (90 % CI) | max rate: highest passing (req/s) | "
                  "first failing rate | goodput at max (req/s) | mean TTFT at max (ms) | mean TPOT at max (ms) | "
                  "points |",
                  "|---|---|---|---|---|---|---|---|"]
        short = [str(c["context"]) for c in rep["contexts"] if c.get("unconverged")]
        if short:
            lines[-2:-2] = [f"**Not converged** (`--max-points {rep['params']['max_points']}`): the search at "
                            f"{', '.join(short)} tokens used its points before the pass/fail bracket reached the "
                            "precision; the capacity lies between the max rate and the first failing rate. Re-run "
                            "with more points (or a --start-rate nearer the answer).", ""]
        limited = [str(c["context"]) for c in rep["contexts"] if c.get("budget_limited")]
        if limited:
            lines[-2:-2] = [f"**Budget-limited** (`--budget-s {rep['params']['budget_s']:g}`): the search at "
                            f"{', '.join(limited)} tokens stopped before reaching the precision; its max rate is the "
                            "highest passing rate measured (a lower bound).", ""]
    else:
        lines += ["| context (tokens) | SLA crossing, fit (90 % CI) | knee: last pass before the first fail "
                  "(req/s) | first failing rate | goodput at knee (req/s) | mean TTFT at knee (ms) | "
                  "mean TPOT at knee (ms) | points |",
                  "|---|---|---|---|---|---|---|---|"]
        # a rate that passes above the first failing one: the curve is not monotone, a point was disturbed (the
        # knee, the last pass before the first fail, is then too low); say so instead of showing a plain number
        for c in rep["contexts"]:
            above = [r["rate"] for r in rate_summary(c["points"], rep["params"].get("repeats", 1))
                     if r["passed"] and c["fail_rate"] is not None and r["rate"] > c["fail_rate"]]
            if above:
                lines[-2:-2] = [f"**Not monotone** at {c['context']} tokens: {', '.join(f'{r:.3g}' for r in above)} "
                                f"req/s passed above the first failing rate {c['fail_rate']:.3g}; a point there was "
                                "disturbed (another load, a cold start), so the knee is a lower bound. Measure that "
                                "context again.", ""]
    repeats = rep["params"].get("repeats", 1)
    if repeats > 1:
        lines[-2:-2] = [f"Each rate measured up to {repeats} times; most of its points decide it (`--repeats`), "
                        "and the figures at the max rate are the medians of its points.", ""]
    for c in rep["contexts"]:
        best = next((r for r in rate_summary(c["points"], repeats) if r["passed"] and r["rate"] == c["max_rate"]),
                    None)
        # the answer in bold: the crossing where there is one, else the highest passing rate
        max_cell = format(c["max_rate"], ".3g")
        if not (c.get("fit") or {}).get("rate"):
            max_cell = f"**{max_cell}**"
        lines.append(f"| {c['context']} | {_fit_cell(c.get('fit'), bold=True)} | {max_cell} | "
                     f"{_fmt(c['fail_rate'], '.3g')} | {_fmt(best and best['request_goodput'], '.3f')} | "
                     f"{_fmt(best and best['mean_ttft_ms'])} | "
                     f"{_fmt(best and best['mean_tpot_ms'], '.1f')} | {len(c['points'])}"
                     f"{' (budget)' if c.get('budget_limited') else ''} |")
    if any(c.get("fit") for c in rep["contexts"]):
        lines += ["", "SLA crossing: the rate where a line through every point's log SLA ratio (the larger of mean "
                  "TTFT / limit and mean TPOT / limit) against log rate reaches 1, fitted to the points within "
                  f"{rep['params'].get('fit_window', 1.3):g}x of the pass/fail bracket; the 90 % interval is a "
                  "bootstrap over those points. It uses how far each point met or missed the SLA, not only whether, "
                  "so it moves less with one disturbed point than the highest passing rate does."]
    swept = [c for c in rep["contexts"] if (c.get("sweep") or {}).get("centre")]
    if swept:
        lines += ["", "Rates swept: " + "; ".join(
            f"{c['context']} tokens {c['sweep']['rates'][0]:.3g}-{c['sweep']['rates'][1]:.3g} req/s around the "
            f"search's {c['sweep']['centre']['from']} {c['sweep']['centre']['rate']:.3g}" for c in swept)
            + f" (`--sweep-centre {rep['params'].get('sweep_centre', 'max-rate')}`)."]
    if rep.get("comparison"):
        lines += ["", "## Search vs finer sweep", ""] + comparison_markdown(rep["comparison"])
    lines += ["", "![TTFT](ttft.png) ![TPOT](tpot.png) ![goodput](goodput.png)", "", "## Points (in order measured)",
              "", "| context | rate | prompts | done/failed | mean TTFT ms (p99) | mean TPOT ms (p99) | goodput | "
              "verdict | Prometheus TTFT ms per pool | TPOT ms per pool | MTP acceptance | KV xfer ms | "
              "prefix cache hits % | load 1m | client CPU s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in rep["contexts"]:
        for p in c["points"]:
            pr = p["prometheus"]
            again = (f" (#{p.get('attempt', 1)})" if repeats > 1
                     else " (again)" if p.get("attempt", 1) > 1 else "")
            lines.append(
                f"| {p['context']} | {p['rate']:.3g}{again} | {p['num_prompts']} | {p['completed']}/{p['failed']} | "
                f"{_fmt(p['mean_ttft_ms'])} ({_fmt(p['p99_ttft_ms'])}) | {_fmt(p['mean_tpot_ms'], '.1f')} "
                f"({_fmt(p['p99_tpot_ms'], '.1f')}) | {_fmt(p['request_goodput'], '.3f')} | "
                f"{'PASS' if p['passed'] else 'FAIL'}: {p['reason']} | {_pools(pr, 'ttft_mean_s', 1000, '.0f')} | "
                f"{_pools(pr, 'tpot_mean_s', 1000, '.1f')} | {_pools(pr, 'mtp_acceptance', 1, '.2f')} | "
                f"{_pools(pr, 'kv_xfer_mean_s', 1000, '.1f')} | {_pools(pr, 'prefix_cache_hit_rate', 100, '.0f')} | "
                f"{_fmt(p.get('load_avg_1m'), '.1f')} | {_fmt(p.get('client_cpu_s'), '.1f')} |")
    warm = [(c["context"], c["warmup"]) for c in rep["contexts"] if c.get("warmup")]
    if warm:
        lines += ["", "Warm-up before each context's first point (not measured): " + "; ".join(
            f"{ctx} tokens: " + (f"skipped ({w['skipped']})" if w.get("skipped") else
                                 f"{w['prompts']} requests, {w['concurrency']} at a time, "
                                 + ("did not finish within --point-timeout" if w.get("timed_out") else
                                    f"{w.get('completed')} completed in {w.get('duration_s'):g} s"))
            for ctx, w in warm) + "."]
    lines += ["", "Prometheus figures: means over each point's own window (`window` in report.json) from the raw "
              "vLLM counters, per pool; `n/a` = no such event in the window (e.g. no MTP on this model). "
              "Prefix cache hits: the share of prompt tokens served from the cache; every point has its own seed "
              "(its own random prompts), so it stays near 0 on a real vocabulary; a high share means the point "
              "measured cache hits, not prefills (a small vocabulary has few distinct random prompts).",
              "", f"Command: `{rep['command']}`", ""]
    return "\n".join(lines)


def plot_report(rep: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sla = rep["sla"]
    repeats = rep["params"].get("repeats", 1)
    made = []
    specs = [("ttft.png", "mean_ttft_ms", "mean TTFT (ms)", sla["ttft_mean_ms"], "SLA mean TTFT"),
             ("tpot.png", "mean_tpot_ms", "mean TPOT (ms)", sla["tpot_mean_ms"], "SLA mean TPOT"),
             ("goodput.png", "request_goodput", "goodput (req/s)", None, None)]
    for fname, key, label, limit, limit_label in specs:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        for c in rep["contexts"]:
            # one value per rate: its point's, or the median of its points (repeats); the single points faint
            pts = [(r["rate"], r[key], r["passed"]) for r in rate_summary(c["points"], repeats) if r[key] is not None]
            if not pts:
                continue
            xs, ys, _passed = zip(*pts, strict=True)
            line, = ax.plot(xs, ys, marker="o", label=f"{c['context']} tokens"
                            + (" (median of repeats)" if repeats > 1 else ""))
            singles = [(p["rate"], p[key]) for p in c["points"] if p[key] is not None]
            if len(singles) > len(pts):
                ax.scatter(*zip(*singles, strict=True), marker=".", s=25, alpha=0.4, color=line.get_color())
            failed = [(x, y) for x, y, o in pts if not o]
            if failed:
                ax.scatter(*zip(*failed, strict=True), marker="x", s=60, color=line.get_color(), zorder=3)
            if c["max_rate"] > 0:
                ax.axvline(c["max_rate"], color=line.get_color(), linestyle=":", linewidth=1)
            fit = c.get("fit") or {}
            if fit.get("rate"):
                ax.axvline(fit["rate"], color=line.get_color(), linestyle="-.", linewidth=1)
                if fit.get("ci90"):
                    ax.axvspan(*fit["ci90"], color=line.get_color(), alpha=0.08, linewidth=0)
        if limit is not None:
            ax.axhline(limit, color="red", linestyle="--", linewidth=1.2, label=f"{limit_label} {limit:g} ms")
        else:
            rates = [p["rate"] for c in rep["contexts"] for p in c["points"]]
            if rates:
                ax.plot([0, max(rates)], [0, max(rates)], color="grey", linestyle="--", linewidth=1,
                        label="goodput = offered rate")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_xlim(left=0)
        values = [p[key] for c in rep["contexts"] for p in c["points"] if p[key]] + ([limit] if limit else [])
        if limit is not None and values and max(values) / min(values) > 20:
            # an overloaded point (queue building up) is 10-100x the limit: on a linear axis it flattens every
            # point near the limit, where the answer is
            ax.set_yscale("log")
            ax.set_ylabel(f"{label}, log scale")
        else:
            ax.set_ylim(bottom=0)
        ax.set_title(f"{label} vs request rate ({rep['mode']}); x = misses SLA, dotted = max rate,\n"
                     "dash-dot = SLA crossing (band: its 90 % CI)"
                     + ("; dots = single points" if repeats > 1 else ""))
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname)
        plt.close(fig)
        made.append(fname)
    return made


def _pct(rel) -> str:
    return "n/a" if rel is None else f"{rel * 100:+.1f} %"


def comparison_markdown(rows: list[dict]) -> list[str]:
    lines = ["| context | search max rate | sweep knee | difference | search SLA crossing (90 % CI) | "
             "sweep SLA crossing (90 % CI) | difference |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['context']} | {row['search_max_rate']:.3g} | {row['knee']:.3g} | "
                     f"{_pct(row['rel_diff'])} | {_fit_cell(row.get('search_fit'))} | "
                     f"{_fit_cell(row.get('sweep_fit'))} | {_pct(row.get('fit_rel_diff'))} |")
    return lines
