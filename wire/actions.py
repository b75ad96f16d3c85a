"""Every operator action an engine takes, defined once: the engine (driver.py, experts/control.py),
the engine process's protocol (server/engine_host.py), the control API (server/control.py) and
the consoles all name actions by Action, and an action record's "kind" is its value. Torch-free,
so every front end can use it without importing the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ActionRefused(ValueError):
    """An action that cannot be carried out here, or bad arguments for it; the message says why."""


class Action(StrEnum):
    KNOBS = "knobs"
    CAPTURE = "capture"
    RESTART = "restart"
    REBALANCE_PREVIEW = "rebalance_preview"
    REBALANCE_APPLY = "rebalance_apply"
    AUTO_REBALANCE = "auto_rebalance"
    EDIT = "edit"
    WORKLOAD = "workload"  # the demo workload of an engine process (`run`, `web`)


class PlacementEdit(StrEnum):
    """Edit's kinds (its "edit" argument), each a Placement method; recorded under its own name."""
    MOVE = "move"
    SWAP = "swap"
    REPLICATE = "replicate"
    DROP_REPLICA = "drop_replica"
    PIN = "pin"
    UNPIN = "unpin"


@dataclass(frozen=True)
class ActionSpec:
    route: str | None  # /v1/control/<route> (None: not offered over HTTP)
    needs_devices: bool  # an expert action: refused on an engine without devices


ACTIONS: dict[Action, ActionSpec] = {
    Action.KNOBS: ActionSpec("knobs", False),
    Action.CAPTURE: ActionSpec("capture", False),
    Action.RESTART: ActionSpec(None, False),
    Action.REBALANCE_PREVIEW: ActionSpec("rebalance/preview", True),
    Action.REBALANCE_APPLY: ActionSpec("rebalance/apply", True),
    Action.AUTO_REBALANCE: ActionSpec("auto_rebalance", True),
    Action.EDIT: ActionSpec("edit", True),
    Action.WORKLOAD: ActionSpec(None, False),
}

# the action records whose result is a new placement in force: an applied rebalance, an edit,
# and "placement" (Placement applied directly: experts.apply's default kind)
PLACEMENT_RECORDS = frozenset({Action.REBALANCE_APPLY.value, "placement", *(e.value for e in PlacementEdit)})


def action(kind) -> Action:
    """A kind as an Action; ActionRefused names one that is none."""
    try:
        return Action(kind)
    except ValueError:
        raise ActionRefused(f"{kind}: not an action of this engine (actions: {', '.join(a.value for a in Action)})") \
            from None
