"""Logprobs in the API's shapes: the completions API's legacy lists, chat's `content` entries,
and vLLM's `prompt_logprobs`. Logprobs of -inf (a banned token) are written as -9999, as OpenAI
and vLLM do: JSON has no infinity."""

from __future__ import annotations

from typing import Callable

from compiled_llm.entrypoints.openai.protocol import (
    ChatLogProbs,
    ChatLogProbsContent,
    ChatLogProbsTop,
    CompletionLogProbs,
    LogprobInfo,
    PromptLogprobsOut,
)
from compiled_llm.outputs import CompletionOutput, Logprob, PromptLogprobs

FLOOR = -9999.0
TokenText = Callable[[int], str]


def _finite(logprob: float) -> float:
    return max(logprob, FLOOR)


def _token(token_id: int, text: str | None, as_id: bool) -> str:
    """A token as the response names it: its text, or `token_id:N` (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_id else (text or "")


def completion_logprobs(
    output: CompletionOutput, num_top: int, text_offset: int, as_ids: bool = False,
    result: CompletionLogProbs | None = None,
) -> CompletionLogProbs:
    """OpenAI's legacy logprobs for the tokens of `output` (a delta or the whole completion),
    appended to `result` (the echoed prompt's, if any)."""
    result = result if result is not None else CompletionLogProbs()
    for token_id, entry in zip(output.token_ids, output.logprobs or []):
        sampled = entry[token_id]
        token = _token(token_id, sampled.decoded_token, as_ids)
        result.tokens.append(token)
        result.token_logprobs.append(_finite(sampled.logprob))
        result.text_offset.append(text_offset)
        text_offset += len(sampled.decoded_token or "")
        # As vLLM: the sampled token first, then the `num_top` best (so up to num_top + 1 entries,
        # and the sampled token even where it ranks below them).
        result.top_logprobs.append({
            _token(tid, lp.decoded_token, as_ids): _finite(lp.logprob) for tid, lp in list(entry.items())[: num_top + 1]
        })
    return result


def echo_logprobs(
    prompt_token_ids: list[int], prompt_logprobs: PromptLogprobs | None, num_top: int, token_text: TokenText,
    as_ids: bool = False,
) -> CompletionLogProbs:
    """The echoed prompt's tokens in the legacy shape: the first token has no logprob (nothing
    precedes it), each later one its logprob given the tokens before it, with its top candidates."""
    result = CompletionLogProbs()
    offset = 0
    for i, token_id in enumerate(prompt_token_ids):
        entry = prompt_logprobs[i] if prompt_logprobs is not None and i < len(prompt_logprobs) else None
        own = entry.get(token_id) if entry else None
        text = own.decoded_token if own is not None and own.decoded_token is not None else token_text(token_id)
        result.tokens.append(_token(token_id, text, as_ids))
        result.text_offset.append(offset)
        offset += len(text)
        if entry is None or own is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_finite(own.logprob))
        result.top_logprobs.append({
            _token(tid, lp.decoded_token, as_ids): _finite(lp.logprob) for tid, lp in list(entry.items())[: num_top + 1]
        })
    return result


def chat_logprobs(
    output: CompletionOutput, num_top: int, as_ids: bool = False, chosen: list[int] | None = None
) -> ChatLogProbs:
    """`chosen`: the request's logprob_token_ids, which are the alternatives (in their order) in
    place of the best `num_top`, after the sampled token where it is not one of them (vLLM)."""
    content = []
    for token_id, entry in zip(output.token_ids, output.logprobs or []):
        sampled = entry[token_id]
        text = sampled.decoded_token or ""
        if chosen:
            ids = chosen if token_id in chosen else [token_id, *chosen]
            alternatives = [(tid, entry[tid]) for tid in dict.fromkeys(ids) if tid in entry]
        else:
            alternatives = [(tid, lp) for tid, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
                            if lp.rank is not None and lp.rank <= num_top]
        top = [
            ChatLogProbsTop(token=_token(tid, lp.decoded_token, as_ids), logprob=_finite(lp.logprob),
                            bytes=list((lp.decoded_token or "").encode()))
            for tid, lp in alternatives
        ]
        content.append(ChatLogProbsContent(
            token=_token(token_id, text, as_ids), logprob=_finite(sampled.logprob), bytes=list(text.encode()),
            top_logprobs=top,
        ))
    return ChatLogProbs(content=content)


def _info(lp: Logprob) -> LogprobInfo:
    return LogprobInfo(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)


def prompt_logprobs_out(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobsOut | None:
    """vLLM's `prompt_logprobs` field: per prompt token, None or {token id: logprob, rank, text}."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else {str(tid): _info(lp) for tid, lp in entry.items()} for entry in prompt_logprobs]
