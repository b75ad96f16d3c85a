"""What the engine and its front ends say to each other, torch-free, so a console never imports the engine.

    actions.py     every operator action (Action), its route and whether it needs devices
    records.py     the one record stream: the step record and the action record, field by field
    protocol.py    the engine process's client protocol: msgpack frames over a Unix socket
    kv_budget.py   a KV retention budget as written ("4096", "25%") and as the knobs carry it
    interfaces.py  the typing.Protocols front ends program against: the engine, its experts, a console source
"""
