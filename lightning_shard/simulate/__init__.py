"""One GPU standing in for many: a simulated process group (``backend``: world N in one process, collectives that move
no data and hold their stream for a modeled time), the cost model and its cited link presets (``links``), how a
collective occupies a stream or the host (``occupancy``), the stand-in outputs (``standins``), the model presets
(``models``), one run of ours or FSDP2 (``run``), the report (``table``) and the command (``command``:
``python -m lightning_shard.simulate``)."""
