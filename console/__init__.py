"""The Textual console: the app, its panels and widgets, the one state object they read, and the
sources that fill it (live engine, replay, attach)."""
