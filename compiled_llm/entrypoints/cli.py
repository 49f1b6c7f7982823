"""The `compiled-llm` command: one subcommand per job, each a pair of functions (add its
arguments, run it) in `SUBCOMMANDS`, so that adding one is adding an entry."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from compiled_llm import __version__


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_args: Callable[[argparse.ArgumentParser], object]
    run: Callable[[argparse.Namespace], int]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    # Defined here, not in api_server: building the parser must not import the server stack.
    from compiled_llm.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="Address to bind (default: 127.0.0.1, this machine only).")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="Require `Authorization: Bearer KEY` on /v1 and tokenizer routes.")
    g.add_argument("--max-n", type=int, default=128,
                   help="The most parallel samples (n, best_of) one request may ask for (default: 128).")
    g.add_argument("--max-request-body-bytes", type=int, default=None,
                   help="Larger request bodies get a 413 (default: twice the longest prompt that fits the "
                        "context, at least 8 MiB).")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="Accept a `chat_template` sent with a request (it is code; off by default).")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='Answer tool_choice "auto" (the default when a request has tools) by parsing the '
                        "model's text for tool calls, in the --tool-call-parser format.")
    g.add_argument("--tool-call-parser", choices=["hermes", "xlam"], default=None,
                   help="The format the model writes tool calls in: hermes (<tool_call>{...}</tool_call>; Hermes, "
                        "Qwen) or xlam (a JSON array of calls; SmolLM2, xLAM).")
    g.add_argument("--stream-interval", type=_positive_int, default=1, metavar="N",
                   help="Stream tokens in events of N (the first and last event excepted): one socket write and "
                        "wake-up per N tokens instead of per token, for many streams at a high token rate, at "
                        "the cost of coarser inter-token latency (default: 1).")
    g.add_argument("--api-server-count", type=_positive_int, default=1, metavar="N",
                   help="API server processes in front of the one engine core, sharing the port (each new "
                        "connection goes to one of them): one process streams on the order of 10k tokens/s, "
                        "a GPU can decode more at a large batch (default: 1).")
    g.add_argument("--engine-timeout", type=float, default=120.0,
                   help="Seconds without any engine output, while requests are open, after which the engine "
                        "counts as hung and the server exits (default: 120).")


def _run_serve(args: argparse.Namespace) -> int:
    from compiled_llm.entrypoints.openai.api_server import run_server
    from compiled_llm.utils import exit_without_teardown

    try:
        status = run_server(args)
    except KeyboardInterrupt:  # a signal while the engine starts
        status = 130
    # The server's clean-up is done (the engine and every worker process joined): the process ends
    # here, without a teardown of its heap that would add a second or more to every stop.
    exit_without_teardown(status)


def _add_generate_args(parser: argparse.ArgumentParser) -> None:
    from compiled_llm.engine.arg_utils import EngineArgs

    parser.add_argument("prompt", help="The prompt (a user message with --chat).")
    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default).")
    g.add_argument("--chat", action="store_true", help="Wrap the prompt in the model's chat template.")


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


SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": Subcommand("Serve a model over an OpenAI-compatible HTTP API.", _add_serve_args, _run_serve),
    "generate": Subcommand("Print a completion of one prompt (offline, no server).", _add_generate_args,
                           _run_generate),
    "precompile": Subcommand("Fill the compile cache for a model and settings (for CI and image builds).",
                             _add_precompile_args, _run_precompile),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compiled-llm", description="An LLM-serving runtime built around the compiler."
    )
    parser.add_argument("--version", action="version", version=f"compiled-llm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.add_args(p)
        p.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from compiled_llm.compilation.compile_cache import CompileCacheError

    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except (CompileCacheError, ValueError, FileNotFoundError) as e:
        # A user's mistake, a strict-mode cache miss or an unwritable cache: one clear line, no traceback.
        print(f"compiled-llm {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
