"""The OpenAI-compatible endpoints, as vLLM serves them: POST /v1/completions, POST
/v1/chat/completions, GET /v1/models (tokenize_api.py has /tokenize, /detokenize, /tokenizer_info).

- Completions take a prompt as text or token ids, or a list of them (a batch: choice
  `index` = prompt * n + j); `echo` returns the prompt before the completion (with its
  log-probabilities when `logprobs` is set), and `max_tokens: 0` with echo only scores the prompt.
- `n` choices per prompt; `best_of` candidates of which the n with the highest cumulative
  log-probability are returned (not with streaming, as vLLM). Each choice is its own engine request;
  with a `seed`, choice j draws with seed + j.
- `logprobs` (completions: top N, 0-20) and chat's `logprobs` / `top_logprobs` report the model's
  own log-probabilities (logprobs_format.py), before temperature and penalties.
- `stop`, `stop_token_ids`, `seed`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`,
  `top_k`, `ignore_eos`, `stream_options.include_usage`.
- Greedy when temperature is 0 (the default here, as the engine's).
- Streaming sends server-sent events, `data: {chunk}\\n\\n`, ending with `data: [DONE]`; with
  stream_options.include_usage every chunk carries "usage": null and a last chunk with no
  choices carries the usage.
- Chats go through the checkpoint's chat template, or the stated fallback (chat_template.py).
- Fields this server does not implement get a 400 naming the field, unless they ask for the default.
- Errors use OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from moectl.engine.core.sampling import MAX_LOGPROBS, SamplingParams
from moectl.server.api_request import (
    ApiError,
    bool_field,
    check_model,
    int_field,
    is_int,
    number_field,
    param_of,
    read_json,
)
from moectl.server.logprobs_format import CompletionLogprobs, TokenText, chat_logprobs, merge_pieces
from moectl.server.prompts import PromptEncoder
from moectl.server.state import ServerState
from moectl.server.streams import AsyncRequestStream, TextDeltas

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 64  # OpenAI allows 4; vLLM has no limit, and lm-eval sends a task's `until` + EOS (often 5-6)
MAX_N = 16  # choices (or best_of candidates) per prompt
MAX_BATCH = 64  # prompts per completions request
MAX_CANDIDATES = 128  # engine requests per API request
CLIENT_CHECK_S = 1.0  # how often a request with nothing new checks its client is still connected
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# fields of OpenAI's or vLLM's API that this server does not implement -> the value that means "off"
UNSUPPORTED = {"suffix": None, "logit_bias": None, "min_p": 0, "min_tokens": 0, "use_beam_search": False,
               "length_penalty": 1, "include_stop_str_in_output": False, "skip_special_tokens": True,
               "prompt_logprobs": None, "truncate_prompt_tokens": None, "guided_json": None, "guided_regex": None,
               "guided_choice": None, "guided_grammar": None, "structured_outputs": None, "allowed_token_ids": None,
               "bad_words": None, "tools": None, "tool_choice": None, "functions": None, "function_call": None,
               "parallel_tool_calls": None, "audio": None, "prediction": None}
CHAT_ONLY = ("messages", "top_logprobs", "max_completion_tokens", "response_format", "add_generation_prompt")
COMPLETION_ONLY = ("prompt", "echo", "best_of")


@dataclass
class Candidate:
    """One engine request: a choice, or one of best_of candidates."""
    prompt_index: int
    request_id: str
    params: SamplingParams
    outputs: AsyncRequestStream | None = None
    final: object = None  # the finished RequestOutput


@dataclass
class Job:
    """What one API request asked for, checked."""
    kind: str  # "completion" | "chat"
    request_id: str
    created: int
    prompts: list[list[int]]
    prompt_texts: list[str]  # for echo
    n: int
    best_of: int
    echo: bool
    logprobs: int | None  # completions: top N; chat: top_logprobs (with logprobs: true)
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    candidates: list[Candidate] = field(default_factory=list)


class OpenAIApi:
    def __init__(self, state: ServerState, encoder: PromptEncoder):
        self.state, self.encoder = state, encoder
        engine = state.driver.engine
        self.text_of = TokenText(engine.decode)
        self.id_text_of = TokenText(engine.decode, as_ids=True)

    def routes(self) -> list:
        return [web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat),
                web.get("/v1/models", self.models), web.get("/v1/models/{model}", self.model)]

    def _model_card(self) -> dict:
        template = self.encoder.template
        return {"id": self.state.model_name, "object": "model", "created": int(self.state.started),
                "owned_by": "moectl", "max_model_len": self.state.driver.engine.max_model_len,
                "chat_template": template.origin}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.state.model_name:
            raise ApiError(404, f"model: {request.match_info['model']!r} is not served here", param="model",
                           code="model_not_found")
        return web.json_response(self._model_card())

    # -- the two generation endpoints
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request, self.state.max_request_bytes)
        _common_checks(body, self.state.model_name, CHAT_ONLY)
        echo = bool_field(body, "echo")
        logprobs = None if body.get("logprobs") is False else int_field(body, "logprobs", 0, MAX_LOGPROBS, None)
        prompts, texts = [], []
        for i, prompt in enumerate(_completion_prompts(body)):
            where = "prompt" if not isinstance(body["prompt"], list) or is_int(body["prompt"][0]) else f"prompt[{i}]"
            if isinstance(prompt, str):
                ids = await self.encoder.text(prompt, where)
                if not ids:
                    raise ApiError(400, f"{where}: tokenizes to nothing", param="prompt")
            else:
                ids = self.encoder.ids(prompt, where)
            prompts.append(ids)
            texts.append(prompt if isinstance(prompt, str) or not echo else self.state.driver.engine.decode(ids))
        job = self._job("completion", "cmpl", body, prompts, texts, echo, logprobs,
                        max_tokens=int_field(body, "max_tokens", 0, self.state.max_tokens_limit,
                                             DEFAULT_COMPLETION_MAX_TOKENS))
        return await self._run(request, job, body)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request, self.state.max_request_bytes)
        _common_checks(body, self.state.model_name, COMPLETION_ONLY)
        fmt = body.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise ApiError(400, "response_format: only {\"type\": \"text\"} is supported", param="response_format")
        wants_logprobs = bool_field(body, "logprobs")
        top = int_field(body, "top_logprobs", 0, MAX_LOGPROBS, None)
        if top is not None and not wants_logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = int_field(body, name, 1, self.state.max_tokens_limit, None)
        ids = await self.encoder.chat(body.get("messages"), bool_field(body, "add_generation_prompt", True))
        self.encoder.ids(ids, "messages")
        if max_tokens is None:  # up to what is left of the context and of a KV pool
            max_tokens = min(self.state.max_tokens_limit, self._room(len(ids)))
            if max_tokens < 1:
                raise ApiError(400, f"messages: {len(ids)} prompt tokens leave no room to reply",
                               param="messages", code="context_length_exceeded")
        job = self._job("chat", "chatcmpl", body, [ids], [""], False, (top or 0) if wants_logprobs else None,
                        max_tokens=max_tokens)
        return await self._run(request, job, body)

    def _job(self, kind: str, id_prefix: str, body: dict, prompts, texts, echo: bool, logprobs: int | None, *,
             max_tokens: int) -> Job:
        state = self.state
        if state.driver.error is not None:
            raise ApiError(503, f"the engine has failed ({state.driver.error}); restart it")
        n = int_field(body, "n", 1, MAX_N, 1)
        best_of = int_field(body, "best_of", n, MAX_N, n) if kind == "completion" else n
        stream = bool_field(body, "stream")
        if stream and best_of > n:
            raise ApiError(400, "best_of: cannot be more than n when streaming", param="best_of")
        if len(prompts) * best_of > MAX_CANDIDATES:
            raise ApiError(400, f"n: {len(prompts)} prompts x {best_of} choices is over the limit of {MAX_CANDIDATES}",
                           param="n")
        if max_tokens == 0 and not echo:
            raise ApiError(400, "max_tokens: 0 only with echo: true (scoring the prompt)", param="max_tokens")
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or not stream or set(options) - {"include_usage"}):
            raise ApiError(400, "stream_options: must be {\"include_usage\": bool}, and only with stream: true",
                           param="stream_options")
        seed = int_field(body, "seed", 0, 2**63 - 1, None)
        stop = _stop(body)
        stop_ids = body.get("stop_token_ids")
        if stop_ids is not None and (not isinstance(stop_ids, list) or not all(is_int(t) and t >= 0 for t in stop_ids)):
            raise ApiError(400, "stop_token_ids: must be a list of non-negative integers", param="stop_token_ids")
        common = dict(
            max_tokens=max_tokens, temperature=number_field(body, "temperature", 0.0, 2.0, 0.0),
            top_p=number_field(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
            top_k=max(int_field(body, "top_k", -1, None, 0), 0),  # vLLM's extension; -1 (or 0): no filter
            stop=stop, stop_token_ids=tuple(stop_ids or ()), ignore_eos=bool_field(body, "ignore_eos"),
            presence_penalty=number_field(body, "presence_penalty", -2.0, 2.0, 0.0),
            frequency_penalty=number_field(body, "frequency_penalty", -2.0, 2.0, 0.0),
            repetition_penalty=number_field(body, "repetition_penalty", 0.0, 2.0, 1.0, lo_open=True),
            # best_of ranks candidates by their cumulative log-probability
            logprobs=logprobs if logprobs is not None else (0 if best_of > n else None),
            prompt_logprobs=(logprobs if echo and logprobs is not None else (0 if max_tokens == 0 else None)))
        job = Job(kind, f"{id_prefix}-{uuid.uuid4().hex}", int(time.time()), prompts, texts, n, best_of, echo,
                  logprobs, stream, bool_field(options or {}, "include_usage"), stop)
        try:
            for p in range(len(prompts)):
                for j in range(best_of):
                    params = SamplingParams(seed=None if seed is None else seed + j, **common)
                    # one choice keeps the response's id in the engine's records; more get a suffix
                    rid = job.request_id if len(prompts) * best_of == 1 else f"{job.request_id}-{p}-{j}"
                    job.candidates.append(Candidate(p, rid, params))
        except ValueError as exc:
            raise ApiError(400, str(exc), param=param_of(str(exc))) from None
        return job

    def _room(self, prompt_tokens: int) -> int:
        engine = self.state.driver.engine
        pool_tokens = engine.blocks.largest_pool * engine.config.block_size
        return min(engine.max_model_len, pool_tokens) - prompt_tokens

    # -- running a job
    async def _run(self, request: web.Request, job: Job, body: dict) -> web.StreamResponse:
        engine = self.state.driver.engine
        text_of = self.id_text_of if bool_field(body, "return_tokens_as_token_ids") else self.text_of
        response = None
        try:
            for c in job.candidates:
                try:
                    stream = engine.add_request(job.prompts[c.prompt_index], c.params, request_id=c.request_id,
                                                stream=True)
                except ValueError as exc:
                    message = str(exc)
                    code = "context_length_exceeded" if "exceed" in message or "KV blocks" in message else None
                    raise ApiError(400, message, param=param_of(message), code=code) from None
                c.outputs = self.state.bridge.attach(stream)
            if job.stream:
                response = web.StreamResponse(headers=SSE_HEADERS)
                await response.prepare(request)
                await self._stream(request, response, job, text_of)
                return response
            return await self._complete(request, job, text_of)
        except (ClientGone, ConnectionResetError):  # aborted below; nobody to answer
            return response or web.Response(status=499)
        finally:
            for c in job.candidates:  # the client left, or one request was refused: free their KV blocks
                if c.outputs is not None and not c.outputs.finished:
                    engine.abort(c.request_id)

    async def _complete(self, request: web.Request, job: Job, text_of: TokenText) -> web.Response:
        async def finish(c: Candidate):
            out = await _next_output(request, c.outputs)
            while not out.finished:
                out = await _next_output(request, c.outputs)
            c.final = out

        await asyncio.gather(*(finish(c) for c in job.candidates))
        failed = next((c.final for c in job.candidates if c.final.finish_reason == "error"), None)
        if failed is not None:  # the failed step's cause (RequestOutput.error)
            raise ApiError(500, f"the engine failed while running this request ({failed.error})")
        choices, completion_tokens = [], 0
        for p in range(len(job.prompts)):
            group = job.candidates[p * job.best_of:(p + 1) * job.best_of]
            if job.best_of > job.n:
                group = sorted(group, key=lambda c: -sum(lp for lp, _ in c.final.logprobs))[:job.n]
            for j, c in enumerate(group):
                out = c.final
                completion_tokens += len(out.token_ids)
                choices.append(self._choice(job, p * job.n + j, out, text_of))
        prompt_tokens = sum(len(p) for p in job.prompts)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        obj = "chat.completion" if job.kind == "chat" else "text_completion"
        return web.json_response({"id": job.request_id, "object": obj, "created": job.created,
                                  "model": self.state.model_name, "choices": choices, "usage": usage})

    def _choice(self, job: Job, index: int, out, text_of: TokenText) -> dict:
        if job.kind == "chat":
            logprobs = None
            if job.logprobs is not None:
                logprobs = chat_logprobs(text_of, out.token_ids, out.logprobs, job.logprobs)
            return {"index": index, "message": {"role": "assistant", "content": out.text}, "logprobs": logprobs,
                    "finish_reason": out.finish_reason}
        text = out.text
        logprobs = None
        if job.logprobs is not None:
            builder = CompletionLogprobs(text_of)
            pieces = []
            if job.echo:
                pieces.append(builder.piece(out.prompt_ids, out.prompt_logprobs))
            pieces.append(builder.piece(out.token_ids, out.logprobs))
            logprobs = merge_pieces(pieces)
        if job.echo:
            text = job.prompt_texts[self._prompt_of(job, index)] + text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}

    @staticmethod
    def _prompt_of(job: Job, index: int) -> int:
        return index // job.n

    async def _stream(self, request: web.Request, response: web.StreamResponse, job: Job, text_of) -> None:
        lock = asyncio.Lock()
        totals = {"completion_tokens": 0, "failed": False}
        chunk = chunk_factory(job, self.state.model_name)

        async def send(payload: dict) -> None:
            async with lock:
                await _send(response, payload)

        async def one(index: int, c: Candidate) -> None:
            engine = self.state.driver.engine
            deltas = TextDeltas(engine.decode, job.stop)
            builder = CompletionLogprobs(text_of)
            if job.kind == "chat":
                await send(chunk(index, {"role": "assistant", "content": ""}, None))
            echo_pending, waiting_logprobs, waiting_ids = job.echo, [], []
            while True:
                out = await _next_output(request, c.outputs)
                if echo_pending and (out.prompt_logprobs is not None or job.logprobs is None or out.finished):
                    echo_pending = False
                    lp = None
                    if job.logprobs is not None:
                        lp = builder.piece(out.prompt_ids, out.prompt_logprobs or [None] * len(out.prompt_ids))
                    await send(chunk(index, job.prompt_texts[c.prompt_index], None, lp))
                if out.finished:
                    break
                text = deltas.update(out.token_ids)
                if job.logprobs is not None:
                    waiting_ids += out.new_token_ids
                    waiting_logprobs += out.new_logprobs
                if text:
                    await send(chunk(index, text, None, self._piece(job, builder, text_of, waiting_ids,
                                                                    waiting_logprobs)))
                    waiting_ids, waiting_logprobs = [], []
            if out.finish_reason == "error":
                totals["failed"] = out.error or "the engine failed"
                return
            totals["completion_tokens"] += len(out.token_ids)
            if job.logprobs is not None:
                done = len(out.logprobs) - len(waiting_logprobs) - len(out.new_logprobs)
                waiting_ids = out.token_ids[done:]
                waiting_logprobs = out.logprobs[done:]
            await send(chunk(index, deltas.finish(out.text), out.finish_reason,
                             self._piece(job, builder, text_of, waiting_ids, waiting_logprobs)))

        await asyncio.gather(*(one(i, c) for i, c in enumerate(job.candidates)))
        if totals["failed"]:
            message = f"the engine failed while running this request ({totals['failed']})"
            await _send(response, {"error": {"message": message, "type": "server_error", "param": None,
                                             "code": None}})
        elif job.include_usage:
            prompt_tokens = sum(len(p) for p in job.prompts)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": totals["completion_tokens"],
                     "total_tokens": prompt_tokens + totals["completion_tokens"]}
            await _send(response, {**chunk(0, "", None), "choices": [], "usage": usage})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()

    @staticmethod
    def _piece(job: Job, builder: CompletionLogprobs, text_of, token_ids, entries):
        if job.logprobs is None:
            return None
        if job.kind == "chat":
            return chat_logprobs(text_of, token_ids, entries, job.logprobs)
        return builder.piece(token_ids, entries)


def _common_checks(body: dict, served: str, other_endpoint: tuple[str, ...]) -> None:
    check_model(body, served)
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        if value is None or value == off or (name in ("logit_bias", "tools", "functions") and value in ({}, [])):
            continue
        raise ApiError(400, f"{name}: is not supported by this server", param=name)
    for name in other_endpoint:
        if body.get(name) not in (None, False):
            raise ApiError(400, f"{name}: not a field of this endpoint", param=name)


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


def _completion_prompts(body: dict) -> list:
    """One prompt (text or token ids) or a batch of them, as OpenAI's four forms."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt: is empty", param="prompt")
        return [prompt]
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_BATCH:
            raise ApiError(400, f"prompt: {len(prompt)} prompts is over the limit of {MAX_BATCH}", param="prompt")
        for i, p in enumerate(prompt):
            if not p:
                raise ApiError(400, f"prompt[{i}]: is empty", param="prompt")
        return prompt
    raise ApiError(400, "prompt: must be a non-empty string, a list of token ids, or a list of those", param="prompt")


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


def chunk_factory(job: Job, model: str):
    """chunk(index, text_or_delta, finish_reason, logprobs) -> one streamed chunk of this job's kind."""
    obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    base = {"id": job.request_id, "object": obj, "created": job.created, "model": model}
    if job.include_usage:
        base["usage"] = None

    def chunk(index: int, content, finish_reason, logprobs=None) -> dict:
        if job.kind == "chat":
            delta = content if isinstance(content, dict) else ({"content": content} if content else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": content, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**base, "choices": [choice]}
    return chunk


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")
