"""`compiled-llm cache`: the compile cache as a tool (list, verify, prune, explain, export, import).

Built on the compile cache's own API (compilation/compile_cache.py, cache_archive.py,
cache_explain.py): nothing here loads an artifact or unpickles a graph, an entry another process
holds is never removed, and every problem a user can fix is one line and a non-zero exit status.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from compiled_llm.compilation.compile_cache import (
    CompileCache,
    CompileCacheError,
    default_cache_root,
    entries,
    read_signing_key,
)

DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


# ---- arguments ----------------------------------------------------------------------------------
def parse_duration(text: str) -> float:
    """'7d', '12h', '30m', '90s', '2w' -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 7d, 12h, 30m")
    return float(match[1]) * DURATION_UNITS[match[2]]


def parse_size(text: str) -> int:
    """'2G', '500M', '1.5g', '800k', '1024' -> bytes (powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 2G, 500M")
    return int(float(match[1]) * SIZE_UNITS[match[2]])


def _add_cache_flags(parser: argparse.ArgumentParser, signing: bool = True) -> None:
    parser.add_argument("--compile-cache", metavar="DIR", default=None,
                        help="Compile cache folder (default: as for serve, under the user cache).")
    if signing:
        parser.add_argument("--cache-signing-key-file", metavar="FILE", default=None,
                            help="Check (verify, import, list) or write (export) signatures with this key.")


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cache_command", required=True, metavar="SUBCOMMAND")
    p = sub.add_parser("list", help="Every entry: key, model, flags, size, created, last used, signed, status.")
    _add_cache_flags(p)
    p.add_argument("--json", action="store_true", help="One JSON object per entry, in a list.")
    p = sub.add_parser("verify", help="Check every checksum (and signature) without loading anything; "
                                      "exit 1 on any damage.")
    p.add_argument("key", nargs="?", help="One entry (a key or a unique prefix); default: all.")
    _add_cache_flags(p)
    p = sub.add_parser("prune", help="Remove entries by age, total size (least recently used first) or count; "
                                     "an entry another process holds is kept.")
    _add_cache_flags(p, signing=False)
    p.add_argument("--older-than", type=parse_duration, metavar="AGE",
                   help="Remove entries last used longer ago than AGE (7d, 12h, 30m).")
    p.add_argument("--max-size", type=parse_size, metavar="SIZE",
                   help="Remove the least recently used entries until the rest fit in SIZE (2G, 500M).")
    p.add_argument("--keep-last", type=int, metavar="N", help="Keep the N most recently used entries.")
    p.add_argument("--dry-run", action="store_true", help="Say what would be removed; remove nothing.")
    p = sub.add_parser("explain", help="Why these model and flags miss the cache: the factors that differ "
                                       "from the nearest entries.")
    from compiled_llm.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(p)  # the same model and flags as serve and precompile
    p = sub.add_parser("export", help="Write one entry to one portable file (a tar; .tar.gz compresses).")
    p.add_argument("key", help="The entry (a key or a unique prefix).")
    p.add_argument("-o", "--output", required=True, metavar="FILE")
    _add_cache_flags(p)
    p = sub.add_parser("import", help="Restore an exported entry, checked before anything is written.")
    p.add_argument("file", metavar="FILE")
    _add_cache_flags(p)


def run_cache(args: argparse.Namespace) -> int:
    return COMMANDS[args.cache_command](args)


def _root(args: argparse.Namespace) -> Path:
    return Path(args.compile_cache).expanduser() if args.compile_cache else default_cache_root()


def _signing_key(args: argparse.Namespace) -> bytes | None:
    path = getattr(args, "cache_signing_key_file", None)
    return read_signing_key(path) if path else None


def _resolve(root: Path, key: str) -> str:
    matches = [k for k in entries(root) if k.startswith(key.lower())]
    if len(matches) != 1:
        why = "no entry" if not matches else f"{len(matches)} entries"
        raise CompileCacheError(f"{why} in {root} match {key!r} (see `compiled-llm cache list`)")
    return matches[0]


def _human(size: int) -> str:
    for unit in ("B", "K", "M", "G"):
        if size < 1024 or unit == "G":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size:.1f}G"


def _when(stamp: float | None) -> str | None:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) if stamp is not None else None


# ---- list ---------------------------------------------------------------------------------------
@dataclass
class EntryRow:
    key: str
    status: str  # complete, damaged, unfinished (or being filled by another process)
    model: str
    flags: str
    size: int
    created: str | None
    last_used: str | None
    signed: bool
    in_use: bool
    problems: list[str]
    factors: dict[str, Any]


def describe_model(cache: CompileCache) -> str:
    config = cache.factors.get("model_config")
    shape = ""
    if isinstance(config, dict):
        arch = (config.get("architectures") or [config.get("model_type", "?")])[0]
        shape = f"{arch}, {config.get('num_hidden_layers', '?')} layers, hidden {config.get('hidden_size', '?')}"
    name = cache.about.get("model")
    return f"{name} ({shape})" if name and shape else (name or shape or "?")


def describe_flags(factors: dict[str, Any]) -> str:
    """The engine flags that shaped the entry, as the command line spells them."""
    parts = []
    if "dtype" in factors:
        parts.append(f"--dtype {str(factors['dtype']).removeprefix('torch.')}")
    if "max_num_batched_tokens" in factors:
        parts.append(f"--max-num-batched-tokens {factors['max_num_batched_tokens']}")
    if factors.get("compile_ranges"):
        parts.append("--compile-ranges " + ",".join(f"{lo}-{hi}" for lo, hi in factors["compile_ranges"]))
    if factors.get("compile_sizes"):
        parts.append("--compile-sizes " + ",".join(map(str, factors["compile_sizes"])))
    quant = factors.get("quantization")
    if quant:
        parts.append(f"--quantization {quant.get('method', quant) if isinstance(quant, dict) else quant}")
    tp = factors.get("tensor_parallel")
    if isinstance(tp, dict):
        parts.append(f"-tp {tp.get('world_size')} (rank {tp.get('rank')})")
    if "device" in factors:
        parts.append(f"[{factors['device']}, torch {factors.get('torch_version', '?')}]")
    return " ".join(parts)


def entry_row(root: Path, key: str, signing_key: bytes | None, full: bool) -> EntryRow:
    """`full`: read every checksum (verify); otherwise only that every listed file is there with
    its size (list)."""
    cache = CompileCache.existing(root, key, signing_key)
    damages = cache.verify(checksums=full)
    in_use = cache.in_use()
    status = "damaged" if damages else ("complete" if cache.complete else "unfinished")
    if damages and (in_use or damages[0].cause.startswith("is missing: the entry is unfinished")):
        status = "unfinished"  # a start may be filling it right now
    try:  # factors.json and about.json are for display only, not vouched for: a foreign one may be any JSON
        model, flags = describe_model(cache), describe_flags(cache.factors)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError):
        model, flags = "?", "? (factors.json is not one a start writes)"
    return EntryRow(key, status, model, flags, cache.size(),
                    _when(cache.created), _when(cache.last_used), cache.signed, in_use,
                    [str(d) for d in damages], cache.factors)


def run_list(args: argparse.Namespace) -> int:
    root, signing_key = _root(args), _signing_key(args)
    rows = [entry_row(root, key, signing_key, full=False) for key in entries(root)]
    if args.json:
        print(json.dumps([{k: v for k, v in asdict(r).items() if k != "factors"} | {
            "factors": {k: v for k, v in r.factors.items() if k != "sources"}} for r in rows], indent=1))
        return 0
    if not rows:
        print(f"no compile cache entries in {root}")
        return 0
    print(f"{len(rows)} entr{'y' if len(rows) == 1 else 'ies'} in {root}, {_human(sum(r.size for r in rows))}:")
    for r in rows:
        marks = ", ".join(m for m in ("signed" if r.signed else "unsigned", "in use" if r.in_use else "") if m)
        print(f"{r.key}  {r.status:<10} {_human(r.size):>7}  created {r.created}  last used {r.last_used}  {marks}")
        print(f"    model {r.model}")
        print(f"    flags {r.flags}")
        for problem in r.problems[:3]:
            print(f"    ! {problem}")
    return 0


# ---- verify -------------------------------------------------------------------------------------
def run_verify(args: argparse.Namespace) -> int:
    root, signing_key = _root(args), _signing_key(args)
    keys = [_resolve(root, args.key)] if args.key else entries(root)
    if not keys:
        print(f"no compile cache entries in {root}")
        return 0
    bad = 0
    for key in keys:
        cache = CompileCache.existing(root, key, signing_key)
        damages = cache.verify()
        if damages:
            bad += 1
            for damage in damages:
                print(f"{key}: {cache.entry / damage.path if damage.path != '.' else cache.entry} {damage.cause}")
            continue
        signed = ("signature checked" if signing_key else "signed, signature not checked (no "
                  "--cache-signing-key-file)") if cache.signed else "unsigned"
        done = "" if cache.complete else ", but unfinished (no saved graph yet)"
        print(f"{key}: ok, {len(cache.listed())} files checked, {signed}{done}")
    if bad:
        print(f"compiled-llm cache verify: {bad} of {len(keys)} entries damaged", file=sys.stderr)
    return 1 if bad else 0


# ---- prune --------------------------------------------------------------------------------------
@dataclass
class Candidate:
    cache: CompileCache
    size: int
    last_used: float
    in_use: bool


def choose_removals(candidates: list[Candidate], older_than: float | None, max_size: int | None,
                    keep_last: int | None, now: float) -> list[Candidate]:
    """What prune removes: the union of what each rule selects. Candidates in use are never chosen
    (their size still counts toward --max-size)."""
    ordered = sorted(candidates, key=lambda c: c.last_used, reverse=True)  # most recently used first
    chosen: list[Candidate] = []
    if keep_last is not None:
        chosen += ordered[keep_last:]
    if older_than is not None:
        chosen += [c for c in ordered if now - c.last_used > older_than]
    chosen = [c for c in chosen if not c.in_use]  # kept: its size counts toward --max-size below
    if max_size is not None:
        total = sum(c.size for c in ordered if c not in chosen)
        for c in reversed(ordered):  # least recently used first
            if total <= max_size:
                break
            if c not in chosen and not c.in_use:
                chosen.append(c)
                total -= c.size
    unique = {id(c): c for c in chosen}
    return sorted(unique.values(), key=lambda c: c.last_used)


def run_prune(args: argparse.Namespace) -> int:
    if args.older_than is None and args.max_size is None and args.keep_last is None:
        raise CompileCacheError("give --older-than, --max-size or --keep-last (or several)")
    if args.keep_last is not None and args.keep_last < 0:
        raise CompileCacheError("--keep-last must be 0 or more")
    root = _root(args)
    candidates = []
    for key in entries(root):
        cache = CompileCache.existing(root, key)
        candidates.append(Candidate(cache, cache.size(), cache.last_used or 0.0, cache.in_use()))
    chosen = choose_removals(candidates, args.older_than, args.max_size, args.keep_last, time.time())
    freed = 0
    for c in chosen:
        what = f"{c.cache.key} ({_human(c.size)}, last used {_when(c.last_used)})"
        if args.dry_run:
            print(f"would remove {what}")
            freed += c.size
        elif c.cache.remove():
            print(f"removed {what}")
            freed += c.size
        else:
            print(f"kept {what}: another process holds it")
    for c in candidates:
        if c.in_use:
            print(f"kept {c.cache.key}: another process holds it")
    verb = "would free" if args.dry_run else "freed"
    print(f"{verb} {_human(freed)}; {len(candidates) - len(chosen)} of {len(candidates)} entries kept")
    return 0


# ---- explain ------------------------------------------------------------------------------------
def explain_lines(config: Any) -> list[str]:
    """For an engine config: whether its entry is there and, if not, why the nearest ones differ."""
    from compiled_llm.compilation.cache_explain import nearest_entries
    from compiled_llm.compilation.cache_key import cache_key
    from compiled_llm.worker.cache_factors import engine_cache_factors

    factors = engine_cache_factors(config, rank=0)
    key = cache_key(factors)
    root = Path(config.compilation_config.cache_dir or default_cache_root()).expanduser()
    if (root / key).is_dir():
        cache = CompileCache.existing(root, key)
        state = "complete" if cache.complete else "unfinished: the next start fills it"
        return [f"hit: entry {key} in {root} is for these model and flags ({state})"]
    lines = [f"miss: no entry {key} in {root} for these model and flags"]
    found = nearest_entries(root, factors)
    if not found:
        lines.append("the folder holds no entries to compare with")
    for near in found:
        lines.append(f"nearest entry {near.key}: {len(near.differences)} factor(s) differ")
        lines += [f"  {line}" for line in near.differences]
    return lines


def run_explain(args: argparse.Namespace) -> int:
    from compiled_llm.engine.arg_utils import EngineArgs

    print("\n".join(explain_lines(EngineArgs.from_cli_args(args).create_engine_config())))
    return 0


# ---- export / import ----------------------------------------------------------------------------
def run_export(args: argparse.Namespace) -> int:
    from compiled_llm.compilation.cache_archive import export_entry

    root, signing_key = _root(args), _signing_key(args)
    cache = CompileCache.existing(root, _resolve(root, args.key), signing_key)
    count = export_entry(cache, args.output)
    signed = "signed" if signing_key is not None or cache.signed else "unsigned"
    print(f"exported {cache.key} ({count} files, {signed}) to {args.output} "
          f"({_human(Path(args.output).expanduser().stat().st_size)})")
    return 0


def run_import(args: argparse.Namespace) -> int:
    from compiled_llm.compilation.cache_archive import import_entry

    root = _root(args)
    key, outcome = import_entry(root, args.file, _signing_key(args))
    said = {"imported": "imported", "replaced": "imported (a damaged or unfinished entry was set aside)",
            "kept": "already present and whole: kept it"}[outcome]
    print(f"{key}: {said} in {root}")
    return 0


COMMANDS = {"list": run_list, "verify": run_verify, "prune": run_prune, "explain": run_explain,
            "export": run_export, "import": run_import}
