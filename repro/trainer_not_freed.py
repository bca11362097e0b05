"""A Trainer fitted with ShardStrategy (synchronous saves too; not with DDP) is never garbage collected after `del`:
something outside the gc-visible graph (likely the hooks the engine registers on tensors) keeps it, its model, optimizer
state and, under async_save, its staging memory alive for the rest of the process.

    cd /work/wt-60r && PYTHONPATH=/work/wt-60r python repro/trainer_not_freed.py
"""
import gc, tempfile, weakref, sys
from repro import common
from tests.world import run_world

def scenario(rank, world, directory, kind):
    from lightning_shard import ShardStrategy
    common.as_lightning_rank(rank, world)
    strategy = {"ddp": "ddp", "sync": ShardStrategy(units=["Block"]), "async": ShardStrategy(units=["Block"], async_save=True)}[kind]
    t = common.trainer(world, strategy, [], max_steps=2, enable_checkpointing=False)
    module = common.module_class("adamw", "none")()
    t.fit(module, common.loader())
    tr = weakref.ref(t)
    del t, module, strategy
    gc.collect()
    return tr() is not None

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("ddp", "sync", "async"):
            print(kind, "trainer alive after del+gc:", run_world(scenario, 2, tmp, kind, timeout=300)[0])
