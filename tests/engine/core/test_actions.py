"""Every operator action defined once (wire/actions.py): the driver, the control API's
routes and the consoles name them by Action; a recorded action's kind is its plain name."""

from __future__ import annotations

import pytest

from moectl.engine.core.config import EngineConfig
from moectl.engine.core.driver import EngineDriver
from moectl.engine.llm_engine import LLMEngine
from moectl.placement.topology import Topology
from moectl.wire.actions import ACTIONS, PLACEMENT_RECORDS, Action, ActionRefused, PlacementEdit, action
from tests.checkpoints import tiny_checkpoint


def test_every_action_has_one_spec_and_names_itself():
    assert set(ACTIONS) == set(Action)
    assert action("rebalance_apply") is Action.REBALANCE_APPLY and Action.REBALANCE_APPLY == "rebalance_apply"
    with pytest.raises(ActionRefused) as err:
        action("rebalance_everything")
    assert "not an action of this engine" in str(err.value) and "rebalance_apply" in str(err.value)
    assert {e.value for e in PlacementEdit} < PLACEMENT_RECORDS and "rebalance_apply" in PLACEMENT_RECORDS


def test_the_control_api_routes_are_the_specs():
    from moectl.server.control import ControlApi

    paths = {r.path for r in ControlApi.routes(_Bare())}
    assert {f"/v1/control/{s.route}" for s in ACTIONS.values() if s.route} <= paths


class _Bare:
    """Just what ControlApi.routes reads: its handlers, as attributes."""
    def __getattr__(self, name):
        return lambda request: None


def test_the_driver_refuses_an_unknown_kind_and_records_plain_names(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    config = EngineConfig(model=str(ckpt), topology=Topology(num_devices=2), num_threads=1)
    driver = EngineDriver(lambda: LLMEngine(config))
    try:
        with pytest.raises(ActionRefused, match="not an action of this engine"):
            driver.act("self_destruct")
        with pytest.raises(ActionRefused, match="no demo workload"):
            driver.act(Action.WORKLOAD, rate=3.0)
        driver.act(Action.AUTO_REBALANCE, enabled=False).result(timeout=30)
        recorded = driver.engine.actions[-1]
        assert recorded["kind"] == "auto_rebalance" and type(recorded["kind"]) is str
    finally:
        driver.close()
