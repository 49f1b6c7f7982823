"""The `compiled-llm` command line: its subcommands and a completion printed by `generate`."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from compiled_llm.entrypoints.cli import SUBCOMMANDS, build_parser

TIMEOUT = 300


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "compiled_llm.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=TIMEOUT)


def test_engine_flags_reach_the_engine_config(real_model_path, tmp_path):
    from compiled_llm.engine.arg_utils import EngineArgs

    for command in ("serve", "precompile", "generate"):
        head = [command, "Hi"] if command == "generate" else [command]
        args = build_parser().parse_args(
            [*head, real_model_path, "-O", "1", "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "6",
             "--max-num-batched-tokens", "96", "--compile-cache", str(tmp_path), "--require-cache-hit",
             "--compile-ranges", "1-16,17-96", "--compile-sizes", "1,4", "--kv-cache-memory-bytes", str(8 << 20),
             "--no-enable-prefix-caching"])
        config = EngineArgs.from_cli_args(args).create_engine_config()
        cc = config.compilation_config
        assert str(config.model_config.dtype) == "torch.float32" and config.model_config.max_model_len == 512
        assert (config.scheduler_config.max_num_seqs, config.scheduler_config.max_num_batched_tokens) == (6, 96)
        assert config.cache_config.kv_cache_memory_bytes == 8 << 20 and not config.cache_config.enable_prefix_caching
        assert (cc.level, cc.cache_dir, cc.require_cache_hit) == (1, str(tmp_path), True), command
        assert cc.compile_ranges == [(1, 16), (17, 96)] and cc.compile_sizes == [1, 4]


def test_subcommands_and_defaults():
    assert {"serve", "generate", "precompile"} <= set(SUBCOMMANDS)
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.model is None and args.api_key is None
    args = build_parser().parse_args(["serve", "/m", "-O0", "--port", "9", "--api-key", "k", "--served-model-name",
                                      "n", "--max-model-len", "512", "--no-enable-prefix-caching"])
    got = (args.model, args.optimization_level, args.port, args.api_key, args.served_model_name)
    assert got == ("/m", 0, 9, "k", "n")
    assert args.max_model_len == 512 and args.enable_prefix_caching is False
    args = build_parser().parse_args(["generate", "Hi there", "/m", "--max-tokens", "3", "--chat"])
    assert (args.prompt, args.model, args.max_tokens, args.chat) == ("Hi there", "/m", 3, True)


def test_console_script_help():
    exe = shutil.which("compiled-llm")
    if exe is None:
        pytest.skip("the package is not installed (no console script)")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "serve" in out.stdout and "generate" in out.stdout


def test_generate_prints_a_completion(real_model_path):
    flags = ["-O0", "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20), "--max-tokens", "6"]
    plain = cli("generate", "The capital of France is", *flags)
    assert plain.returncode == 0, plain.stderr
    assert "Paris" in plain.stdout  # greedy, the bundled model
    chat = cli("generate", "Say hello.", real_model_path, "--chat", *flags)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip()


def test_serve_reports_a_bad_model_folder(tmp_path):
    out = cli("serve", str(tmp_path / "missing"), "-O0")
    assert out.returncode == 1 and "does not exist" in out.stderr


def test_auto_tool_choice_needs_a_parser():
    """Refused before the engine starts, in one line naming the missing flag."""
    out = cli("serve", "--enable-auto-tool-choice")
    assert out.returncode == 1 and "--tool-call-parser" in out.stderr


def test_server_flags_reach_server_args():
    from compiled_llm.entrypoints.openai.server_args import ServerArgs

    args = build_parser().parse_args(["serve", "--port", "9", "--max-n", "4", "--stream-interval", "2",
                                      "--tool-call-parser", "xlam", "--enable-auto-tool-choice"])
    assert ServerArgs.from_cli_args(args) == ServerArgs(port=9, max_n=4, stream_interval=2, tool_call_parser="xlam",
                                                        enable_auto_tool_choice=True)
    assert ServerArgs.from_cli_args(build_parser().parse_args(["serve"])) == ServerArgs()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--api-server-count", "0"])


def test_help_lists_developer_knobs_last(capsys):
    """The flags most users set come first; the compiler's and CUDA graphs' knobs and the dummy
    weights sit in the advanced group at the end."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    advanced = text.index("\nadvanced:")
    for knob in ("--compile-passes", "--inductor-options", "--cudagraph-mode", "--cudagraph-capture-sizes",
                 "--load-format"):
        assert text.index(f"\n  {knob}") > advanced, knob
    for common in ("--dtype", "--max-model-len", "--tensor-parallel-size", "--data-parallel-size", "--compile-cache",
                   "--host", "--port"):
        assert text.index(f"\n  {common}") < advanced, common
