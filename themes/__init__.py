"""The console's themes: dark, light and high contrast, each with a colour-blind-safe heat-map scale.

A theme is a Textual Theme plus the name of the heat-map scale it uses
(moectl.console.widgets.colour_scale). `moectl --theme NAME` picks one at start; the command palette
and the "t" key switch them live.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from textual.theme import Theme

STYLES = Path(str(resources.files(__name__) / "moectl.tcss"))  # the layout stylesheet, shipped beside this module

THEMES: dict[str, Theme] = {
    "dark": Theme(
        name="moectl-dark", primary="#4EA8DE", secondary="#5E60CE", accent="#F4A261", foreground="#E0E0E0",
        background="#14161A", surface="#1C1F26", panel="#252A33", success="#52B788", warning="#F4A261",
        error="#E5614E", dark=True,
        variables={"measured": "#4EA8DE", "modeled": "#B08BD9", "threshold": "#F4A261"}),
    "light": Theme(
        name="moectl-light", primary="#1D5FA8", secondary="#5E3FBE", accent="#B25E09", foreground="#1A1A1A",
        background="#FAFAF7", surface="#F0F0EA", panel="#E3E3DA", success="#2D7A4B", warning="#B25E09",
        error="#B3261E", dark=False,
        variables={"measured": "#1D5FA8", "modeled": "#7A4FB8", "threshold": "#B25E09"}),
    # pure black and white with saturated signals; no meaning carried by hue alone
    "high-contrast": Theme(
        name="moectl-high-contrast", primary="#FFFFFF", secondary="#FFFF00", accent="#00FFFF",
        foreground="#FFFFFF", background="#000000", surface="#000000", panel="#1A1A1A", success="#00FF00",
        warning="#FFFF00", error="#FF4040", dark=True,
        variables={"measured": "#FFFFFF", "modeled": "#00FFFF", "threshold": "#FFFF00"}),
}

HEATMAP_SCALE = {"dark": "viridis", "light": "cividis", "high-contrast": "grey"}


def check_theme(name: str) -> str:
    if name not in THEMES:
        raise ValueError(f"--theme: must be one of {', '.join(THEMES)}, got {name!r}")
    return name
