"""Communication: the collectives (one flat buffer each, sync or async, with error text and byte counts), the CUDA
streams they run on and the hand-overs between them, and the process groups (shard, replicate, agreements).

    collectives.py   all-gather, reduce-scatter, all-reduce, all-to-all, the ranks' small agreements
    streams.py       compute / gather / reduce streams, events at each hand-over (a checker on the CPU)
    groups.py        the shard and replica groups (a 2-D DeviceMesh for hybrid), the agreements' group
"""
