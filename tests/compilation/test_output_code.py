"""Warm starts that run Inductor's saved modules (compilation/output_code.py) without importing
Inductor or Dynamo, and the cache key computed without them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from compiled_llm.compilation.compile_cache import file_sha256
from compiled_llm.compilation.output_code import NotSavable, describe

REPO = Path(__file__).resolve().parents[2]

# A fresh process: compile or load the toy, report counters, its error against eager, and whether
# Inductor or Dynamo was imported.
START = """
import json, sys
from tests.compilation.toy_compile import compile_toy, max_error
try:
    model, compiled, snap = compile_toy(sys.argv[1], strict=sys.argv[2] == "1")
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
    raise SystemExit
snap["max_error"] = max_error(model, compiled)
snap["imported"] = sorted({m for m in ("torch._inductor", "torch._dynamo") if m in sys.modules})
snap["entry"] = compiled.report.cache_dir
print(json.dumps(snap))
"""


def start(root: Path, strict: bool = False) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", START, str(root), "1" if strict else "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COMPILED_LLM_LOG_LEVEL": "INFO"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """(cache root, entry): one cold start of the toy in a fresh process; tests work on copies."""
    root = tmp_path_factory.mktemp("output-code")
    report, log = start(root)
    assert report["num_inductor_compilations"] == 3, log[-2000:]
    return root, Path(report["entry"])


def copy_of(cold, tmp_path) -> tuple[Path, Path]:
    root, entry = cold
    dest = tmp_path / "cache"
    shutil.copytree(root, dest, symlinks=True)
    return dest, dest / entry.name


def test_a_warm_start_runs_the_saved_modules_and_never_imports_inductor_or_dynamo(cold, tmp_path):
    root, entry = copy_of(cold, tmp_path)
    artifacts = sorted(p.name.removesuffix(".bin") for p in (entry / "artifacts").glob("*.bin"))
    saved = sorted(p.name.removesuffix(".code.json") for p in (entry / "artifacts").glob("*.code.json"))
    assert saved == artifacts and len(saved) == 3  # every piece (the toy's linears are extern kernels)
    index = json.loads((entry / "index.json").read_text())["files"]
    assert all(f"artifacts/{name}.code.json" in index for name in saved)  # checksummed like the rest
    warm, _ = start(root, strict=True)
    assert warm["num_inductor_compilations"] == 0 and warm["num_artifacts_loaded"] == 3
    assert warm["num_graphs_traced"] == 0
    assert warm["imported"] == []
    assert warm["max_error"] < 1e-5  # every size of the range, against eager


def test_a_saved_module_that_does_not_load_is_damage_set_aside_and_saved_anew_from_its_artifact(cold, tmp_path):
    root, entry = copy_of(cold, tmp_path)
    victim = sorted((entry / "artifacts").glob("*.code.json"))[0]
    victim.write_text(json.dumps({"format": 1, "torch": torch.__version__, "source": "call = None",
                                  "kernels": {"k": {"module": "x.kernel", "file": "inductor/missing.so"}},
                                  "extern_kernels": {}}))
    index = json.loads((entry / "index.json").read_text())
    rel = f"artifacts/{victim.name}"
    index["files"][rel] = {"sha256": file_sha256(victim), "bytes": victim.stat().st_size}  # vouched for
    (entry / "index.json").write_text(json.dumps(index))
    refused, _ = start(root, strict=True)
    assert "CompileCacheMissError" in refused["error"] and victim.name in refused["error"]
    again, log = start(root)
    assert "moved it to" in log
    assert again["num_inductor_compilations"] == 0 and again["max_error"] < 1e-5  # its artifact still serves
    assert json.loads(victim.read_text())["kernels"] != {"k": {"module": "x.kernel", "file": "inductor/missing.so"}}
    warm, _ = start(root, strict=True)  # whole again
    assert warm["num_inductor_compilations"] == 0 and warm["imported"] == [] and warm["max_error"] < 1e-5


def generated_module(tmp_path: Path, source: str, **attrs) -> types.ModuleType:
    path = tmp_path / "generated.py"
    path.write_text(source)
    module = types.ModuleType("generated")
    module.__file__ = str(path)
    module.__dict__.update(attrs)
    return module


@pytest.mark.parametrize("source, why", [
    ("from torch._inductor.runtime.triton_heuristics import grid\n", "imports ['grid']"),
    ("import torch._inductor.config\n", "imports torch._inductor.config"),
    ("from torch._inductor.async_compile import AsyncCompile\nasync_compile = AsyncCompile()\n"
     "k = async_compile.triton('k', '''src''')\n", "async_compile.triton"),
    ("from torch._inductor.select_algorithm import extern_kernels\n"
     "def call(args):\n    return extern_kernels.bias_addmm(*args)\n", "not a torch function"),
])
def test_a_module_using_what_the_saved_form_cannot_stand_for_is_not_saved(tmp_path, source, why):
    from torch._inductor import select_algorithm
    from torch._inductor.kernel import mm  # noqa: F401  registers bias_addmm, a Python function

    module = generated_module(tmp_path, source, extern_kernels=select_algorithm.extern_kernels)
    with pytest.raises(NotSavable, match=why.replace("[", r"\[").replace("]", r"\]")):
        describe(module, [tmp_path])


def test_extern_kernels_are_saved_as_torch_paths(tmp_path):
    from torch._inductor import select_algorithm
    from torch._inductor.kernel import mm  # noqa: F401

    source = ("from torch._inductor.select_algorithm import extern_kernels\n"
              "def call(args):\n    return extern_kernels.addmm(*args), extern_kernels._int_mm(*args)\n")
    saved = describe(generated_module(tmp_path, source, extern_kernels=select_algorithm.extern_kernels), [tmp_path])
    assert saved["extern_kernels"] == {"addmm": "torch.addmm", "_int_mm": "torch._int_mm"}
    assert "import" not in saved["source"].splitlines()[0]  # the Inductor import is taken out
    assert saved["source"].count("\n") == source.count("\n")  # line numbers kept


KEY = """
import json, os, sys, torch
from tests.compilation.toy_compile import toy_config, toy_factors
from tests.compilation.toy_model import ToyModel
factors = lambda: toy_factors(toy_config(sys.argv[1]), ToyModel())
out = {"plain": factors()}
out["imported"] = sorted({m for m in ("torch._inductor", "torch._dynamo") if m in sys.modules})
import torch._inductor.config as inductor_config
from compiled_llm.compilation import inductor_settings
from torch._inductor.cpu_vec_isa import pick_vec_isa
inductor_settings.apply()
out["after_import"] = factors()
inductor_config.max_autotune = True
out["set_in_process"] = factors()
out["pick_vec_isa"] = str(pick_vec_isa())
print(json.dumps(out))
"""


def key_factors(tmp_path, **env) -> dict:
    proc = subprocess.run([sys.executable, "-c", KEY, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_cache_key_follows_inductors_settings_without_importing_it(tmp_path):
    plain = key_factors(tmp_path)
    assert plain["imported"] == []
    assert plain["after_import"] == plain["plain"]  # importing Inductor and our settings change nothing
    assert plain["set_in_process"]["inductor_config"] != plain["plain"]["inductor_config"]
    assert plain["set_in_process"]["inductor_config"]["set_in_process"] == {"max_autotune": "True"}
    # Inductor's own choice is named (on an AMX CPU it is "avx512 avx512_vnni amx_tile": every part)
    named = plain["plain"]["device"].split(":")[-1].split("+")
    assert plain["pick_vec_isa"].split() and all(part in named for part in plain["pick_vec_isa"].split())
    autotune = key_factors(tmp_path, TORCHINDUCTOR_MAX_AUTOTUNE="1")
    assert autotune["plain"]["inductor_config"]["environment"] == {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}
    cache_dir = key_factors(tmp_path, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "elsewhere"))
    assert cache_dir["plain"] == plain["plain"]  # where Inductor caches does not change its code
