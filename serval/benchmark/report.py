"""A benchmark report as a readable table, a JSON file and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

from serval.benchmark.metrics import PERCENTILES

_LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(report: dict) -> str:
    """``report`` as run_serve_benchmark returns it: the machine line first, then what was run and measured."""
    s = report["summary"]
    lines = [f"machine: {report['machine']}", f"run: {report['description']}", "-" * 64,
             f"{'requests':<26}{s['completed']} completed, {s['failed']} failed",
             f"{'duration':<26}{s['duration_s']:.2f} s",
             f"{'request throughput':<26}{s['request_throughput']:.2f} req/s",
             f"{'output token throughput':<26}{s['output_throughput']:.1f} tok/s",
             f"{'total token throughput':<26}{s['total_token_throughput']:.1f} tok/s",
             f"{'tokens (from ' + s['token_counts_from'] + ')':<26}{s['prompt_tokens']} prompt, "
             f"{s['output_tokens']} output",
             f"{'latency (ms)':<14}{'mean':>10}" + "".join(f"{'p' + str(q):>10}" for q in PERCENTILES)]
    for key, label in _LATENCIES:
        d = s[key]
        lines.append(f"{label:<14}{_ms(d['mean']):>10}" + "".join(f"{_ms(d[f'p{q}']):>10}" for q in PERCENTILES))
    if "goodput" in s:
        g = s["goodput"]
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in g["slos_ms"].items())
        lines.append(f"goodput ({slos}): {g['requests_met']}/{s['num_requests']} requests "
                     f"({100 * g['fraction']:.1f}%), {g['request_rate']:.2f} req/s")
    for error in s["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def write_json(report: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2))


def import_pyplot():
    """matplotlib's pyplot on the file-only backend, or a ValueError that says how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'serval[bench]' (or matplotlib)") from None
    return plt


def plot_run(report: dict, path: str | Path) -> None:
    """Three panels: the CDFs of TTFT and of ITL, and each request's E2E latency against when it was sent."""
    plt = import_pyplot()
    requests = [r for r in report["requests"] if r["ok"]]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, values, title in ((axes[0], [1000 * r["ttft"] for r in requests], "TTFT"),
                              (axes[1], [1000 * g for r in requests for g in r["itl"]], "ITL")):
        values = sorted(values)
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], drawstyle="steps-post")
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of samples")
    axes[2].scatter([r["start"] for r in requests], [1000 * r["e2e"] for r in requests], s=12)
    axes[2].set(title="E2E latency per request", xlabel="sent at (s since start)", ylabel="ms")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"{report['description']}\n{report['machine']}", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
