"""What the check's steps found: bit-for-bit comparisons of the workers' result files, and the
summary (``summary.md``) of a whole check."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def load(path: Path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def compare(reference: dict, got: dict, rename=lambda key: key) -> tuple[int, list[str]]:
    """Compares every result of ``reference`` (keys not starting with ``meta_``) with
    ``got[rename(key)]``, bit for bit. Returns how many were compared and what differs."""
    keys = [k for k in reference if not k.startswith("meta_")]
    differ = []
    for k in keys:
        g = got.get(rename(k))
        if g is None:
            differ.append(f"{rename(k)}: missing")
        elif not same_bits(reference[k], g):
            ref = reference[k]
            how = f"{g.dtype}{list(g.shape)} against {ref.dtype}{list(ref.shape)}"
            if g.shape == ref.shape and g.dtype.kind == ref.dtype.kind == "f":
                how = f"max abs diff {float(np.nanmax(np.abs(g.astype(np.float64) - ref)))}"
            differ.append(f"{rename(k)}: {how}")
    return len(keys), differ


def meta(got: dict, names: str, values: str) -> dict:
    """A ``meta_`` pair of arrays (names, counts) of a result file as a dict."""
    return {str(n): int(v) for n, v in zip(got.get(names, []), got.get(values, []))}


def _bench_rows(bench: dict) -> list[str]:
    rows = [
        "| workload | contestant | step ms | forward ms | samples/s | tables vs torch: max diff, share off |",
        "|---|---|---|---|---|---|",
    ]
    for wl, rep in bench.items():
        for name in ("sokpy", "torch", "fbgemm"):
            r = rep.get(name)
            if isinstance(r, dict):
                diff, off = r.get("max_table_diff_vs_torch"), r.get("table_fraction_off_vs_torch")
                rows.append(
                    f"| {wl} | {name} | {r['step']['median_ms']:.3f} | {r['forward']['median_ms']:.3f} | "
                    f"{r['samples_per_s']:.0f} | {'' if diff is None else f'{diff:.2g}, {100 * off:.2g}%'} |"
                )
        for name, why in rep.get("skipped", {}).items():
            rows.append(f"| {wl} | {name} | skipped: {why} | | | |")
    rows += [
        "",
        "| workload | sokpy kernels | ms | MB at the least | share of the copy bandwidth |",
        "|---|---|---|---|---|",
    ]
    for wl, rep in bench.items():
        for phase, k in rep["sokpy"].get("kernels", {}).items():
            share = k["share_of_copy_bandwidth"]
            rows.append(
                f"| {wl} | {phase} | {k['kernel_ms']:.3f} | {k['bytes'] / 1e6:.2f} | "
                f"{'untimed' if share is None else f'{100 * share:.1f}%'} |"
            )
    copy = {wl: rep.get("copy_bandwidth_bytes_per_s") for wl, rep in bench.items()}
    rows += ["", "Copy bandwidth (read + written): " + ", ".join(f"{wl} {v / 1e9:.0f} GB/s" for wl, v in copy.items())]
    return rows


def summary(info: dict, steps: list[dict]) -> str:
    """The check's summary in Markdown: where it ran, each step's status and findings, the
    end of every failed step's output, and the benchmark's figures."""
    mode = "emulated device (--emulate)" if info.get("emulated") else "GPU"
    lines = ["# sokpy gpu-check", "", f"- on: {mode}; checkout: `{json.dumps(info.get('checkout'))}`"]
    lines.append(f"- wall time: {info.get('seconds')} s of a {info.get('budget_s')} s budget")
    if "environment" in info:
        lines.append(f"- environment: `{json.dumps(info['environment'])}`")
    lines += ["", "| step | status | seconds | found |", "|---|---|---|---|"]
    for s in steps:
        found = "; ".join(f"{k}: {v}" for k, v in s["details"].items() if k != "why")
        why = f" ({s['details']['why']})" if "why" in s["details"] else ""
        lines.append(f"| {s['name']} | {s['status']}{why} | {s['seconds']} | {found} |")
    for s in steps:
        if s["status"] in ("failed", "timed out"):
            lines += ["", f"## {s['name']}: {s['status']}", "```", s.get("output_tail", "")[-2500:], "```"]
    if info.get("bench"):
        lines += ["", "## Benchmarks (one rank)", "", *_bench_rows(info["bench"])]
    return "\n".join(lines) + "\n"
