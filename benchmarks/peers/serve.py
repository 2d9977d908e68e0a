"""Interleaved serving rounds: every system's saved artifact timed again, in turns, in fresh processes.

Why: the tune phases run minutes apart, and on a shared VM the machine's speed drifts by a third and more in
that time (the same ONNX Runtime session at batch 32 measured 37/s in one phase and 25/s an hour later), so a
ratio between two tune phases can be drift, not the systems. Here each round starts one fresh ``serve``
process per system (load the artifact, time every batch size once), the systems take turns (the order rotates
from round to round), and torch_tweak's ratio to the best peer is taken within each round and then summarized
over the rounds. Systems that run in their own peer environment (AITune, Model Navigator) are left out: their
runners have no ``serve`` phase.
"""

from __future__ import annotations

import statistics
from typing import Any

from peers.systems import BY_KEY, Mode
from peers.workloads import TASKS, WORKLOADS

SERVED = ("eager", "inductor", "ov_compile", "ov_throughput", "ov_latency", "ov_int8_throughput", "ov_int8_latency",
          "onnxruntime", "onnxruntime_int8", "onnxruntime_torch", "onnxruntime_int8_torch", "ov_latency_torch",
          "ov_int8_latency_torch", "tt_loaded")
MINE = "tt_loaded"


def _owner(key: str) -> str:
    """The system whose tune phase made the artifact ``key`` serves (``tt_loaded`` serves ``tt``'s, a torch-I/O
    variant its by-hand twin's); the variants join the rounds whenever their twin's tune phase succeeded."""
    return "tt" if key == MINE else BY_KEY[key].serves or key


def served_systems(entries: dict[str, Any]) -> list[str]:
    """The systems of a workload's records that have a ``serve`` phase and a successful tune phase."""
    return [k for k in SERVED if entries.get(_owner(k), {}).get("tune", {}).get("ok")]


def run_rounds(driver: Any, workload: str, entries: dict[str, Any], rounds: int, log: Any) -> None:
    """Run ``rounds`` rounds of serve processes for the workload; records go to ``entries[owner]["serve"]``."""
    keys = served_systems(entries)
    if rounds < 1 or not keys:
        return
    for key in keys:
        entries[_owner(key)]["serve"] = []
    log(f"{workload}: {rounds} interleaved serving rounds of {', '.join(keys)}")
    batches = driver.mode.batches[workload]
    for r in range(rounds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            entries[_owner(key)]["serve"].append(driver.run(BY_KEY[key], workload, "serve", batches, tag=f"_{r}"))


def within_bound(entries: dict[str, Any], key: str) -> bool:
    """Whether system ``key``'s artifact kept the workload's task metric within its bound (``entries``: the
    workload's records of a run)."""
    return bool((entries.get(_owner(key), {}).get("tune", {}).get("task") or {}).get("within"))


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)} \
        if values else None


def summarize(results: dict[str, Any], mode: Mode) -> list[dict[str, Any]]:
    """Per workload and batch size: each served system's throughput in every round, and torch_tweak's ratio to the
    best peer of the same round (overall, and within the workload's task bound), summarized over the rounds."""
    out = []
    for workload, entries in results.items():
        keys = [k for k in SERVED if any(r.get("system") == k for r in entries.get(_owner(k), {}).get("serve") or [])]
        if not keys:
            continue
        for batch in mode.batches[workload]:
            per_round: dict[str, list[float | None]] = {}
            for key in keys:
                records = [r for r in entries[_owner(key)]["serve"] if r.get("system") == key]
                per_round[key] = [((r.get("batches") or {}).get(str(batch)) or {}).get("throughput", {}).get("median")
                                  if r.get("ok") else None for r in records]
            rounds = min(len(v) for v in per_round.values())
            peers = [k for k in keys if BY_KEY[k].peer]
            in_bound = [k for k in peers if within_bound(entries, k)]
            one_call = [k for k in in_bound if not BY_KEY[k].concurrent]
            pools = {"best": peers, "in_bound": in_bound, "in_bound_one_call": one_call,
                     "in_bound_torch_io": [k for k in one_call if BY_KEY[k].torch_io]}
            ratios: dict[str, list[float]] = {pool: [] for pool in pools}
            best_in_bound: list[str] = []
            for r in range(rounds):
                mine = per_round.get(MINE, [None] * rounds)[r]
                for pool, names in pools.items():
                    values = [(per_round[k][r], k) for k in names if per_round[k][r]]
                    if mine and values:
                        value, name = max(values)
                        ratios[pool].append(mine / value)
                        if pool == "in_bound":
                            best_in_bound.append(name)
            out.append({"workload": workload, "batch": batch, "rounds": rounds,
                        "systems": {k: {"throughput": _spread([v for v in per_round[k] if v]), "per_round": per_round[k],
                                        "within_bound": within_bound(entries, k)} for k in keys},
                        "x_best_peer": _spread(ratios["best"]), "x_best_in_bound": _spread(ratios["in_bound"]),
                        "x_best_in_bound_one_call": _spread(ratios["in_bound_one_call"]),
                        "x_best_in_bound_torch_io": _spread(ratios["in_bound_torch_io"]),
                        "best_in_bound_per_round": best_in_bound})
    return out


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _cell(spread: dict[str, float] | None, ratio: bool = False) -> str:
    """``median (min–max)``; a ratio as ``0.97x (0.91–1.02)``."""
    if not spread:
        return "–"
    text = (lambda v: f"{v:.2f}x") if ratio else _rate
    if spread["n"] < 2:
        return text(spread["median"])
    return f"{text(spread['median'])} ({text(spread['min'])}–{text(spread['max'])})"


def markdown(summary: list[dict[str, Any]]) -> list[str]:
    """The interleaved table: samples/s per system (median and range over the rounds; ✗: outside the task bound)
    and torch_tweak's per-round ratio to the best peer and to the best peer within the task bound."""
    if not summary:
        return []
    keys = [k for k in SERVED if any(k in e["systems"] for e in summary)]
    rounds = max(e["rounds"] for e in summary)
    head = ["workload, batch", *(BY_KEY[k].short for k in keys), "torch_tweak x best peer",
            "torch_tweak x best peer in task bound", "x best one-call-at-a-time peer in task bound",
            "x best torch-I/O peer in task bound"]
    lines = ["", f"**Interleaved serving rounds** ({rounds} rounds; in each, every system's saved artifact is loaded in "
             "a fresh process and timed at each batch size, in turns, the order rotating from round to round). "
             "Samples/s, median (min–max) over the rounds; ✗: outside the task bound. The ratios are taken within "
             "each round, then summarized, so a drift of the machine's speed between rounds cancels out:", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in summary:
        title = WORKLOADS[e["workload"]].title.split(" (")[0]
        cells = [f"{title}, {e['batch']}"]
        for key in keys:
            system = e["systems"].get(key)
            mark = "" if system is None or system["within_bound"] else " ✗"
            cells.append(_cell(system["throughput"]) + mark if system else "–")
        cells += [_cell(e["x_best_peer"], True), _cell(e["x_best_in_bound"], True),
                  _cell(e.get("x_best_in_bound_one_call"), True), _cell(e.get("x_best_in_bound_torch_io"), True)]
        lines.append("| " + " | ".join(cells) + " |")
    bounds = sorted({TASKS[WORKLOADS[e["workload"]].task].describe() for e in summary})
    concurrent = ", ".join(BY_KEY[k].short for k in keys if BY_KEY[k].concurrent)
    lines += ["", f"Task bounds: {'; '.join(bounds)}."
              + (f" {concurrent} keep several requests in flight (an async queue, so several batches run at once); a "
                 "call of a torch_tweak module, like a PyTorch module's, returns before the next one starts, as do "
                 "the one-call-at-a-time peers of the next-to-last column." if concurrent else "")
              + " The by-hand peers take a numpy array built once and reused, and return numpy; their \"torch I/O\" "
              "variants serve the same artifacts from a torch tensor converted on each call and return a tensor, as "
              "a call inside a PyTorch program does. The last column compares torch_tweak with the best one-call "
              "peer that takes and returns torch tensors (those variants, eager, torch.compile)."]
    return lines
