"""The frontend's work per streamed token, and the output rate one core of it can sustain.

What the API server's process does for every token of every stream after the engine core sent it:
decode the step's message (msgspec, as from the ZeroMQ socket), turn the step's outputs into
`RequestOutput`s (`OutputProcessor.process_outputs`: incremental detokenization, stop checks,
metrics) and encode each as a chat SSE event (`stream_events.py`). The real tokenizer (the bundled
SmolLM2's) and English-like token streams, `--streams` requests decoding together, one token each
a step. Not counted: the socket itself and uvicorn writing the event to the connection.

The printed ceiling (1e6 / microseconds a token) is what one core could serve if the frontend did
nothing else; issue 13 asks `serve` with 32 streams for half the offline batch-32 rate of a GPU.

`--serve` measures all of it instead, socket and HTTP included: a real `compiled-llm serve` (the
bundled model, -O1) under `--streams` streaming clients (another process, as serve.py's), and the
CPU time the server's own process (the frontend: uvicorn, the OpenAI handlers, AsyncLLM; not the
engine core's process) spent per streamed token, for each `--stream-interval` asked for.

    python benchmarks/frontend_per_token.py [--streams 32] [--steps 512] [--serve [--stream-intervals 1,4]]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import msgspec
from machine import format_machine, machine_report
from transformers import AutoTokenizer
from workload import english_like_ids

from compiled_llm.bundled_model import bundled_model_path
from compiled_llm.engine.output_processor import OutputProcessor
from compiled_llm.entrypoints.openai.stream_events import chat_choice, chat_chunk, content_delta
from compiled_llm.messages.engine_core import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from compiled_llm.sampling_params import RequestOutputKind, SamplingParams


def run_once(tokenizer, streams: int, steps: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=steps, output_kind=RequestOutputKind.DELTA)
    tokens = []
    for i in range(streams):
        prompt = english_like_ids(tokenizer, 64, rng)
        processor.add_user_request(EngineCoreRequest(f"r{i}", prompt, params), None)
        tokens.append(english_like_ids(tokenizer, steps, rng))
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreOutputs)
    messages = [encoder.encode(EngineCoreOutputs([EngineCoreOutput(f"r{i}", [tokens[i][s]]) for i in range(streams)]))
                for s in range(steps)]
    spent = {"decode_message": 0.0, "process_outputs": 0.0, "encode_events": 0.0}
    for message in messages:
        t0 = time.perf_counter()
        outputs = decoder.decode(message)
        t1 = time.perf_counter()
        processed = processor.process_outputs(outputs.outputs)
        t2 = time.perf_counter()
        for out in processed.request_outputs:
            chat_chunk("chatcmpl-" + out.request_id, 1700000000, "m",
                       [chat_choice(0, content_delta(out.outputs[0].text))])
        t3 = time.perf_counter()
        spent["decode_message"] += t1 - t0
        spent["process_outputs"] += t2 - t1
        spent["encode_events"] += t3 - t2
    return {k: v / (streams * steps) * 1e6 for k, v in spent.items()}


def serve_cpu_per_token(streams: int, requests: int, output_len: int, runs: int, interval: int) -> list[float]:
    """The server process's CPU microseconds per streamed token, one figure a run."""
    import psutil
    from serve import our_server, run_level

    args = argparse.Namespace(threads=2, optimization_level=None, compile_cache=None)
    server = our_server(str(bundled_model_path()), args, "float32", ("--stream-interval", str(interval)))
    try:
        server.wait_ready()
        process = psutil.Process(server.proc.pid)  # its own CPU time, not its children's (the engine core)
        prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)
        figures = []
        for _ in range(runs):
            before = process.cpu_times()
            result = asyncio.run(run_level(server, [(prompt, output_len)] * requests, streams))
            after = process.cpu_times()
            tokens = result.row()["output_tokens"]
            cpu = (after.user - before.user) + (after.system - before.system)
            figures.append(cpu / tokens * 1e6)
            print(f"  serve, {streams} streams, stream interval {interval}: {tokens} tokens in {result.wall:.1f} s, "
                  f"server process CPU {cpu:.2f} s = {figures[-1]:.1f} us a token", flush=True)
        return figures
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--serve", action="store_true", help="measure through a real server instead")
    parser.add_argument("--stream-intervals", default="1,4", help="with --serve: the servers' --stream-interval")
    parser.add_argument("--output-len", type=int, default=128, help="with --serve: tokens a request")
    args = parser.parse_args()
    if args.serve:
        for interval in [int(n) for n in args.stream_intervals.split(",")]:
            figures = serve_cpu_per_token(args.streams, 2 * args.streams, args.output_len, min(args.runs, 3), interval)
            us = statistics.median(figures)
            print(f"server process, stream interval {interval}: {us:.1f} us of CPU a streamed token -> one core "
                  f"sustains {1e6 / us:,.0f} tok/s ({args.streams} streams, median of {len(figures)} runs)",
                  flush=True)
        return
    print(format_machine(machine_report(1)))
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    runs = [run_once(tokenizer, args.streams, args.steps, seed) for seed in range(args.runs)]
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    total = sum(medians.values())
    for k, v in medians.items():
        print(f"{k:>16}: {v:6.2f} us a token")
    print(f"{'total':>16}: {total:6.2f} us a token -> one core sustains {1e6 / total:,.0f} tok/s "
          f"({args.streams} streams, medians of {args.runs} runs)")


if __name__ == "__main__":
    main()
