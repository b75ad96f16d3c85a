"""The console's panels. Each reads the ConsoleState in `show(state)` (attributes down) and
asks for operator actions by posting `ActionRequested` (messages up); the app carries them out."""

from moectl.console.panels.common import ActionRequested
from moectl.console.panels.experts import ExpertsPanel
from moectl.console.panels.memory import MemoryPanel
from moectl.console.panels.overview import OverviewPanel
from moectl.console.panels.requests import RequestsPanel
from moectl.console.panels.timeline import TimelinePanel
from moectl.console.panels.transport import TransportBar

__all__ = ["ActionRequested", "ExpertsPanel", "MemoryPanel", "OverviewPanel", "RequestsPanel", "TimelinePanel",
           "TransportBar"]
