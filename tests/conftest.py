"""Every test leaves the environment as it found it: a Lightning Trainer run inside the pytest process sets
LOCAL_RANK, MASTER_PORT and the like in os.environ, and a later test's `Trainer(devices=2)` subprocess that
inherits LOCAL_RANK takes its launcher to be external (torchrun) and waits for a rank 1 no one starts."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _restore_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# Every engine in the suite (spawned ranks inherit it) checks that each buffer crossing between its streams
# is handed over with a wait: the ordering a GPU needs, verified where there is none (engine/comm/streams.py).
os.environ.setdefault("LIGHTNING_SHARD_CHECK_STREAMS", "1")
