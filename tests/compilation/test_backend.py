"""The compilation backend on a toy model, in the style of vLLM's tests/compile.

Starts that must be "fresh" run in a subprocess so that nothing in memory is reused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiled_llm.compilation.cache_key import cache_key, sources_hash
from compiled_llm.compilation.compile_cache import CompileCacheMissError
from compiled_llm.compilation.counters import counters
from tests.compilation.toy_compile import MAX_TOKENS, compile_toy, max_error, toy_config, toy_factors
from tests.compilation.toy_model import CALLS, ToyModel, inputs

REPO = Path(__file__).resolve().parents[2]


def run_fresh(cache_dir, ranges=None, sizes=(), strict=False, wait=True):
    cmd = [sys.executable, "-m", "tests.compilation.toy_compile", str(cache_dir), json.dumps(ranges),
           json.dumps(list(sizes)), "1" if strict else "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COMPILED_LLM_LOG_LEVEL": "INFO"})
    if not wait:
        return proc
    return finish(proc)


def finish(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


@pytest.fixture(autouse=True)
def fresh_counters():
    counters.reset()
    yield


@pytest.fixture(scope="module")
def compiled_in_process(tmp_path_factory):
    """(model, compiled forward, counters at its start, cache root): one cold compile of the toy in this
    process, shared by the tests that only run it or compile another entry after it."""
    root = tmp_path_factory.mktemp("toy-in-process")
    counters.reset()
    model, compiled, snap = compile_toy(str(root))
    return model, compiled, snap, root


@pytest.fixture(scope="module")
def cold_entry(tmp_path_factory):
    """(cache root, report): one cold start of the toy with size 4 besides its range, in a fresh
    process. Tests that damage the entry work on a copy (`copy_of`)."""
    root = tmp_path_factory.mktemp("toy-cold")
    cold, _ = run_fresh(root, sizes=[4])
    return root, cold


def copy_of(cold_entry, tmp_path) -> tuple[Path, Path]:
    """(a copy of the cold cache root, the entry in it)."""
    root, cold = cold_entry
    dest = tmp_path / "cache"
    shutil.copytree(root, dest, symlinks=True)
    return dest, dest / Path(cold["cache_entry"]).name


def test_split_runs_attention_eagerly_between_compiled_pieces_and_nothing_recompiles_while_serving(
        compiled_in_process):
    """One compile checks both (the first thing it serves is the no-recompile check)."""
    model, compiled, snap, _ = compiled_in_process
    assert snap["num_graphs_traced"] == 1
    with torch.inference_mode(), torch.compiler.set_stance("fail_on_recompile"):
        for n in (1, 2, 3, 9, 31, 32):
            compiled(*inputs(n))
    assert counters.num_graphs_traced == 0 and counters.num_recompiles == 0  # nothing since the start
    layers = len(model.layers)
    assert snap["num_pieces"] == layers + 1  # pieces between and around the attention calls
    assert snap["num_unique_pieces"] == 3  # first, middle (shared by identical layers), last
    assert snap["num_inductor_compilations"] == 3
    CALLS["attention"] = 0
    with torch.inference_mode():
        x, pos = inputs(7)
        compiled(x, pos)
    assert CALLS["attention"] == layers  # the op ran in Python, once per layer
    assert max_error(model, compiled) < 1e-5  # first and last pieces included, several sizes


def test_compile_count_and_dispatch_for_ranges_and_sizes(tmp_path):
    model, compiled, snap = compile_toy(str(tmp_path), ranges=[(1, 8), (9, MAX_TOKENS)], sizes=[4, 16])
    assert snap["num_inductor_compilations"] == 3 * 4  # unique pieces x (2 ranges + 2 sizes)
    backend = compiled.backend
    with torch.inference_mode():
        cases = [(4, "s4"), (5, "r1-8"), (1, "r1-8"), (16, "s16"), (9, "r9-32"), (20, "r9-32"), (32, "r9-32")]
        for n, expected in cases:
            x, pos = inputs(n)
            out = compiled(x, pos)
            assert (out - model(x, pos)).abs().max().item() < 1e-5
            assert {p.last_spec for p in backend.piece_backends} == {expected}, n
    assert backend.graphs_seen == 1
    with pytest.raises(RuntimeError, match="no compiled code for 33 tokens"):
        backend.piece_backends[0].select(33)


def test_ranges_and_sizes_must_cover_every_step_size(tmp_path):
    with pytest.raises(ValueError, match="9..32"):
        toy_config(str(tmp_path), ranges=[(1, 8)])
    with pytest.raises(ValueError, match="5..7"):
        toy_config(str(tmp_path), ranges=[(1, 4), (8, MAX_TOKENS)])
    with pytest.raises(ValueError, match="overlap"):
        toy_config(str(tmp_path), ranges=[(1, 8), (8, MAX_TOKENS)])
    # A size may fill a one-token gap between ranges.
    assert toy_config(str(tmp_path), ranges=[(1, 4), (6, MAX_TOKENS)], sizes=[5]).compile_sizes == [5]




def test_changed_factors_give_another_cache_folder(tmp_path):
    model = ToyModel()
    config = toy_config(str(tmp_path))
    base = cache_key(toy_factors(config, model))
    assert base == cache_key(toy_factors(config, model))  # stable
    assert base != cache_key(toy_factors(config, ToyModel(num_layers=4)))  # model config
    assert base != cache_key(toy_factors(config, model, dtype=torch.bfloat16))  # dtype
    assert base != cache_key(toy_factors(config, model, max_tokens=MAX_TOKENS * 2))  # max_num_batched_tokens
    assert base != cache_key(toy_factors(toy_config(str(tmp_path), sizes=[4]), model))  # compile sizes
    traced = Path(__file__).with_name("toy_model.py")
    edited = tmp_path / "toy_model.py"
    edited.write_text(traced.read_text() + "\n# an edit to a traced source file\n")
    sources = toy_factors(config, model)["sources"]
    assert sources != toy_factors(config, model, extra_sources=[edited])["sources"]
    copy = tmp_path / "copy" / "toy_model.py"
    copy.parent.mkdir()
    shutil.copy(traced, copy)
    # The same content hashes the same: the key follows content, not paths.
    assert sources_hash([copy]) == sources_hash([traced])


def test_strict_mode_fails_on_an_empty_cache(tmp_path):
    with pytest.raises(CompileCacheMissError) as info:
        compile_toy(str(tmp_path), strict=True)
    message = str(info.value)
    assert str(tmp_path) in message and "-r1-32" in message and "precompile" in message


def test_second_start_loads_with_zero_inductor_runs(cold_entry, tmp_path):
    _, cold = cold_entry
    assert cold["num_inductor_compilations"] == 6 and cold["num_artifacts_saved"] == 6
    root, _ = copy_of(cold_entry, tmp_path)
    warm, _ = run_fresh(root, sizes=[4], strict=True)
    assert warm["num_inductor_compilations"] == 0
    assert warm["num_graphs_traced"] == 0  # the saved graph is loaded: no Dynamo at all
    assert warm["num_artifacts_loaded"] == 6
    assert warm["max_error"] < 1e-5  # loaded artifacts (incl. single-output last piece) equal eager
    entry = Path(cold["cache_entry"])
    assert warm["cache_entry"] == str(root / entry.name)  # the same key in another process
    assert json.loads((entry / "factors.json").read_text())["compile_sizes"] == [4]
    assert (entry / "inductor").is_dir()  # Inductor's own cache lives inside the entry


def test_truncated_artifact_is_reported_and_recompiled(cold_entry, tmp_path):
    root, entry = copy_of(cold_entry, tmp_path)
    victim = sorted((entry / "artifacts").glob("*.bin"))[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    again, log = run_fresh(root, sizes=[4])
    assert again["num_inductor_compilations"] == 1  # only the damaged artifact is rebuilt
    assert again["max_error"] < 1e-5
    assert "checksum" in log and "moved it to" in log
    aside = list(root.glob(f"{entry.name}.broken-*"))
    assert aside, "the broken artifact is set aside, not deleted"
    assert [p.relative_to(aside[0]) for p in aside[0].rglob("*") if p.is_file()] == [Path("artifacts", victim.name)]
    warm, _ = run_fresh(root, sizes=[4], strict=True)  # the rebuilt entry is whole again
    assert warm["num_inductor_compilations"] == 0


def test_unloadable_artifact_or_damaged_graph_is_rebuilt_not_trusted(cold_entry, tmp_path):
    from compiled_llm.compilation.compile_cache import file_sha256
    from compiled_llm.compilation.traced_graph import GRAPH_FILE

    root, entry = copy_of(cold_entry, tmp_path)
    # An artifact whose checksum the index vouches for, but which does not load (its saved module,
    # which a warm start would run instead, taken out: tests/compilation/test_output_code.py).
    victim = sorted((entry / "artifacts").glob("*.bin"))[0]
    victim.write_bytes(b"not an artifact")
    index = json.loads((entry / "index.json").read_text())
    index["files"][f"artifacts/{victim.name}"] = {"sha256": file_sha256(victim), "bytes": victim.stat().st_size}
    saved_module = victim.with_name(victim.name.removesuffix(".bin") + ".code.json")
    saved_module.unlink()
    del index["files"][f"artifacts/{saved_module.name}"]
    (entry / "index.json").write_text(json.dumps(index))
    again, log = run_fresh(root, sizes=[4])
    assert again["num_inductor_compilations"] == 1 and again["max_error"] < 1e-5  # only it is rebuilt
    assert "moved it to" in log
    # A truncated saved graph: traced again with Dynamo, the artifacts still serve.
    graph = entry / GRAPH_FILE
    graph.write_bytes(graph.read_bytes()[:100])
    traced, log = run_fresh(root, sizes=[4])
    assert traced["num_graphs_traced"] == 1 and traced["num_inductor_compilations"] == 0
    assert traced["max_error"] < 1e-5 and "unreadable" in log
    warm, _ = run_fresh(root, sizes=[4], strict=True)
    assert warm["num_graphs_traced"] == 0 and warm["num_inductor_compilations"] == 0


def test_two_processes_filling_one_cache_leave_it_valid(tmp_path):
    first = run_fresh(tmp_path, wait=False)
    second = run_fresh(tmp_path, wait=False)
    a, _ = finish(first)
    b, _ = finish(second)
    assert a["max_error"] < 1e-5 and b["max_error"] < 1e-5
    assert a["num_inductor_compilations"] + b["num_inductor_compilations"] == 3  # one waited and loaded
    warm, _ = run_fresh(tmp_path, strict=True)
    assert warm["num_inductor_compilations"] == 0 and warm["num_artifacts_loaded"] == 3


def test_an_entry_compiled_after_another_in_one_process_holds_its_own_libraries(compiled_in_process, tmp_path):
    """Inductor keeps built kernels in memory by their source: without clearing that, a second
    entry compiled in the same process got no shared libraries and every warm start from it
    rebuilt them (12 s of C++ compiles for the bundled model on 2 cores). The first entry is the
    module's in-process compile of the same toy."""
    *_, first = compiled_in_process
    compile_toy(str(tmp_path / "second"))
    for root in (first, tmp_path / "second"):
        (entry,) = [p for p in root.iterdir() if p.is_dir()]
        listed = json.loads((entry / "index.json").read_text())["files"]
        libraries = [rel for rel in listed if rel.endswith(".so")]
        sources = [rel for rel in listed if rel.endswith(".main.cpp")]
        assert sources and len(libraries) == len(sources), (root, sorted(listed))


def test_the_saved_graph_loads_as_the_code_torch_fx_would_run(compiled_in_process):
    """load_graph rebuilds the split graph's modules from their pickled code without re-tracing
    them (traced_graph.SavedGraphModule): the code each runs is the code torch.fx's own loader
    regenerates, module for module, and the compiled pieces' places are there to install into."""
    import pickle

    from compiled_llm.compilation.traced_graph import GRAPH_FILE, SavedGraphModule, load_graph

    _, compiled, _, _ = compiled_in_process
    entry = Path(compiled.cache.entry)
    ours, theirs = load_graph(entry), pickle.loads((entry / GRAPH_FILE).read_bytes())
    assert isinstance(ours, SavedGraphModule) and "_graph" not in ours.__dict__  # no Graph kept...
    assert [n.format_node() for n in ours.graph.nodes] == [n.format_node() for n in theirs.graph.nodes]  # ...on asking
    pairs = [(ours, theirs), *zip(ours.children(), theirs.children())]
    assert [name for name, _ in ours.named_children()] == [name for name, _ in theirs.named_children()]
    modules = [(a, b) for a, b in pairs if isinstance(b, torch.fx.GraphModule)]
    assert len(modules) > 1  # the split graph and the attention modules between the pieces
    for a, b in modules:
        assert isinstance(a, SavedGraphModule) and a._code.strip() == b.code.strip()
