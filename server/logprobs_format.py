"""Engine log-probabilities in the API's two shapes.

    /v1/completions       {"tokens", "token_logprobs", "top_logprobs", "text_offset"}: the top
                          dict maps token text to logprob and holds the chosen token too (as vLLM);
                          with echo the prompt comes first, its first token with None (nothing
                          predicts it)
    /v1/chat/completions  {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}

A token's text is its own decode; `return_tokens_as_token_ids` (vLLM's option) gives
"token_id:{id}" instead, so tokens whose text is not printable stay distinct. -inf becomes
-9999.0 (JSON has no infinity), as vLLM does.
"""

from __future__ import annotations

import math

FLOOR = -9999.0


class TokenText:
    """id -> its text, cached: the same few thousand ids recur in every response."""

    def __init__(self, decode, as_ids: bool = False):
        self._decode, self._as_ids, self._cache = decode, as_ids, {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = f"token_id:{token_id}" if self._as_ids else self._decode([token_id])
            if len(self._cache) < 1 << 17:
                self._cache[token_id] = text
        return text


def _value(lp: float) -> float:
    return lp if math.isfinite(lp) else FLOOR


class CompletionLogprobs:
    """Builds the completions shape piece by piece (a stream sends each piece in its chunk)."""

    def __init__(self, text_of: TokenText):
        self.text_of, self.offset = text_of, 0

    def piece(self, token_ids: list[int], entries: list) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for token, entry in zip(token_ids, entries):
            text = self.text_of(token)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            lp, top = entry
            values.append(_value(lp))
            alternatives = {self.text_of(i): _value(v) for i, v in top}
            alternatives.setdefault(text, _value(lp))
            tops.append(alternatives)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def merge_pieces(pieces: list[dict]) -> dict:
    return {key: [v for p in pieces for v in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                    "text_offset")}


def chat_logprobs(text_of: TokenText, token_ids: list[int], entries: list, top_n: int) -> dict:
    content = []
    for token, (lp, top) in zip(token_ids, entries):
        text = text_of(token)
        content.append({"token": text, "logprob": _value(lp), "bytes": list(text.encode("utf-8")),
                        "top_logprobs": [{"token": text_of(i), "logprob": _value(v),
                                          "bytes": list(text_of(i).encode("utf-8"))} for i, v in top[:top_n]]})
    return {"content": content}
