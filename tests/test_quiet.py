"""Our commands filter Lightning's noise (its deprecation warnings about its own code, its advertisements) and
nothing else; importing the library filters nothing. (A whole run's stderr: tests/test_train_hydra.py.)"""

from __future__ import annotations

import logging
import warnings

import pytest

import lightning_shard  # noqa: F401  # importing it must not filter
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning_utilities.core import rank_zero

from lightning_shard.app import quiet as quiet_module
from lightning_shard.app.quiet import quiet


@pytest.fixture(autouse=True)
def _unfiltered_loggers():
    yield
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).removeFilter(quiet_module._not_a_tip)


def test_only_lightnings_noise_is_filtered():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet()
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`",
                      FutureWarning)
        warnings.warn("a FutureWarning of the user's", FutureWarning)
    assert [str(w.message) for w in seen] == ["a FutureWarning of the user's"]


def test_lightnings_tips_are_filtered_not_its_information():
    assert quiet_module._not_a_tip not in rank_zero.log.filters  # not by importing lightning_shard
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    rank_zero.log.addHandler(handler)
    try:
        quiet()
        rank_zero_info("💡 Tip: For seamless cloud logging and experiment tracking, try installing litlogger")
        rank_zero_info("GPU available: False, used: False")
    finally:
        rank_zero.log.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["GPU available: False, used: False"]
