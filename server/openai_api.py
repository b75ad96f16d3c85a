"""The OpenAI-compatible endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models.

One prompt and one choice per request (n=1); greedy when temperature is 0 (the default here, as
the engine's). Streaming sends server-sent events, `data: {chunk}\\n\\n`, ending with
`data: [DONE]`; with stream_options.include_usage every chunk carries "usage": null and a last
chunk with no choices carries the usage. Errors use OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.

Chat template (the sample model is a code model with no chat tokens, so this is plain text,
deterministic, and documented here rather than learned): every message becomes

    <|{role}|>\\n{content}\\n

in order, followed by `<|assistant|>\\n`, where the reply begins. Content is a string or a list
of {"type": "text", "text": ...} parts, joined with nothing between them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from moectl.engine.core.sampling import SamplingParams
from moectl.server.state import ServerState
from moectl.server.streams import AsyncRequestStream, TextDeltas

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 4  # as OpenAI
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
CLIENT_CHECK_S = 1.0  # how often a request with nothing new checks its client is still connected
ENCODE_OFF_LOOP_CHARS = 4096  # longer prompts are tokenized on a worker thread
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


class ApiError(Exception):
    """An error answered in OpenAI's shape; the message is one line."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> web.Response:
        return error_response(self.status, self.message, param=self.param, code=self.code, headers=self.headers)


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> web.Response:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def _param_of(message: str) -> str | None:
    """Engine and SamplingParams errors start with the field's name ("max_tokens: must be ...")."""
    head = message.split(":", 1)[0]
    return head if head.isidentifier() else None


# -- reading and checking a request body

async def read_json(request: web.Request, max_bytes: int) -> dict:
    if request.content_length is not None and request.content_length > max_bytes:
        raise ApiError(413, f"body: {request.content_length} bytes is over the limit of {max_bytes}")
    raw = await request.read()  # the app's client_max_size also stops a chunked body (413)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "body: not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body: must be a JSON object")
    return body


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(body: dict, name: str, lo: int, hi: int | None, default):
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ApiError(400, f"{name}: must be an integer {bound}, got {value!r}", param=name)
    return value


def _number(body: dict, name: str, lo: float, hi: float, default: float, *, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not (lo < value if lo_open else lo <= value) or value > hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise ApiError(400, f"{name}: must be a number in {interval}, got {value!r}", param=name)
    return float(value)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name}: must be true or false, got {value!r}", param=name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
            or any(not isinstance(s, str) or not s for s in stops)):
        raise ApiError(400, f"stop: must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them",
                       param="stop")
    return tuple(stops)


def _refuse_unsupported(body: dict, extra: dict) -> None:
    """Parameters this server does not implement are refused unless they ask for the default,
    so a client never silently gets something other than what it asked for."""
    defaults = {"n": 1, "best_of": 1, "echo": False, "suffix": None, "logprobs": None,
                "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, **extra}
    for name, default in defaults.items():
        value = body.get(name)
        if value is None or value == default or (name in ("logprobs", "logit_bias") and value in (False, 0, {})):
            continue
        raise ApiError(400, f"{name}: {value!r} is not supported by this server", param=name)


def _check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is None:
        return  # optional here: there is one model
    if not isinstance(model, str):
        raise ApiError(400, f"model: must be a string, got {model!r}", param="model")
    if model != served:
        raise ApiError(400, f"model: {model!r} is not served here (this server serves {served!r})",
                       param="model", code="model_not_found")


def _completion_prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    # OpenAI's batch forms are accepted with a single prompt in them
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt: is empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "prompt: one prompt per request (send several requests)", param="prompt")
    raise ApiError(400, "prompt: must be a non-empty string or a non-empty list of token ids", param="prompt")


def _message_text(i: int, message) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise ApiError(400, f"messages[{i}]: must be an object", param="messages")
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise ApiError(400, f"messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                       param="messages")
    if content is None and role == "assistant":
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return role, "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content: must be a string or a list of text parts", param="messages")


def chat_prompt(messages) -> str:
    """The chat template of the module doc."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: must be a non-empty list", param="messages")
    parts = [f"<|{role}|>\n{content}\n" for role, content in (_message_text(i, m) for i, m in enumerate(messages))]
    return "".join(parts) + "<|assistant|>\n"


@dataclass
class Generation:
    """What one request asked for, checked."""
    kind: str  # "completion" | "chat"
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    created: int


# -- the endpoints

class OpenAIApi:
    def __init__(self, state: ServerState):
        self.state = state

    def routes(self) -> list:
        return [web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat),
                web.get("/v1/models", self.models), web.get("/v1/models/{model}", self.model)]

    def _model_card(self) -> dict:
        return {"id": self.state.model_name, "object": "model", "created": int(self.state.started),
                "owned_by": "moectl", "max_model_len": self.state.driver.engine.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.state.model_name:
            raise ApiError(404, f"model: {request.match_info['model']!r} is not served here", param="model",
                           code="model_not_found")
        return web.json_response(self._model_card())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request, self.state.max_request_bytes)
        _check_model(body, self.state.model_name)
        _refuse_unsupported(body, {})
        prompt = _completion_prompt(body)
        gen = await self._generation("completion", "cmpl", body, prompt, DEFAULT_COMPLETION_MAX_TOKENS)
        return await self._run(request, gen)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request, self.state.max_request_bytes)
        _check_model(body, self.state.model_name)
        _refuse_unsupported(body, {"tools": None, "tool_choice": None, "functions": None, "top_logprobs": None})
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported", param="response_format")
        if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
            body = {**body, "max_tokens": body["max_completion_tokens"]}  # the newer name
        prompt = chat_prompt(body.get("messages"))
        gen = await self._generation("chat", "chatcmpl", body, prompt, None)
        return await self._run(request, gen)

    async def _generation(self, kind: str, id_prefix: str, body: dict, prompt, default_max_tokens) -> Generation:
        state = self.state
        if state.driver.error is not None:
            raise ApiError(503, f"the engine has failed ({state.driver.error}); restart it")
        max_tokens = _int(body, "max_tokens", 1, state.max_tokens_limit, default_max_tokens)
        temperature = _number(body, "temperature", 0.0, 2.0, 0.0)
        top_p = _number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True)
        top_k = _int(body, "top_k", -1, None, 0)  # vLLM's extension; -1 (or 0) means no top-k filter
        seed = _int(body, "seed", 0, 2**63 - 1, None)
        stop = _stop(body)
        ignore_eos = _bool(body, "ignore_eos")
        stream = _bool(body, "stream")
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or not stream):
            raise ApiError(400, "stream_options: must be an object, and only with stream: true",
                           param="stream_options")
        include_usage = _bool(options or {}, "include_usage")
        prompt_ids = await self._encode(prompt)
        if max_tokens is None:  # chat: up to what is left of the context and of a KV pool
            max_tokens = min(state.max_tokens_limit, self._room(len(prompt_ids)))
            if max_tokens < 1:
                raise ApiError(400, f"messages: {len(prompt_ids)} prompt tokens leave no room to reply",
                               param="messages", code="context_length_exceeded")
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                    top_k=max(top_k, 0), stop=stop, ignore_eos=ignore_eos, seed=seed)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=_param_of(str(exc))) from None
        return Generation(kind, f"{id_prefix}-{uuid.uuid4().hex}", prompt_ids, params, stream, include_usage,
                          int(time.time()))

    async def _encode(self, prompt) -> list[int]:
        engine = self.state.driver.engine
        try:
            if isinstance(prompt, str) and len(prompt) > ENCODE_OFF_LOOP_CHARS:
                return await asyncio.get_running_loop().run_in_executor(None, engine.encode, prompt)
            return engine.encode(prompt)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="prompt") from None

    def _room(self, prompt_tokens: int) -> int:
        engine = self.state.driver.engine
        pool_tokens = engine.blocks.largest_pool * engine.config.block_size
        return min(engine.max_model_len, pool_tokens) - prompt_tokens

    async def _run(self, request: web.Request, gen: Generation) -> web.StreamResponse:
        engine = self.state.driver.engine
        try:
            engine_stream = engine.add_request(gen.prompt_ids, gen.params, request_id=gen.request_id, stream=True)
        except ValueError as exc:
            message = str(exc)
            code = "context_length_exceeded" if "exceed" in message or "KV blocks" in message else None
            raise ApiError(400, message, param=_param_of(message), code=code) from None
        outputs = self.state.bridge.attach(engine_stream)
        response = None
        try:
            if gen.stream:
                response = web.StreamResponse(headers=SSE_HEADERS)
                await response.prepare(request)
                await self._stream(request, response, gen, outputs)
                return response
            return await self._complete(request, gen, outputs)
        except (ClientGone, ConnectionResetError):  # aborted below; nobody to answer
            return response or web.Response(status=499)
        finally:
            if not outputs.finished:  # the client left (or the handler was cancelled): free its KV blocks
                engine.abort(gen.request_id)

    async def _complete(self, request: web.Request, gen: Generation, outputs: AsyncRequestStream) -> web.Response:
        out = await _next_output(request, outputs)
        while not out.finished:
            out = await _next_output(request, outputs)
        if out.finish_reason == "error":
            raise ApiError(500, f"the engine failed while running this request ({self.state.driver.error})")
        usage = _usage(gen, out)
        if gen.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                      "logprobs": None, "finish_reason": out.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
            obj = "text_completion"
        return web.json_response({"id": gen.request_id, "object": obj, "created": gen.created,
                                  "model": self.state.model_name, "choices": [choice], "usage": usage})

    async def _stream(self, request: web.Request, response: web.StreamResponse, gen: Generation,
                      outputs: AsyncRequestStream) -> None:
        engine = self.state.driver.engine
        deltas = TextDeltas(engine.decode, gen.params.stop)
        chunk = chunk_factory(gen, self.state.model_name)
        if gen.kind == "chat":
            await _send(response, chunk({"role": "assistant", "content": ""}, None))
        while True:
            out = await _next_output(request, outputs)
            if out.finished:
                break
            text = deltas.update(out.token_ids)
            if text:
                await _send(response, chunk(text, None))
        if out.finish_reason == "error":
            message = f"the engine failed while running this request ({self.state.driver.error})"
            await _send(response, {"error": {"message": message, "type": "server_error", "param": None,
                                             "code": None}})
        else:
            await _send(response, chunk(deltas.finish(out.text), out.finish_reason))
            if gen.include_usage:
                await _send(response, {**chunk("", None), "choices": [], "usage": _usage(gen, out)})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()


class ClientGone(Exception):
    """The client closed its connection while its request ran."""


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _next_output(request: web.Request, outputs: AsyncRequestStream):
    while True:
        out = await outputs.get(timeout=CLIENT_CHECK_S)
        if out is not None:
            return out
        if _client_gone(request):  # for runners that do not cancel the handler when a client leaves
            raise ClientGone()


def _usage(gen: Generation, out) -> dict:
    prompt, completion = len(gen.prompt_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def chunk_factory(gen: Generation, model: str):
    """chunk(text_or_delta, finish_reason) -> one streamed chunk of this request's kind."""
    obj = "chat.completion.chunk" if gen.kind == "chat" else "text_completion"
    base = {"id": gen.request_id, "object": obj, "created": gen.created, "model": model}
    if gen.include_usage:
        base["usage"] = None

    def chunk(content, finish_reason) -> dict:
        if gen.kind == "chat":
            delta = content if isinstance(content, dict) else ({"content": content} if content else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}
        return {**base, "choices": [choice]}
    return chunk


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")
