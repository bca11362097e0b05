"""The sharding engine: plain torch and ``torch.distributed``, no Lightning. One file per step of a unit's life:

    plan.py           which modules form a unit (by class, by parameter budget)
    flat_shard.py     a unit's parameters as one flat buffer, 1/N of it owned per rank
    shard_module.py   cut a module into units and shard them (the engine's entry point)
    materialize.py    build units from meta-device modules, one at a time
    unit.py           a unit and its state during a step
    gather.py         forward/backward all-gather, prefetch and free (the gather schedule)
    elision.py        which units backward needs re-gathered (what autograd saved)
    reduce.py         gradient reduce-scatter, bounded in flight, accumulation without sync
    hooks.py          the module and autograd hooks that drive all of the above, one step at a time
    arguments.py      a unit's call arguments as the hooks handle them (flattened, cast once)
    held.py           buffers made rank 0's, and every unit held gathered for evaluation and generation
    guards.py         the sharded tree refuses conversions (.half(), .to()) and a state_dict() that would hang
    norms.py          global gradient norm and clipping over the shards (and the runtime's face for them)
    optimizers.py     how each optimizer is stepped: elementwise (1-D shards) or matrix (whole, on owners)
    step_plan.py      an optimizer step's groups, and the owner of each whole parameter
    optimizer_groups.py  the ranks' param groups made the same before anything reads them
    optimizer_step.py the sharded step: group by group, all-to-alls to and from the owners
    optimizer_attach.py  optimizers built against full-shape placeholders, then given the shards
    collectives.py    the collectives, with error text and communication figures
    activation_checkpointing.py   recompute a unit's members in backward
"""
