"""vLLM's tokenizer endpoints (lm-evaluation-harness uses them as its "remote" tokenizer):

    POST /tokenize        {"prompt": str, "add_special_tokens": true} or
                          {"messages": [...], "add_generation_prompt": true}
                          -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize      {"tokens": [ids]} -> {"prompt": str}
    GET  /tokenizer_info  -> {"tokenizer_class", "bos_token", "eos_token", "pad_token",
                              "chat_template", "chat_template_origin", "model_max_length"}
"""

from __future__ import annotations

import json
from pathlib import Path

from aiohttp import web

from moectl.server.api_request import ApiError, IgnoredFields, bool_field, check_model, is_int, read_json
from moectl.server.prompts import PromptEncoder
from moectl.server.state import ServerState

TOKENIZE_FIELDS = frozenset(("model", "prompt", "messages", "add_generation_prompt", "add_special_tokens",
                             "return_token_strs"))
DETOKENIZE_FIELDS = frozenset(("model", "tokens"))


class TokenizeApi:
    def __init__(self, state: ServerState, encoder: PromptEncoder):
        self.state, self.encoder = state, encoder
        self.ignored = IgnoredFields()  # any other field is served without and named (as openai_api's)

    def routes(self) -> list:
        return [web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize),
                web.get("/tokenizer_info", self.tokenizer_info)]

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request, self.state.max_request_bytes)
        ignored = self.ignored.headers(body, TOKENIZE_FIELDS, request.path)
        check_model(body, self.state.model_name)
        prompt, messages = body.get("prompt"), body.get("messages")
        if (prompt is None) == (messages is None):
            raise ApiError(400, "prompt: give either prompt (a string) or messages", param="prompt")
        if messages is not None:
            ids = await self.encoder.chat(messages, bool_field(body, "add_generation_prompt", True))
        elif isinstance(prompt, str):
            ids = await self.encoder.text(prompt, "prompt", bool_field(body, "add_special_tokens", True))
        else:
            raise ApiError(400, "prompt: must be a string", param="prompt")
        engine = self.state.driver.engine
        strs = None
        if bool_field(body, "return_token_strs"):
            strs = [engine.tokenizer.inner.id_to_token(i) for i in ids]
        return web.json_response({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                                  "token_strs": strs}, headers=ignored)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request, self.state.max_request_bytes)
        ignored = self.ignored.headers(body, DETOKENIZE_FIELDS, request.path)
        check_model(body, self.state.model_name)
        ids = body.get("tokens")
        vocab = self.state.driver.engine.model_config.vocab_size
        if not isinstance(ids, list) or not all(is_int(t) and 0 <= t < vocab for t in ids):
            raise ApiError(400, f"tokens: must be a list of integers in [0, {vocab})", param="tokens")
        if self.encoder.tokenizer is None:
            raise ApiError(400, "tokens: this checkpoint has no tokenizer.json to decode with", param="tokens")
        return web.json_response({"prompt": self.state.driver.engine.decode(ids)}, headers=ignored)

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        engine = self.state.driver.engine
        template = self.encoder.template
        info = {"tokenizer_class": _tokenizer_class(engine.config.model), **template.special_tokens,
                "chat_template": template.source, "chat_template_origin": template.origin,
                "model_max_length": engine.max_model_len}
        return web.json_response(info)


def _tokenizer_class(model_dir) -> str | None:
    try:
        config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get("tokenizer_class") if isinstance(config, dict) else None
    return value if isinstance(value, str) else None
