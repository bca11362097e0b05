"""The runtime: the module and autograd hooks that drive each unit through a step (gather, compute, free; reduce in
backward), and what a step's scope needs around them.

    hooks.py                     ShardRuntime: its parts, and the hooks it installs to drive them
    step_state.py                where a step is (a Phase enum), its scopes' depth; the transitions, checked
    unit_hooks.py                each unit's forward and backward hooks, the end of backward
    step_scope.py                a step: the root's scope, its start and end
    gather.py                    the gather schedule: all-gather, prefetch, free
    reduce.py                    gradient reduce-scatter, bounded in flight, accumulation without sync
    no_sync_marks.py             what a zero_grad clears of the micro-batches no_sync() left unreduced
    elision.py                   which units backward needs re-gathered (what autograd saved)
    backward_watch.py            seeing a unit's backward begin and end (its outputs' and inputs' nodes)
    arguments.py, trees.py       a unit's call arguments (flattened, cast once; dataclasses walked)
    entries.py                   calls that enter the model below the root
    held.py                      every unit held gathered for evaluation (keep_gathered)
    buffers.py                   buffers made rank 0's (DDP's broadcast_buffers)
    nonfinite.py                 a step with a non-finite gradient skipped or stopped on every rank
    guards.py                    conversions and state_dict() refused on the sharded tree
    activation_checkpointing.py  recompute a unit's members in backward
    compile.py                   each unit's blocks compiled, the engine's hooks left eager
    averaging.py                 an average of the weights (EMA, SWA) sharded like them
    mirrors.py                   a frozen copy laid out otherwise than its original, named at setup
    step_figures.py              the last step's communication figures
"""
