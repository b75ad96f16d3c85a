"""Reading and checking request bodies: OpenAI-shaped errors, JSON with its limits, typed fields.

A body must be sent as application/json (a page in a browser can post text/plain to any address
without asking; refusing it is half of the cross-site defence, app.py's Host/Origin check the
other half), be an object, nest at most MAX_JSON_DEPTH deep, and hold only valid Unicode (a lone
surrogate such as "\\ud800" decodes from JSON but is no character, and the tokenizer cannot take it).
"""

from __future__ import annotations

import json
import logging
import math

from aiohttp import web

log = logging.getLogger(__name__)

MAX_JSON_DEPTH = 32
IGNORED_HEADER = "X-Ignored-Fields"
MAX_IGNORED_NAMED = 16  # names an ignored-fields header or log line lists (the rest are counted)
MAX_IGNORED_NAME_CHARS = 64
MAX_IGNORED_REMEMBERED = 1024  # names logged once each; past this many, every request's are logged
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "invalid_request_error", 415: "invalid_request_error"}


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


def param_of(message: str) -> str | None:
    """Engine and SamplingParams errors start with the field's name ("max_tokens: must be ...")."""
    head = message.split(":", 1)[0]
    return head if head.isidentifier() else None


async def read_json(request: web.Request, max_bytes: int) -> dict:
    if request.content_length is not None and request.content_length > max_bytes:
        raise ApiError(413, f"body: {request.content_length} bytes is over the limit of {max_bytes}")
    kind = request.content_type
    if kind != "application/json" and not kind.endswith("+json"):
        raise ApiError(415, f"Content-Type: must be application/json, got {kind or 'none'}")
    raw = await request.read()  # the app's client_max_size also stops a chunked body (413)
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"body: nested more than {MAX_JSON_DEPTH} levels deep") from None
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "body: not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body: must be a JSON object")
    _check_tree(body)
    return body


def _check_tree(body: dict) -> None:
    """Depth and Unicode, without recursion; errors name the top-level field they are under."""
    stack = [(value, key, 1) for key, value in body.items()]
    for key in body:
        _check_text(key, key)
    while stack:
        value, field, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"{field}: nested more than {MAX_JSON_DEPTH} levels deep", param=field)
        if isinstance(value, str):
            _check_text(value, field)
        elif isinstance(value, list):
            stack.extend((v, field, depth + 1) for v in value)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, field)
                stack.append((v, field, depth + 1))


def _check_text(text: str, field: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = text[exc.start]
        raise ApiError(400, f"{field}: holds a lone surrogate (U+{ord(char):04X} at character {exc.start}); "
                       "not valid Unicode", param=field) from None


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def int_field(body: dict, name: str, lo: int, hi: int | None, default):
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ApiError(400, f"{name}: must be an integer {bound}, got {_short(value)}", param=name)
    return value


def number_field(body: dict, name: str, lo: float, hi: float, default: float, *, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not is_number(value) or not (lo < value if lo_open else lo <= value) or value > hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise ApiError(400, f"{name}: must be a number in {interval}, got {_short(value)}", param=name)
    return float(value)


def bool_field(body: dict, name: str, default: bool = False, *, parent: str | None = None) -> bool:
    """parent: the field `body` is the value of, when it is nested (errors name "parent.name")."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        where = f"{parent}.{name}" if parent else name
        raise ApiError(400, f"{where}: must be true or false, got {_short(value)}", param=parent or name)
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is None:
        return  # optional here: there is one model
    if not isinstance(model, str):
        raise ApiError(400, f"model: must be a string, got {_short(model)}", param="model")
    if model != served:
        raise ApiError(400, f"model: {_short(model)} is not served here (this server serves {served!r})",
                       param="model", code="model_not_found")


class IgnoredFields:
    """What vLLM does with a request field it does not know (a typo such as "temprature", or
    another server's extension that a client such as lm-eval passes through): it serves the
    request and names the fields it dropped. Here they are named to the client on every response
    (the X-Ignored-Fields header, a JSON list) and to the operator in a log line, once per name,
    so a client that always sends one does not flood the log."""

    def __init__(self):
        self._logged: set[str] = set()

    def headers(self, body: dict, known: frozenset[str], endpoint: str) -> dict[str, str]:
        # cut short: a name may be most of a 1 MiB body, and the remembered ones stay
        names = sorted({n if len(n) <= MAX_IGNORED_NAME_CHARS else n[:MAX_IGNORED_NAME_CHARS - 3] + "..."
                        for n in set(body) - known})
        if not names:
            return {}
        # ASCII JSON: a name with a newline or a non-Latin-1 character is escaped, never sent raw in a header
        text = json.dumps(names[:MAX_IGNORED_NAMED])
        if len(names) > MAX_IGNORED_NAMED:
            text += f" and {len(names) - MAX_IGNORED_NAMED} more"
        unlogged = [n for n in names if n not in self._logged]
        if unlogged:
            log.warning("%s: the following fields were present in the request but ignored: %s", endpoint, text)
            self._logged.update(unlogged[:max(MAX_IGNORED_REMEMBERED - len(self._logged), 0)])
        return {IGNORED_HEADER: text}
