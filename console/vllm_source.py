"""A running vLLM server as the console's source (`moectl attach --vllm URL`): its Prometheus
/metrics scraped every second on a thread, read by profiler/vllm_metrics.py into the figures the
Overview shows, each labelled as vLLM's. vLLM exports no per-step records (no routing, spans or
per-request timelines), so the other tabs say what is absent; it offers none of moectl's
controls, so every action is refused with the reason, never faked."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from moectl.console.sources import server_url
from moectl.profiler.vllm_metrics import VllmMetricsError, interval_figures, parse_scrape
from moectl.wire.actions import ActionRefused
from moectl.wire.interfaces import ConsoleSource

SCRAPE_EVERY_S = 1.0
RATE_WINDOW_S = 5.0  # rates and percentiles over the scrapes of the last few seconds, not one noisy second
MAX_PAGE_BYTES = 16 << 20  # a /metrics page is tens of KiB; a bigger answer is not one


class VllmSource(ConsoleSource):
    mode = "attach"

    def __init__(self, url: str, timeout_s: float = 5.0, every_s: float = SCRAPE_EVERY_S):
        try:
            self.url = server_url(url)
        except ActionRefused as exc:
            raise ActionRefused(str(exc).replace("attach:", "attach --vllm:", 1)) from None
        self.timeout_s, self.every_s = timeout_s, every_s
        models = self._json("/v1/models")
        served = [m.get("id") for m in (models.get("data") or []) if isinstance(m, dict)]
        if not served:
            raise ActionRefused(f"attach --vllm: {self.url}/v1/models lists no model: not a vLLM server")
        version = self._json("/version", optional=True).get("version")
        first = self._scrape()  # refuses a server without vLLM's /metrics before the console opens
        self.header = {"model": {"name": served[0]},
                       "external": {"engine": "vLLM", "engine_version": version, "url": self.url,
                                    "models": served, "mode": "live /metrics"}}
        self.figures = interval_figures(None, first)
        self.figures_version = 1
        self._scrapes = [first]
        self._error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moectl-vllm", daemon=True)
        self._thread.start()

    # -- the network, on this source's thread (and once at the start)
    def _get(self, path: str) -> bytes:
        try:
            with urllib.request.urlopen(self.url + path, timeout=self.timeout_s) as answer:
                body = answer.read(MAX_PAGE_BYTES + 1)
        except urllib.error.HTTPError as exc:
            raise ActionRefused(f"attach --vllm: {self.url}{path} answered HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ActionRefused(f"attach --vllm: cannot reach {self.url}{path} ({reason})") from None
        if len(body) > MAX_PAGE_BYTES:
            raise ActionRefused(f"attach --vllm: {self.url}{path} is over {MAX_PAGE_BYTES >> 20} MiB")
        return body

    def _json(self, path: str, optional: bool = False) -> dict:
        try:
            value = json.loads(self._get(path))
        except (ActionRefused, ValueError) as exc:
            if optional:
                return {}
            raise ActionRefused(str(exc) if isinstance(exc, ActionRefused) else
                                f"attach --vllm: {self.url}{path} is not JSON: not a vLLM server") from None
        return value if isinstance(value, dict) else {}

    def _scrape(self):
        try:
            return parse_scrape(self._get("/metrics").decode("utf-8", "replace"), time.monotonic())
        except VllmMetricsError as exc:
            raise ActionRefused(f"attach --vllm: {self.url}/metrics: {exc}") from None

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                latest = self._scrape()
            except ActionRefused as exc:
                self._error = str(exc).removeprefix("attach --vllm: ")
                continue
            self._error = None
            self._scrapes = [s for s in self._scrapes if latest.at - s.at <= RATE_WINDOW_S] + [latest]
            self.figures = interval_figures(self._scrapes[0] if len(self._scrapes) > 1 else None, latest)
            self.figures_version += 1

    # -- the console's side
    @property
    def error(self) -> str | None:
        return self._error

    def poll(self) -> tuple[list[dict], list[dict]]:
        return [], []  # vLLM exports no step or action records

    def act(self, kind: str, **args):
        raise ActionRefused(f"{kind}: unavailable on a vLLM server (moectl reads its /metrics; vLLM offers no "
                            f"control moectl could drive)")

    def close(self) -> None:
        self._stop.set()
