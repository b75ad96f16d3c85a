"""The serving core: the step loop, scheduler, paged KV cache and block manager, model runner,
sampling, spans and the step telemetry that builds the records (moectl.wire.records), and the
driver that runs the engine on its thread."""
