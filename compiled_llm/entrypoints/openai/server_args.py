"""`ServerArgs`: the OpenAI server's own settings (where it listens, what a request may ask for, how
it streams, how many processes serve), beside the engine's `EngineArgs`.

Its flags are generated from its fields by the machinery that builds the engine's
(`engine/arg_utils.py`), so a new server setting is one field, and its default is stated once.
The server code receives a `ServerArgs`, never the parsed command line.
"""

from __future__ import annotations

from dataclasses import dataclass

from compiled_llm.config import METRICS_NAMESPACES
from compiled_llm.engine.admission import AdmissionLimits
from compiled_llm.engine.arg_utils import CliArgs, non_negative_int, positive_int, setting
from compiled_llm.entrypoints.chat_utils import CONTENT_FORMATS, load_chat_template
from compiled_llm.entrypoints.openai.lora_modules import LoRAModulePath, parse_lora_module
from compiled_llm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from compiled_llm.entrypoints.openai.tool_parsers import TOOL_PARSERS

SERVER = "server"  # the help group


@dataclass(frozen=True)
class ServerArgs(CliArgs):
    host: str = setting("127.0.0.1", "Address to bind (default: 127.0.0.1, this machine only).", group=SERVER)
    port: int = setting(8000, "Port to bind (default: 8000).", group=SERVER)
    api_key: str | None = setting(None, "Require `Authorization: Bearer KEY` on /v1 and tokenizer routes.",
                                  group=SERVER)
    max_n: int = setting(128, "The most parallel samples (n, best_of) one request may ask for (default: 128).",
                         group=SERVER)
    max_request_body_bytes: int | None = setting(
        None, "Larger request bodies get a 413 (default: twice the longest prompt that fits the context, at least "
        "8 MiB).", group=SERVER)
    chat_template: str | None = setting(
        None, "The chat template to use instead of the model's: a file, or the template itself (default: the "
        "model's).", group=SERVER, metavar="FILE_OR_TEMPLATE")
    chat_template_content_format: str = setting(
        "auto", "How message content reaches the chat template: string (the text), openai (a list of "
        '{"type": "text", "text": ...} parts), or auto (as the template reads it; default).', group=SERVER,
        choices=CONTENT_FORMATS)
    trust_request_chat_template: bool = setting(
        False, "Accept a `chat_template` sent with a request (it is code; off by default).", group=SERVER)
    enable_auto_tool_choice: bool = setting(
        False, 'Answer tool_choice "auto" (the default when a request has tools) by parsing the model\'s text for '
        "tool calls, in the --tool-call-parser format.", group=SERVER)
    tool_call_parser: str | None = setting(
        None, "The format the model writes tool calls in: hermes (<tool_call>{...}</tool_call>; Hermes, Qwen) or "
        "xlam (a JSON array of calls; SmolLM2, xLAM).", group=SERVER, choices=TOOL_PARSERS)
    enable_tokenizer_info_endpoint: bool = setting(
        False, "Serve GET /tokenizer_info: the tokenizer's configuration and the chat template (off by default: "
        "it shows the template and the model's folder).", group=SERVER)
    enable_prompt_tokens_details: bool = setting(
        False, "Give usage.prompt_tokens_details (cached_tokens: prompt tokens served from the prefix cache) in "
        "responses; off by default, as vLLM (clients that compare usage objects expect none).", group=SERVER)
    return_tokens_as_token_ids: bool = setting(
        False, 'Name each logprobs token "token_id:<id>" in every response, for requests that do not set '
        "return_tokens_as_token_ids themselves (vLLM's flag).", group=SERVER)
    enable_force_include_usage: bool = setting(
        False, "Put usage in every streamed chunk of every completion and chat completion, as if each request "
        "asked for stream_options include_usage and continuous_usage_stats (vLLM's flag).", group=SERVER)
    enable_server_load_tracking: bool = setting(
        False, "Count the requests in progress on the generation routes, for GET /load (as vLLM).", group=SERVER)
    reasoning_parser: str | None = setting(
        None, "Split the model's thinking from its answer into the message's `reasoning` (and `reasoning_content`), "
        "streamed as their own deltas: qwen3 (as vLLM 0.32: reasoning from the output's start until </think> or a "
        "<tool_call>; all content with chat_template_kwargs enable_thinking false) or deepseek_r1 (reasoning from "
        "the output's start until </think>, the template having opened the block).", group=SERVER,
        choices=REASONING_PARSERS)
    lora_modules: list[LoRAModulePath] | None = setting(
        None, "LoRA adapters a request may name as its `model`: name=path (a PEFT folder) or JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}, several after one flag (needs --enable-lora).',
        group=SERVER, parse=parse_lora_module, nargs="+", metavar="NAME=PATH")
    stream_interval: int = setting(
        1, "Stream tokens in events of N (the first and last event excepted): one socket write and wake-up per N "
        "tokens instead of per token, for many streams at a high token rate, at the cost of coarser inter-token "
        "latency (default: 1).", group=SERVER, parse=positive_int, metavar="N")
    api_server_count: int = setting(
        1, "API server processes in front of the one engine core, sharing the port (each new connection goes to "
        "one of them): one process streams on the order of 10k tokens/s, a GPU can decode more at a large batch "
        "(default: 1).", group=SERVER, parse=positive_int, metavar="N")
    max_num_queued_reqs: int | None = setting(
        None, "Refuse a request with a 503 (retry later or elsewhere) when the sequences in flight, waiting or "
        "running, would exceed N (a request of n samples counts n; per API server process; default: no limit).",
        group=SERVER, parse=non_negative_int, metavar="N")
    max_num_queued_tokens: int | None = setting(
        None, "Refuse a request with a 503 while the prompts not yet through their prefill hold N tokens or more: "
        "a bound on time to first token (per API server process; default: no limit).", group=SERVER,
        parse=non_negative_int, metavar="N")
    metrics_namespace: str = setting(
        METRICS_NAMESPACES[0], "The prefix of the Prometheus metrics' names: compiled_llm (compiled_llm:num_requests_"
        "running, ...; default) or vllm (vllm:num_requests_running, ...: the same metrics under vLLM's names, for "
        "dashboards and alerts made for vLLM).", group=SERVER, choices=METRICS_NAMESPACES)
    engine_timeout: float = setting(
        120.0, "Seconds without any engine output, while requests are open, after which the engine counts as hung "
        "and the server exits (default: 120).", group=SERVER)

    def admission_limits(self) -> AdmissionLimits | None:
        """The frontend's queue limits, None without any."""
        if self.max_num_queued_reqs is None and self.max_num_queued_tokens is None:
            return None
        return AdmissionLimits(self.max_num_queued_reqs, self.max_num_queued_tokens)

    def __post_init__(self) -> None:
        load_chat_template(self.chat_template)  # a file that cannot be read fails here, before the engine starts
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"--chat-template-content-format must be one of {', '.join(CONTENT_FORMATS)}, got "
                             f"{self.chat_template_content_format!r}.")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(TOOL_PARSERS)}).")
