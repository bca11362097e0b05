"""The sharding engine: plain torch and ``torch.distributed``, no Lightning. ``shard_module`` (shard_module.py) cuts a
module into units and shards them; each room below is one part of the algorithm, and imports only the rooms above it
in this list:

    comm/      collectives, streams and process groups: how bytes move
    plan/      which modules form a unit; a meta-device model built unit by unit
    storage/   a unit's shards, gathered views and gradients; where a shard lives (offload's host part)
    optim/     optimizers on the shards (elementwise, or whole on owners), norms, offload's CPU step
    runtime/   the runtime's parts: the step's state, the hooks that drive a unit through forward and backward
               (gather, free, reduce)

A step: a unit's pre-forward hook (runtime/unit_hooks.py) gathers it (runtime/gather.py, comm/collectives.py on
comm/streams.py), its post-forward frees it; in backward it is gathered again, its gradients reduce-scattered
(runtime/reduce.py) into the shard parameters (storage/flat_shard.py); the optimizer steps the shards
(optim/optimizer_step.py). docs/design.md follows it in full.
"""
