"""The optimizer's face: any torch.optim optimizer built against full-shape placeholders, then stepped on the shards
(elementwise) or on whole parameters at owner ranks (matrix optimizers); gradient norms and clipping over all shards.

    optimizers.py        how each optimizer class is stepped: elementwise or whole
    optimizer_attach.py  optimizers built against placeholders, then given the shards (the runtime's face)
    optimizer_groups.py  the ranks' param groups made the same before anything reads them
    step_plan.py         a step's bounded groups, and each whole parameter's owner rank
    optimizer_step.py    the sharded step: group by group, all-to-alls to and from the owners
    fused_default.py     torch's fused kernels where no implementation was chosen
    norms.py             gradient norms over every rank's shards, clipping by them
    step_watch.py        before every optimizer step: the non-finite check, written copies, gradient scalers
    host_optimizer.py    offload's optimizer on the CPU: refused where it cannot, fused where unchosen
    host_step.py         offload's step overlapped with backward (host_worker.py, host_step_state.py)
"""
