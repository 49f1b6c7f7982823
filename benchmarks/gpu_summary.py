"""The GPU check's figures in one place: the decode-step table (ours with asynchronous and
synchronous scheduling, HF transformers plain and compiled), serve against offline, and issue 13's
targets with the measured value beside each. It reads the JSON files the benchmarks wrote (any
of them may be missing: a step that failed or was left out shows as "-") and prints Markdown,
ready for the README.

    python benchmarks/gpu_summary.py DIR [--markdown summary.md]   # DIR holds profile.json, peer.json, serve.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Callable

# Issue 13's targets: (what, the figure's path in the results, goal, True if higher is better).
TARGETS = [
    ("batch-1 decode step, ms (async)", ("profile", "async/b1", "step_ms"), 0.8, False),
    ("batch-1 decode tok/s (async)", ("profile", "async/b1", "tokens_per_s"), 1250, True),
    ("batch-1 GPU busy (async)", ("profile", "async/b1", "busy_fraction"), 0.90, True),
    ("batch-8 GPU busy (async)", ("profile", "async/b8", "busy_fraction"), 0.85, True),
    ("kernels per decode step (batch 1)", ("profile", "async/b1", "kernels_per_step"), 300, False),
    ("serve c=32 / offline c=32 (async)", ("serve", "async/c32", "serve_over_offline"), 0.5, True),
    ("serve c=32 / offline c=32 (async, 4 API servers)", ("serve", "async-api4/c32", "serve_over_offline"), 0.5,
     True),
]


def load(folder: Path, name: str) -> dict[str, Any]:
    try:
        return json.loads((folder / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}


def figure(data: dict[str, dict[str, Any]], file: str, key: str, field: str) -> float | None:
    value = data.get(file, {}).get("results", {}).get(key, {})
    value = value.get(field) if isinstance(value, dict) else None
    return value if isinstance(value, (int, float)) and not math.isnan(value) else None


def cell(value: float | None, fmt: Callable[[float], str] = lambda v: f"{v:,.1f}") -> str:
    return "-" if value is None else fmt(value)


def pct(v: float) -> str:
    return f"{v:.0%}"


def ms(v: float) -> str:
    return f"{v:.3f}"


def decode_table(data: dict[str, dict[str, Any]]) -> list[str]:
    batches = sorted({int(k.split("/b")[1]) for file in ("profile", "peer")
                      for k in data.get(file, {}).get("results", {})})
    # (heading, file, key with {b} for the batch, field, format)
    columns = [
        ("async step ms", "profile", "async/b{b}", "step_ms", ms),
        ("async tok/s", "profile", "async/b{b}", "tokens_per_s", None),
        ("busy", "profile", "async/b{b}", "busy_fraction", pct),
        ("kernel ms", "profile", "async/b{b}", "kernel_ms_per_step", ms),
        ("kernels/step", "profile", "async/b{b}", "kernels_per_step", lambda v: f"{v:.0f}"),
        ("kernels/step unfused", "profile", "unfused/b{b}", "kernels_per_step", lambda v: f"{v:.0f}"),
        ("unfused step ms", "profile", "unfused/b{b}", "step_ms", ms),
        ("sync step ms", "profile", "sync/b{b}", "step_ms", ms),
        ("sync tok/s", "profile", "sync/b{b}", "tokens_per_s", None),
        ("sync busy", "profile", "sync/b{b}", "busy_fraction", pct),
        ("HF generate tok/s", "peer", "hf-generate/b{b}", "tokens_per_s", None),
        ("HF static+compiled tok/s", "peer", "hf-static-compiled/b{b}", "tokens_per_s", None),
    ]
    lines = ["| batch | " + " | ".join(c[0] for c in columns) + " | async / HF compiled |",
             "| " + " | ".join(["---"] * (len(columns) + 2)) + " |"]
    for b in batches:
        cells = [cell(figure(data, file, key.format(b=b), field), *([fmt] if fmt else []))
                 for _, file, key, field, fmt in columns]
        ours = figure(data, "profile", f"async/b{b}", "tokens_per_s")
        peer = figure(data, "peer", f"hf-static-compiled/b{b}", "tokens_per_s")
        ratio = cell(ours / peer if ours and peer else None, lambda v: f"{v:.2f}x")
        lines.append(f"| {b} | " + " | ".join(cells) + f" | {ratio} |")
    return lines


def serve_table(data: dict[str, dict[str, Any]]) -> list[str]:
    results = data.get("serve", {}).get("results", {})
    lines = ["| scheduling | clients | serve tok/s | offline tok/s | serve / offline | TTFT p50 ms | ITL p50 ms |",
             "| " + " | ".join(["---"] * 7) + " |"]
    for key, r in results.items():
        scheduling, c = key.split("/c")
        serve, offline = r.get("serve") or {}, r.get("offline") or {}
        lines.append(
            f"| {scheduling} | {c} | {cell(serve.get('output_tok_s'))} | {cell(offline.get('output_tok_s'))}"
            f" | {cell(r.get('serve_over_offline'), lambda v: f'{v:.2f}')}"
            f" | {cell(serve.get('ttft_median_ms'), lambda v: f'{v:.1f}')}"
            f" | {cell(serve.get('itl_median_ms'), lambda v: f'{v:.2f}')} |"
        )
    return lines


def targets_table(data: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| target | goal | measured | met |", "| --- | --- | --- | --- |"]
    for what, (file, key, field), goal, higher in TARGETS:
        value = figure(data, file, key, field)
        fmt = pct if "busy" in what else (lambda v: f"{v:,.2f}")
        met = "-" if value is None else ("yes" if (value >= goal if higher else value <= goal) else "NO")
        lines.append(f"| {what} | {'>=' if higher else '<='} {fmt(goal)} | {cell(value, fmt)} | {met} |")
    return lines


def top_kernels(data: dict[str, dict[str, Any]], key: str = "async/b1", count: int = 15) -> list[str]:
    row = data.get("profile", {}).get("results", {}).get(key)
    if not row:
        return []
    lines = [f"Top kernels, {key} ({row['kernels_per_step']:.0f} kernels, {row['kernel_ms_per_step']:.3f} ms of "
             f"kernels per step):", "", "| kernel | calls/step | us/call | ms/step |", "| --- | --- | --- | --- |"]
    for k in row["top_kernels"][:count]:
        name = k["name"].replace("|", "/")[:90]
        lines.append(f"| `{name}` | {k['calls_per_step']:.1f} | {k['us_per_call']:.2f} | {k['ms_per_step']:.4f} |")
    return lines


def spec_table(data: dict[str, dict[str, Any]]) -> list[str]:
    """gpu_spec_decode.py's rows: batch-1 tok/s per engine and prompt, against speculation off."""
    rows = data["spec"].get("results", {})
    if not rows:
        return ["(no speculative-decoding figures)"]
    lines = ["| engine | prompt | tok/s | vs off | acceptance | mean accepted length |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        engine, prompt = name.split("/", 1)
        off = rows.get(f"off/{prompt}", {}).get("tokens_per_s")
        ratio = f"{row['tokens_per_s'] / off:.2f}x" if off else "-"
        acceptance = f"{row['acceptance']:.0%}" if row.get("acceptance") is not None else "-"
        length = f"{row['mean_accepted_length']:.2f}" if row.get("mean_accepted_length") is not None else "-"
        lines.append(f"| {engine} | {prompt} | {row['tokens_per_s']:,.1f} | {ratio} | {acceptance} | {length} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="where profile.json, peer.json and serve.json are")
    parser.add_argument("--markdown", default=None, help="also write the summary here")
    args = parser.parse_args()
    folder = Path(args.folder)
    data = {name: load(folder, name) for name in ("profile", "peer", "serve", "spec")}
    head = next((d for d in data.values() if d), {})
    lines = [f"## GPU check summary ({head.get('device', 'no results')}, torch {head.get('torch', '-')}"
             f", transformers {data['peer'].get('transformers', '-')})", "",
             f"Decode steps (gpu_profile.py: -O{data['profile'].get('level', '-')}, in-process engine; "
             "HF: gpu_hf_peer.py):", ""]
    lines += decode_table(data) + ["", "Serve vs offline, output tokens/s (gpu_serve.py):", ""]
    lines += serve_table(data) + ["", "Issue 13's targets:", ""] + targets_table(data) + [""] + top_kernels(data)
    lines += ["", f"Speculative decoding at batch 1 (gpu_spec_decode.py: -O{data['spec'].get('level', '-')}, "
              f"k={data['spec'].get('k', '-')}, {data['spec'].get('max_tokens', '-')} new tokens):", ""]
    lines += spec_table(data)
    for name, d in data.items():
        for what in d.get("skipped", []):
            lines.append(f"- {name}: skipped {what}")
        for what in d.get("errors", {}):
            lines.append(f"- {name}: FAILED {what}")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
