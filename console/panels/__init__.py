"""The console's panels. Each reads the ConsoleState in `show(state)` (attributes down) and
asks for operator actions by posting `ActionRequested` (messages up); the app carries them out."""

from .common import ActionRequested
from .experts import ExpertsPanel
from .memory import MemoryPanel
from .overview import OverviewPanel
from .requests import RequestsPanel
from .timeline import TimelinePanel
from .transport import TransportBar

__all__ = ["ActionRequested", "ExpertsPanel", "MemoryPanel", "OverviewPanel", "RequestsPanel", "TimelinePanel",
           "TransportBar"]
