"""Prompts to token ids for the API: text (bounded before it is tokenized, and tokenized off the
event loop), token ids, and chats through the chat template.

A prompt too long for the context is refused from its length alone: no token of the vocabulary
decodes to more than `longest_token` characters, so a text of more than
SAFETY * longest_token * max_model_len characters cannot fit, and is never tokenized (a 1 MB
prompt would hold the loop, or a worker and the GIL, for seconds). Shorter texts are tokenized on
a worker thread through `encode_batch`, which releases the GIL.
"""

from __future__ import annotations

import asyncio

from moectl.server.api_request import ApiError, is_int
from moectl.server.chat_template import ChatTemplate, ChatTemplateError

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
SAFETY = 4  # normalisation (NFKC and the like) may change a text's length; keep well clear of it
ENCODE_OFF_LOOP_CHARS = 2048  # shorter texts tokenize in well under a millisecond, on the loop


class PromptEncoder:
    def __init__(self, engine, template: ChatTemplate):
        self.engine, self.template = engine, template
        tokenizer = engine.tokenizer
        self.tokenizer = tokenizer
        longest = max((len(t) for t in tokenizer.inner.get_vocab()), default=1) if tokenizer is not None else 1
        self.max_chars = SAFETY * longest * engine.max_model_len

    def _tokenizer(self, field: str):
        if self.tokenizer is None:
            raise ApiError(400, f"{field}: this checkpoint has no tokenizer.json; pass token ids", param=field)
        return self.tokenizer

    async def text(self, text: str, field: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        tokenizer = self._tokenizer(field)
        if len(text) > self.max_chars:
            raise ApiError(400, f"{field}: {len(text):,} characters cannot fit in the context of "
                           f"{self.engine.max_model_len} tokens", param=field, code="context_length_exceeded")

        def encode() -> list[int]:
            ids = tokenizer.inner.encode_batch([text], add_special_tokens=False)[0].ids
            return [tokenizer.bos_token_id, *ids] if add_special_tokens and tokenizer.add_bos else ids

        if len(text) <= ENCODE_OFF_LOOP_CHARS:
            return encode()
        return await asyncio.get_running_loop().run_in_executor(None, encode)

    def ids(self, ids, field: str = "prompt") -> list[int]:
        vocab = self.engine.model_config.vocab_size
        if not isinstance(ids, list) or not ids or not all(is_int(t) and 0 <= t < vocab for t in ids):
            raise ApiError(400, f"{field}: token ids must be a non-empty list of integers in [0, {vocab})", param=field)
        if len(ids) > self.engine.max_model_len:
            raise ApiError(400, f"{field}: {len(ids)} tokens exceed the context of {self.engine.max_model_len}",
                           param=field, code="context_length_exceeded")
        return ids

    def chat_text(self, messages, add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(normalise_messages(messages), add_generation_prompt)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None

    async def chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        text = self.chat_text(messages, add_generation_prompt)
        # a checkpoint's template writes its own BOS; the fallback is plain text, tokenized as a prompt
        return await self.text(text, "messages", add_special_tokens=self.template.is_fallback)


def normalise_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: must be a non-empty list", param="messages")
    return [{"role": role, "content": content} for role, content in (_message(i, m) for i, m in enumerate(messages))]


def _message(i: int, message) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise ApiError(400, f"messages[{i}]: must be an object", param="messages")
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise ApiError(400, f"messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}, got {role!r}"[:200],
                       param="messages")
    if content is None and role == "assistant":
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return role, "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content: must be a string or a list of text parts", param="messages")
