"""Every checkpoint a background-saving fit writes equals, bit for bit, the synchronous fit's at the same step, with
writes slowed down (0.4 s: later steps run while each is written). One fit per case, several checkpoint sources:
ModelCheckpoint every step with top-k rotation and save_last, a user's trainer.save_checkpoint mid-fit (step 3) and
after fit, a monitored ModelCheckpoint saving at validation end, ShardedEMA, accumulation, optimizers with more state
(amsgrad, momentum, Adagrad) and a per-step OneCycle scheduler.

    cd /work/wt-60r && PYTHONPATH=/work/wt-60r python repro/exactness.py [case ...]
"""
import os
import sys
import tempfile
from pathlib import Path

from repro import common
from tests.world import run_world

CASES = {
    "amsgrad_onecycle_accum": dict(optimizer="amsgrad", scheduler="onecycle", accumulate=2, ema=False),
    "sgd_momentum_ema": dict(optimizer="sgd", scheduler="step", accumulate=1, ema=True),
    "adagrad_val": dict(optimizer="adagrad", scheduler="none", accumulate=1, ema=False),
    "weights_only_between": dict(optimizer="adamw", scheduler="step", accumulate=1, ema=False, weights_only=True),
}


def scenario(rank, world, directory, case, async_save_):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_shard import ShardStrategy
    from lightning_shard.lightning.ema import ShardedEMA

    common.as_lightning_rank(rank, world)
    options = CASES[case]
    common.slow_writes(0.4)

    class UserSaves(L.Callback):
        def on_train_batch_end(self, trainer, *a):
            if trainer.global_step == 3 and trainer.fit_loop.epoch_loop._should_accumulate() is False:
                trainer.save_checkpoint(os.path.join(directory, "user_mid.ckpt"))

    callbacks = [UserSaves(),
                 ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max",
                                 save_last=True),
                 ModelCheckpoint(dirpath=os.path.join(directory, "val"), monitor="val_loss", save_top_k=-1,
                                 filename="{step}")]
    if options.get("weights_only"):  # a weights-only save between full ones: the staged layout changes each time
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(directory, "weights"), every_n_train_steps=1,
                                         save_top_k=-1, save_weights_only=True))
    if options["ema"]:
        callbacks.append(ShardedEMA(decay=0.5))
    t = common.trainer(world, ShardStrategy(units=["Block"], async_save=async_save_), callbacks, max_steps=6,
                       accumulate_grad_batches=options["accumulate"], val_check_interval=2, limit_val_batches=2)
    module = common.module_class(options["optimizer"], options["scheduler"], val=True)()
    n = 48 * options["accumulate"]
    t.fit(module, common.loader(n), common.loader(16))
    t.save_checkpoint(os.path.join(directory, "user_after.ckpt"))
    return {"losses": module.losses}


def compare(rank, world, a, b):
    from lightning_shard.checkpoint.consolidate import consolidate
    from tests.test_checkpoint_async import same

    def consolidated(path):  # everything, the callbacks' states with their directories named alike
        checkpoint = consolidate(path)
        return {k: (repr(v).replace(a, "DIR").replace(b, "DIR") if k == "callbacks" else v)
                for k, v in checkpoint.items()}

    if rank:
        return None
    names = sorted(str(p.relative_to(a)) for p in Path(a).rglob("*.ckpt"))
    names_b = sorted(str(p.relative_to(b)) for p in Path(b).rglob("*.ckpt"))
    differ = [n for n in names if n in names_b and not same(consolidated(Path(a) / n), consolidated(Path(b) / n))]
    return {"sync": names, "async": names_b, "differ": differ}


if __name__ == "__main__":
    bad = False
    for case in sys.argv[1:] or CASES:
        with tempfile.TemporaryDirectory() as tmp:
            sync = run_world(scenario, 2, os.path.join(tmp, "sync"), case, False, timeout=300)[0]
            background = run_world(scenario, 2, os.path.join(tmp, "async"), case, True, timeout=300)[0]
            result = run_world(compare, 1, os.path.join(tmp, "sync"), os.path.join(tmp, "async"), timeout=200)[0]
        ok = sync == background and result["sync"] == result["async"] and not result["differ"]
        print(case, "OK" if ok else "DIFFERS", "losses equal:", sync == background, result)
        bad |= not ok
    sys.exit(1 if bad else 0)
