"""What a capacity run measures, from the inventory: the SLA (pd_sla), the context lengths of its range, the
output length, the model window and the served model name (bench/sla_capacity.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class UsageError(Exception):
    """Bad input: the message names the field and the fix (exit 2, no traceback)."""


@dataclass(frozen=True)
class Sla:
    ttft_mean_ms: float
    tpot_mean_ms: float


@dataclass(frozen=True)
class InventoryPlan:
    sla: Sla
    context_min: int
    context_max: int
    output_len: int
    max_model_len: int
    model: str


def load_group_vars(inventory: Path) -> dict:
    import yaml  # PyYAML: in the control venv (requirements.txt)

    gv = inventory / "group_vars" / "all"
    if not gv.is_dir():
        raise UsageError(f"--inventory: {gv} does not exist; give an inventory directory such as inventory/b300")
    merged: dict = {}
    for f in sorted(gv.glob("*.yml")):
        data = yaml.safe_load(f.read_text()) or {}
        if isinstance(data, dict):
            merged.update(data)
    return merged


def _need(vars_: dict, key: str, kind, where: str):
    val = vars_.get(key)
    if not isinstance(val, kind) or isinstance(val, bool):
        raise UsageError(f"{where}: {key} is missing or not a {kind.__name__} ({val!r}); set it in group_vars/all")
    return val


def plan_from_vars(vars_: dict, where: str = "inventory") -> InventoryPlan:
    """The SLA, context range, output length, window and model name the inventory gives verify."""
    sla = vars_.get("pd_sla")
    if not isinstance(sla, dict):
        raise UsageError(f"{where}: pd_sla is missing; set it in group_vars/all/sla.yml (see inventory/b300)")
    for key in ("ttft_mean_s", "tpot_mean_ms", "context_min_tokens", "context_max_tokens"):
        if not isinstance(sla.get(key), (int, float)) or isinstance(sla.get(key), bool) or sla[key] <= 0:
            raise UsageError(f"{where}: pd_sla.{key} must be a positive number, got {sla.get(key)!r}")
    if sla["context_min_tokens"] > sla["context_max_tokens"]:
        raise UsageError(f"{where}: pd_sla.context_min_tokens > context_max_tokens; swap them")
    model = vars_.get("pd_served_model_name")
    if not isinstance(model, str) or not model or "{{" in model:
        raise UsageError(f"{where}: pd_served_model_name must be a literal name; or pass --model")
    return InventoryPlan(
        sla=Sla(float(sla["ttft_mean_s"]) * 1000.0, float(sla["tpot_mean_ms"])),
        context_min=int(sla["context_min_tokens"]),
        context_max=int(sla["context_max_tokens"]),
        output_len=int(_need(vars_, "pd_verify_sla_output_len", int, where)),
        max_model_len=int(_need(vars_, "pd_verify_max_model_len", int, where)),
        model=model,
    )


def context_lengths(cmin: int, cmax: int, points: int, max_model_len: int, output_len: int) -> list[int]:
    """The minimum, then the top points-1 halvings of the maximum (b300 16K..256K, 4 points: 16K 64K 128K 256K),
    each clipped to the window minus the output tokens (as verify does), sorted, without duplicates."""
    if points < 1:
        raise UsageError("--context-points must be >= 1")
    limit = max_model_len - output_len
    if limit < 1:
        raise UsageError(f"pd_verify_max_model_len {max_model_len} leaves no room for {output_len} output tokens")
    if points == 1:
        lengths = [cmax]
    else:
        lengths = [cmin] + [max(cmin, cmax >> k) for k in range(points - 2, -1, -1)]
    return sorted({min(n, limit) for n in lengths})
