"""moectl's HTTP server: an OpenAI-compatible API, Prometheus metrics, the telemetry record
stream and operator controls, all in front of one EngineDriver (the engine on its own thread).

    app.py          make_app (the aiohttp Application), run_server, ServerThread
    openai_api.py   /v1/completions, /v1/chat/completions, /v1/models; OpenAI's error shape
    streams.py      engine RequestStream -> asyncio, and token ids -> streamed text
    metrics.py      /metrics (prometheus_client, its own registry), fed by the record stream
    telemetry.py    /v1/telemetry websocket: the record stream as JSON, per-client bounded queues
    control.py      /v1/control/*: knobs, rebalance, capture, recording, expert edits
"""
