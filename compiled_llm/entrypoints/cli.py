"""The `compiled-llm` command: one subcommand per job, each a pair of functions (add its
arguments, run it) in `SUBCOMMANDS`, so that adding one is adding an entry."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from compiled_llm import __version__

if TYPE_CHECKING:
    from compiled_llm.engine.arg_utils import EngineArgs
    from compiled_llm.entrypoints.openai.server_args import ServerArgs


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_args: Callable[[argparse.ArgumentParser], object]
    run: Callable[[argparse.Namespace], int]


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    # Defined here, not in api_server: building the parser must not import the server stack.
    from compiled_llm.engine.arg_utils import EngineArgs, add_cli_args
    from compiled_llm.entrypoints.openai.server_args import ServerArgs

    add_cli_args(parser, EngineArgs, ServerArgs)


def _run_serve(args: argparse.Namespace) -> int:
    """One API server process in front of the engine, or a group of them (`--api-server-count`)."""
    from compiled_llm.engine.arg_utils import EngineArgs
    from compiled_llm.entrypoints.openai.server_args import ServerArgs
    from compiled_llm.utils import exit_without_teardown

    server_args, engine_args = ServerArgs.from_cli_args(args), EngineArgs.from_cli_args(args)
    try:
        if server_args.api_server_count > 1:  # this process only supervises: it freezes no heap
            import gc

            gc.enable()
            from compiled_llm.entrypoints.openai.api_server_group import run_api_server_group

            status = run_api_server_group(server_args, engine_args)
        else:
            status = _serve_one(server_args, engine_args)
    except KeyboardInterrupt:  # a signal while the engine starts
        status = 130
    # The server's clean-up is done (the engine and every worker process joined): the process ends
    # here, without a teardown of its heap that would add a second or more to every stop.
    exit_without_teardown(status)


def _serve_one(server_args: ServerArgs, engine_args: EngineArgs) -> int:
    """One API server process. Its engine core starts first, forked where that is safe, before
    this process imports the server stack (FastAPI, the tokenizer's transformers pieces): the two
    load side by side, and the engine inherits what was imported for the config (torch among it)."""
    import signal

    from compiled_llm.engine.engine_process import EngineProcess
    from compiled_llm.logger import init_logger

    # Until uvicorn installs its own handlers, SIGTERM unwinds like Ctrl-C, so the engine is stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        config = engine_args.create_engine_config()
    except (ValueError, OSError) as e:  # a bad model folder or setting, said plainly
        init_logger(__name__).error("%s", e)
        return 1
    engine = None
    if config.parallel_config.data_parallel_size == 1:
        # Nothing in this process has computed with torch or started a thread of its own yet.
        engine = EngineProcess(config, fork=True)
        engine.start(engine.output_bind_address)
    try:
        from compiled_llm.entrypoints.openai.api_server import run_server
    except BaseException:
        if engine is not None:
            engine.stop()
        raise
    return run_server(server_args, engine_args, config, engine)


def _add_generate_args(parser: argparse.ArgumentParser) -> None:
    from compiled_llm.engine.arg_utils import EngineArgs

    parser.add_argument("prompt", help="The prompt (a user message with --chat).")
    g = parser.add_argument_group("sampling")  # first: what a completion is asked for
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default).")
    g.add_argument("--chat", action="store_true", help="Wrap the prompt in the model's chat template.")
    EngineArgs.add_cli_args(parser)


def _run_generate(args: argparse.Namespace) -> int:
    from compiled_llm import SamplingParams
    from compiled_llm.engine.arg_utils import EngineArgs
    from compiled_llm.entrypoints.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**dataclasses.asdict(engine_args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


def _add_precompile_args(parser: argparse.ArgumentParser) -> None:
    from compiled_llm.entrypoints.precompile import add_precompile_args

    add_precompile_args(parser)


def _run_precompile(args: argparse.Namespace) -> int:
    from compiled_llm.entrypoints.precompile import run_precompile

    return run_precompile(args)


def _add_cache_args(parser: argparse.ArgumentParser) -> None:
    from compiled_llm.entrypoints.cache_cli import add_cache_args

    add_cache_args(parser)


def _run_cache(args: argparse.Namespace) -> int:
    from compiled_llm.entrypoints.cache_cli import run_cache

    return run_cache(args)


SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": Subcommand("Serve a model over an OpenAI-compatible HTTP API.", _add_serve_args, _run_serve),
    "generate": Subcommand("Print a completion of one prompt (offline, no server).", _add_generate_args,
                           _run_generate),
    "precompile": Subcommand("Fill the compile cache for a model and settings (for CI and image builds).",
                             _add_precompile_args, _run_precompile),
    "cache": Subcommand("Inspect and manage the compile cache: list, verify, prune, explain, export, import.",
                        _add_cache_args, _run_cache),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; `only`: just that subcommand's arguments (the others are listed by
    name), because adding a subcommand's arguments imports its modules, and `serve` starts the
    engine only after its command line is read (`cache`'s alone cost 0.07 s there)."""
    parser = argparse.ArgumentParser(
        prog="compiled-llm", description="An LLM-serving runtime built around the compiler."
    )
    parser.add_argument("--version", action="version", version=f"compiled-llm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        if only is None or only == name:
            command.add_args(p)
        p.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    chosen = next((w for w in words if not w.startswith("-")), None)
    if chosen != "serve":
        return _main(chosen, argv)
    from compiled_llm.utils import gc_paused

    # No collection walks serve's start-up heap as it is made (torch's modules first); each of its
    # processes collects and freezes it once, when made (utils.freeze_gc_heap), and collects on.
    with gc_paused():
        return _main(chosen, argv)


def _main(chosen: str | None, argv: Sequence[str] | None) -> int:
    args = build_parser(chosen if chosen in SUBCOMMANDS else None).parse_args(argv)
    from compiled_llm.utils import UserError

    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except (UserError, ValueError, FileNotFoundError) as e:
        # A user's mistake, a strict-mode cache miss or an unwritable cache: one clear line, no traceback.
        print(f"compiled-llm {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
