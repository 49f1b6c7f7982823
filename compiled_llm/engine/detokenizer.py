"""Incremental detokenization and stop strings, on the frontend side.

Text is produced token by token with the tokenizers library's `DecodeStream` (which holds back
incomplete UTF-8 sequences), primed with the prompt's last tokens so that the first generated
token decodes with the right leading space. Stop strings are searched only in the tail that
could contain a new match, so a stop string split across tokens is still found.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from compiled_llm.sampling_params import SamplingParams

_PRIME_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "_tokenizer", None)
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = params.stop or []  # type: ignore[assignment]
        self.include_stop = params.include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.min_tokens = params.min_tokens
        self.num_tokens = 0  # output tokens seen
        self._stop_search_from = 0  # stop strings may not start in the first min_tokens' text
        self.output_text = ""
        self._sent = 0  # characters already handed out as deltas
        self._token_ids: list[int] = []
        self._window_text: str | None = None
        self._prefix = prompt_token_ids[-_PRIME_TOKENS:]
        self.stream = (
            DecodeStream(ids=self._prefix, skip_special_tokens=self.skip_special_tokens)
            if self.backend is not None
            else None
        )

    def _decode_step(self, token_id: int) -> str:
        if self.stream is not None:
            return self.stream.step(self.backend, token_id) or ""
        # Slow path for tokenizers without a `tokenizers` backend: decode the window and diff.
        self._token_ids.append(token_id)
        text = self.tokenizer.decode(self._prefix + self._token_ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        if self._window_text is None:
            self._window_text = self.tokenizer.decode(self._prefix, skip_special_tokens=self.skip_special_tokens)
        chunk, self._window_text = text[len(self._window_text) :], text
        return chunk

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> tuple[str | None, int]:
        """Add tokens; return (the stop string hit or None, how many of the tokens were used).

        `stop_terminated`: the engine stopped on the last token (EOS or a stop token id); as in
        vLLM, its text is left out unless `include_stop_str_in_output`. Stop strings are only
        looked for in text that comes after the first `min_tokens` tokens.
        """
        for used, token_id in enumerate(new_token_ids, start=1):
            self.num_tokens += 1
            if stop_terminated and used == len(new_token_ids) and not self.include_stop:
                break
            chunk = self._decode_step(token_id)
            if not chunk:
                continue
            self.output_text += chunk
            if self.num_tokens <= self.min_tokens:
                self._stop_search_from = len(self.output_text)
            elif self.stop:
                hit = self._find_stop(len(chunk))
                if hit is not None:
                    return hit, used
        return None, len(new_token_ids)

    def _find_stop(self, new_chars: int) -> str | None:
        text = self.output_text
        window_start = max(self._stop_search_from, len(text) - new_chars - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = text.find(stop, window_start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.output_text = text[: index + len(stop)] if self.include_stop else text[:index]
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to hand out now. While running, the last `max_stop_len - 1` characters are held
        back when stop strings are set: they may yet turn out to start a stop string."""
        hold = 0 if finished or not self.stop or self.include_stop else self.max_stop_len - 1
        end = max(len(self.output_text) - hold, self._sent if delta else 0)
        if not delta:
            return self.output_text[:end]
        text = self.output_text[self._sent : end]
        self._sent = end
        return text
