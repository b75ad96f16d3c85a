"""Reuse a Line API widget's finished lines between frames while what they show is unchanged.

Textual turns every line a widget renders into a new Strip (CSS background, line filters) even when
`render_line` returns the same one, and a Widget.refresh() (a resize, a theme switch, a new frame)
throws its line cache away. A widget with this mixin names each line by a key (`line_key(y)`: the
data version, scroll offset, view and whatever else that line depends on); a line whose key, size
and styles have not changed is handed back as the very Strip object it was last time, so Textual's
own per-strip caches (crop, divide, the terminal byte string) are kept too. Lines whose key changed
go through Textual's usual path, and only those.
"""

from __future__ import annotations

from collections.abc import Hashable

from textual.geometry import Region
from textual.strip import Strip


class LineCacheMixin:
    """Mix into a Widget subclass (before it) and implement `line_key`."""

    LINE_CACHE_STYLES: tuple[str, ...] = ()  # component classes whose styles the lines use

    _line_frame: object = None
    _line_strips: dict[int, tuple[Hashable, Strip]]
    _style_generation: int = 0

    def line_key(self, y: int) -> Hashable | None:
        """What line y shows, as a hashable value; None: do not cache that line."""
        raise NotImplementedError

    def line_frame(self) -> Hashable:
        """State every line depends on beyond size and styles (a colour scale, say)."""
        return None

    def notify_style_update(self) -> None:
        # the CSS (a theme, a pseudo class) changed: every cached line is stale
        self._style_generation += 1
        super().notify_style_update()  # type: ignore[misc]

    def _frame_key(self, crop: Region) -> tuple:
        """What every line depends on: size, crop, colours and styles, line filters, line_frame()."""
        w = self  # a Widget at run time
        return (self._style_generation, w.app.theme, w.size, crop.x, crop.width, w.background_colors,  # type: ignore
                w.visual_style, tuple(w.get_component_rich_style(c) for c in self.LINE_CACHE_STYLES),  # type: ignore
                tuple(id(f) for f in w.get_line_filters()), self.line_frame())  # type: ignore

    def render_lines(self, crop: Region) -> list[Strip]:
        frame = self._frame_key(crop)
        if frame != self._line_frame:
            self._line_frame, self._line_strips = frame, {}
        cache = self._line_strips
        out: list[Strip | None] = []
        keys: dict[int, Hashable] = {}
        for y in crop.line_range:
            key = self.line_key(y)
            held = cache.get(y)
            if key is not None and held is not None and held[0] == key:
                out.append(held[1])
            else:
                out.append(None)
                keys[y] = key
        y0 = crop.y
        misses = list(keys)
        i = 0
        while i < len(misses):  # render each run of consecutive stale lines in one call
            j = i
            while j + 1 < len(misses) and misses[j + 1] == misses[j] + 1:
                j += 1
            start, height = misses[i], misses[j] - misses[i] + 1
            region = Region(crop.x, start, crop.width, height)
            self._styles_cache.set_dirty(region)  # type: ignore[attr-defined]
            strips = super().render_lines(region)  # type: ignore[misc]
            for k, strip in enumerate(strips):
                y = start + k
                out[y - y0] = strip
                if keys[y] is not None:
                    cache[y] = (keys[y], strip)
                else:
                    cache.pop(y, None)
            i = j + 1
        return out  # type: ignore[return-value]
