"""Incremental detokenization that never emits half a UTF-8 character.

A character such as "é" or an emoji can span several byte-level tokens; decoding a prefix of them
gives U+FFFD. We decode a short window of recent tokens twice (without and with the newest ones)
and emit only the difference, and hold it back while it ends in U+FFFD:

    tokens   ... | prefix_offset ... read_offset | new tokens
    emitted  = decode(prefix_offset:) minus decode(prefix_offset:read_offset)
"""

from __future__ import annotations

from kvpage.models.tokenizer import Tokenizer

_WINDOW = 6  # tokens of context before the read offset, enough for any merge across a boundary


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids[-_WINDOW:])  # context, so the first output token decodes right
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the new complete text (possibly empty)."""
        self.tokens.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.tokens[self.prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = max(self.read_offset, len(self.tokens) - _WINDOW)
        self.read_offset = len(self.tokens)
        self.text += delta
        return delta


def find_stop_string(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the newest `num_new_chars` characters of `text`
    (so one that spans token boundaries is found once its last part arrives): (start, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start_search = max(0, len(text) - num_new_chars - len(stop) + 1)
        i = text.find(stop, start_search)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best
