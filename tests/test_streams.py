"""The stream protocol (engine/comm/streams.py): every buffer that crosses streams is handed over with a wait.

CI has no GPU, so the suite runs every engine with a checking HostStreams (conftest.py) that models the
compute, gather and reduce streams with vector clocks, as a GPU would order them; these tests show that the
checker finds each missing hand-over, so the suite's clean runs mean something.
"""

from __future__ import annotations

import pytest

from lightning_shard.engine.comm.streams import HostStreams, StreamRace
from tests import stream_scenarios
from tests.world import run_world


def test_checker_orders_by_handovers():
    streams = HostStreams(check=True)
    with streams.on("gather"):
        streams.writes("buffer")
    with pytest.raises(StreamRace, match="read on the compute stream without waiting for its write on the gather"):
        streams.reads("buffer")
    streams.handover("gather", "compute")
    streams.reads("buffer")
    # a hand-over covers what the producer had issued before it, not after
    with streams.on("gather"):
        streams.writes("later")
    with pytest.raises(StreamRace):
        streams.reads("later")
    # writing what another stream still reads is a race too (freeing a buffer a collective still sends)
    streams.handover("gather", "compute")
    streams.handover("gather", "reduce")
    with streams.on("reduce"):
        streams.reads("later")
    with pytest.raises(StreamRace, match="written on the compute stream without waiting for its last access on the reduce"):
        streams.writes("later")
    # hand-overs are transitive: reduce -> gather -> compute
    streams.handover("reduce", "gather")
    streams.handover("gather", "compute")
    streams.writes("later")


def test_unchecked_host_streams_cost_nothing():
    streams = HostStreams()
    with streams.on("gather"):
        streams.writes("buffer")
    streams.reads("buffer")  # no model, no error: the CPU runs everything in host order


@pytest.mark.timeout(300)
def test_engine_needs_every_handover():
    """2 ranks, prefetch, a bf16 copy-in: clean with all hand-overs; each one removed is a race the checker names."""
    found = run_world(stream_scenarios.each_handover_removed, 2)[0]
    assert found[None] is None
    expected = {
        ("compute", "gather"): "on the gather stream",  # the gather overwrites what compute allocated/read
        ("gather", "compute"): "read on the compute stream without waiting for its write on the gather",
        ("compute", "reduce"): "'grads'",
        ("reduce", "compute"): "on the compute stream without waiting for its",
    }
    for missing, text in expected.items():
        assert found[missing] is not None and text in found[missing], (missing, found[missing])
