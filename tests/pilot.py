"""Driving the console through Textual's Pilot: run an app, wait for the engine thread, read a panel."""

from __future__ import annotations

import asyncio

from moectl.console.app import MoectlApp

SIZE = (160, 50)


def run_app(app: MoectlApp, body, size=SIZE):
    async def main():
        async with app.run_test(size=size) as pilot:
            await body(app, pilot)
    asyncio.run(main())


async def until(pilot, condition, timeout: float = 20.0):
    """Let the app run until condition() holds (the engine runs in its own thread)."""
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError("condition not reached")


def text_of(app, selector: str) -> str:
    """The plain text a Static shows (markup, Text or any Rich renderable such as a Table), or a
    Line API widget's plain_text."""
    from rich.console import Console
    from rich.text import Text

    widget = app.query_one(selector)
    if hasattr(widget, "plain_text"):  # a Line API widget (Bars) says what it draws
        return widget.plain_text
    content = widget.content
    if isinstance(content, str):
        return Text.from_markup(content).plain
    if isinstance(content, Text):
        return content.plain
    console = Console(width=200, record=True, file=open("/dev/null", "w"))
    console.print(content)
    return console.export_text()
