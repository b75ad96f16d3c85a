"""What an operator action that cannot be carried out raises: torch-free, so every front end
(console, server, protocol clients) can catch it without importing the engine."""

from __future__ import annotations


class ActionRefused(ValueError):
    """An action that cannot be carried out here, or bad arguments for it; the message says why."""
