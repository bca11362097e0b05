"""A Trainer fitted with ShardStrategy (synchronous saves too; not with DDP) is never garbage collected after `del`:
the engine's hooks (ShardRuntime's `_handles`: bound methods stored on tensors/modules, a cycle the collector cannot
see through) keep it, its model, optimizer state and, under async_save before the teardown fix, its staging memory
alive for the rest of the process. `strategy.runtime.remove_hooks()` before `del` lets it go.

    cd /work/wt-60r && PYTHONPATH=/work/wt-60r python repro/trainer_not_freed.py
"""
import gc
import tempfile
import weakref

from repro import common
from tests.world import run_world


def scenario(rank, world, directory, kind):
    from lightning_shard import ShardStrategy

    common.as_lightning_rank(rank, world)
    strategy = "ddp" if kind == "ddp" else ShardStrategy(units=["Block"], async_save=kind == "async")
    t = common.trainer(world, strategy, [], max_steps=2, enable_checkpointing=False)
    module = common.module_class("adamw", "none")()
    t.fit(module, common.loader())
    if kind == "sync, hooks removed":
        t.strategy.runtime.remove_hooks()
    alive = weakref.ref(t)
    del t, module, strategy
    gc.collect()
    return alive() is not None


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("ddp", "sync", "async", "sync, hooks removed"):
            print(f"{kind}: trainer alive after del + gc.collect():", run_world(scenario, 2, tmp, kind, timeout=300)[0])
