"""Why a start misses the compile cache: which factors differ from the nearest entries, by name.

A miss in CI is otherwise a mystery (a torch upgrade, another CPU's vector ISA, a flag, an edited
model file). Each entry stores its factors (`factors.json`); this compares them with the factors a
start computes now, one line per factor, in words a user acts on: the flag to change, the version
that moved, the source files that were edited.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compiled_llm.compilation.compile_cache import FACTORS_FILE, entries, read_json_file

# factor -> how a person knows it (a flag is named as the command line spells it).
FACTOR_NAMES = {
    "compiled_llm_version": "compiled-llm version",
    "torch_version": "torch version",
    "python": "Python version",
    "device": "device or vector ISA",
    "inductor_config": "torch Inductor configuration",
    "functorch_config": "torch functorch configuration",
    "inductor_options": "flag --inductor-options",
    "dtype": "flag --dtype",
    "max_num_batched_tokens": "flag --max-num-batched-tokens",
    "compile_ranges": "flag --compile-ranges",
    "compile_sizes": "flag --compile-sizes",
    "passes": "flag --compile-passes (or the passes' code)",
    "quantization": "flag --quantization",
    "tensor_parallel": "flag --tensor-parallel-size (or the rank)",
    "splitting_ops": "splitting ops",
    "cpu_kernels": "C++ CPU kernels in use",
}
ORDER = ["model_config", "compiled_llm_version", "torch_version", "python", "device", "inductor_config",
         "functorch_config", "dtype", "max_num_batched_tokens", "compile_ranges", "compile_sizes",
         "inductor_options", "passes", "quantization", "tensor_parallel", "splitting_ops", "cpu_kernels", "sources"]
MISSING = object()


@dataclass
class Nearest:
    key: str
    differences: list[str]


def _short(value: Any, width: int = 60) -> str:
    if value is MISSING:
        return "absent"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=repr)
    return text if len(text) <= width else text[: width - 3] + "..."


def _model_line(old: Any, new: Any) -> str:
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return f"model: {_short(old)} in the entry, {_short(new)} now"
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k, MISSING) != new.get(k, MISSING))
    parts = [f"{k} {_short(old.get(k, MISSING), 30)} in the entry, {_short(new.get(k, MISSING), 30)} now"
             for k in keys[:3]]
    more = f" (and {len(keys) - 3} more)" if len(keys) > 3 else ""
    return "model: config " + "; ".join(parts) + more


def _sources_line(old: Any, new: Any) -> str:
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return "package sources: differ (the entry stores one hash for all of them, not one per file)"
    changed = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    labelled = ([f"{k} (changed)" for k in changed] + [f"{k} (only now)" for k in sorted(new.keys() - old.keys())]
                + [f"{k} (only in the entry)" for k in sorted(old.keys() - new.keys())])
    shown = ", ".join(labelled[:4]) + (f" and {len(labelled) - 4} more" if len(labelled) > 4 else "")
    return f"package sources: {len(labelled)} file(s) differ: {shown}"


def _config_line(label: str, old: Any, new: Any) -> str:
    """Which environment variables or in-process settings of a torch config module differ."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return f"{label}: {_short(old)} in the entry, {_short(new)} now"
    parts = []
    for part, what in (("environment", "environment variable"), ("set_in_process", "set in the process")):
        before, after = old.get(part) or {}, new.get(part) or {}
        for k in sorted(before.keys() | after.keys()):
            if before.get(k, MISSING) != after.get(k, MISSING):
                parts.append(f"{k} ({what}) {_short(before.get(k, MISSING), 20)} in the entry, "
                             f"{_short(after.get(k, MISSING), 20)} now")
    return f"{label}: " + ("; ".join(parts) if parts else "differs")


def differences(entry: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """One line per factor that differs between an entry's factors and a start's (compared as
    factors.json stores them: JSON has no integer keys or tuples)."""
    now = json.loads(json.dumps(now, sort_keys=True, default=repr))
    names = [k for k in ORDER if k in entry or k in now] + sorted((entry.keys() | now.keys()) - set(ORDER))
    lines = []
    for name in names:
        old, new = entry.get(name, MISSING), now.get(name, MISSING)
        if old == new:
            continue
        if name == "model_config":
            lines.append(_model_line(old, new))
        elif name == "sources":
            lines.append(_sources_line(old, new))
        elif name in ("inductor_config", "functorch_config"):
            lines.append(_config_line(FACTOR_NAMES[name], old, new))
        else:
            lines.append(f"{FACTOR_NAMES.get(name, name)}: {_short(old)} in the entry, {_short(new)} now")
    return lines


def nearest_entries(root: str | Path, factors: dict[str, Any], limit: int = 3) -> list[Nearest]:
    """The entries under `root` with the fewest differing factors (ties together, at most
    `limit`), each with its differences. Entries without readable factors are skipped."""
    found = []
    for key in entries(root):
        stored = read_json_file(Path(root).expanduser() / key / FACTORS_FILE)
        if stored is not None:
            found.append(Nearest(key, differences(stored, factors)))
    found.sort(key=lambda n: (len(n.differences), n.key))
    if not found:
        return []
    best = len(found[0].differences)
    return [n for n in found if len(n.differences) == best][:limit]
