"""The serving core: the step loop, scheduler, paged KV cache and block manager, model runner,
sampling, step records and spans, and the driver that runs the engine on its thread."""
