"""``ETRAIN_WARM_SPARES_PER_NODE``: a fixed number per node, or ``auto`` (the default) sized from each node;
``ETRAIN_SUPERVISOR_SPARES``: pre-started job supervisors (default 1)."""

from __future__ import annotations

import pytest

from etrain.service.decisions.capacity import AUTO_SPARES_CPU_NODE, MAX_AUTO_SPARES, spares_for_node
from etrain.service.settings import Settings, SettingsError


@pytest.mark.parametrize(
    "resources, expected",
    [
        ({"CPU": 16.0, "GPU": 8.0, "memory": 1e12}, 9),  # one per GPU + 1: a whole-node job and its first replacement
        ({"CPU": 8.0, "GPU": 1.0}, 2),
        ({"GPU": 2.0}, 3),
        ({"CPU": 64.0, "GPU": 32.0}, MAX_AUTO_SPARES),
        ({"CPU": 2.0}, AUTO_SPARES_CPU_NODE),
        ({"CPU": 2.0, "GPU": 0.0}, AUTO_SPARES_CPU_NODE),
        ({"CPU": 64.0}, AUTO_SPARES_CPU_NODE),  # a small number, whatever the node: a DP2 job and a replacement
        ({"CPU": 1.0}, 2),  # the ranks the node can run (one CPU each at least) and one replacement
        ({"memory": 1e9}, 0),  # runs no ranks
        ({}, 0),
    ],
)
def test_auto_keeps_a_spare_per_gpu_plus_one_and_three_on_a_cpu_node(resources, expected):
    assert spares_for_node(resources, None) == expected


@pytest.mark.parametrize("per_node", [0, 1, 3, 16])
def test_a_fixed_number_is_the_operators_on_every_node(per_node):
    for resources in ({"CPU": 2.0}, {"CPU": 16.0, "GPU": 8.0}, {}):
        assert spares_for_node(resources, per_node) == per_node


def test_the_setting_reads_auto_a_number_or_refuses_with_the_fix(monkeypatch):
    monkeypatch.delenv("ETRAIN_WARM_SPARES_PER_NODE", raising=False)
    assert Settings.from_env().warm_spares_per_node is None  # auto by default
    monkeypatch.setenv("ETRAIN_WARM_SPARES_PER_NODE", "auto")
    assert Settings.from_env().warm_spares_per_node is None
    monkeypatch.setenv("ETRAIN_WARM_SPARES_PER_NODE", "2")
    assert Settings.from_env().warm_spares_per_node == 2
    monkeypatch.setenv("ETRAIN_WARM_SPARES_PER_NODE", "17")
    with pytest.raises(SettingsError) as refused:
        Settings.from_env()
    assert "auto" in refused.value.fix


def test_pre_started_supervisors_default_to_one_and_are_bounded(monkeypatch):
    monkeypatch.delenv("ETRAIN_SUPERVISOR_SPARES", raising=False)
    assert Settings.from_env().supervisor_spares == 1
    monkeypatch.setenv("ETRAIN_SUPERVISOR_SPARES", "0")
    assert Settings.from_env().supervisor_spares == 0
    monkeypatch.setenv("ETRAIN_SUPERVISOR_SPARES", "9")
    with pytest.raises(SettingsError) as refused:
        Settings.from_env()
    assert refused.value.field == "supervisor_spares" and "0..8" in str(refused.value)
