"""The CUDA path, against references that run the same arithmetic. Every test skips without a CUDA device;
``bash .ci/gpu`` runs them on a GPU machine.

* One rank on one GPU (NCCL, world 1), through the Trainer: ShardStrategy against Lightning with no strategy
  on the same model and data, in 32-true and bf16-mixed.
* Two ranks on the same GPU through gloo, the engine alone: against DDP on the same GPU, each sharding mode.
* Two and three ranks on the same GPU through gloo with everything the CUDA path does at world > 1 turned on
  (tests/cuda_world_scenarios.py: side-stream prefetch 1 and 2, accumulation, clipping, offload, a unit of two dtypes,
  bf16 gathers with fp32 reduction), against DDP on the same world and group.

Run as a script (``python tests/test_cuda.py OUT PRECISION DEVICE``), this file trains the world-1 runs in a
fresh interpreter (the process group and CUDA state stay out of pytest) and saves them to OUT.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bash .ci/gpu)"),
              pytest.mark.timeout(300)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR = 1e-2  # LitGPT's AdamW (tests/lightning_app.py)


# -- one rank on one GPU, through the Trainer ---------------------------------------------------------------------
def fit(strategy, precision: str, device: str, optimizer: str = "adamw", adamw: str | None = None,
        max_steps: int = -1) -> dict:
    """One epoch (24 steps, or ``max_steps``) of tests/lightning_app.py's LitGPT; per-step losses and the final full
    state. ``adamw``: AdamW's implementation as the user chose it (None: not chosen)."""
    import lightning as L

    from lightning_shard import ShardStrategy
    from lightning_shard.checkpoint.full import full_state_dict
    from tests.lightning_app import LitGPT, loader

    class WhereItRan(L.Callback):  # read during training: Lightning's teardown moves a plain module back to the CPU
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.param_device = str(next(pl_module.parameters()).device)

    torch.manual_seed(0)
    module = LitGPT(manual=optimizer == "muon", optimizer=optimizer, adamw_implementation=adamw)
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    where_it_ran = WhereItRan()
    plain = not isinstance(strategy, ShardStrategy)  # (a callback's hook between steps changes how offload stages)
    trainer = L.Trainer(
        accelerator=device, devices=1, strategy=strategy, precision=precision, max_epochs=1, max_steps=max_steps,
        logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False,  # else ShardStrategy (distributed, at world 1 too) reads a shuffled order
        deterministic="warn",  # the same kernels run to run (cuBLAS workspace, deterministic backward where there is one)
        callbacks=[where_it_ran] if plain else [],
    )
    trainer.fit(module, loader(1))
    if isinstance(strategy, ShardStrategy):
        from lightning_shard.engine.optim.fused_default import unchosen_groups

        runtime = strategy.runtime
        state = full_state_dict(runtime)
        step = runtime.optimizers.step_of(trainer.optimizers[0])
        where = {"units": len(runtime.units), "shard_device": str(runtime.units[0].storage.shard.device),
                 "backend": torch.distributed.get_backend(), "pinned": runtime.units[0].storage.shard.is_pinned(),
                 # stepped by torch's fused kernel where the groups chose no implementation
                 "fused": step is not None and step.fused is not None and bool(unchosen_groups(trainer.optimizers[0])),
                 # offload: optimizer steps overlapped with backward (engine/optim/host_step.py)
                 "overlapped": runtime.host_stepper.overlapped_steps if runtime.host_stepper is not None else 0,
                 # of those, units stepped after optimizer.step() returned (the next forward behind them)
                 "behind": runtime.host_stepper.deferred.deferred_units if runtime.host_stepper is not None else 0}
    else:
        state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        where = {"param_device": where_it_ran.param_device}
    return {"losses": module.step_losses, "state": state, "initial": initial, **where}


def fit_all(out: str, precision: str, device: str) -> None:
    from lightning_shard import MixedPrecision, ShardStrategy
    from tests.models import SlowAdamW

    # Lightning's single-device strategy (no sharding code), with torch's AdamW as torch picks it on a GPU (foreach)
    # and fused, which the sharded step picks where the user chose neither (engine/optim/fused_default.py)
    results = {"plain": fit("auto", precision, device),
               "plain_fused": fit("auto", precision, device, adamw="fused"),
               "shard": fit(ShardStrategy(units=["Block"], prefetch=1), precision, device)}
    if precision == "32-true":
        # the user's choice of kernel is kept
        results["shard_foreach"] = fit(ShardStrategy(units=["Block"], prefetch=1), precision, device, adamw="foreach")
        # Muon (2-D) + AdamW in manual optimization: whole parameters stepped in place
        results["plain_muon"] = fit("auto", precision, device, optimizer="muon", adamw="fused")
        results["shard_muon"] = fit(ShardStrategy(units=["Block"], prefetch=1), precision, device, optimizer="muon")
    for offload in ("optimizer", "params"):  # the training state in pinned host memory, stepped by the CPU
        results[f"shard_offload_{offload}"] = fit(ShardStrategy(units=["Block"], prefetch=1, offload=offload),
                                                  precision, device)
    # offload's step after the backward (no overlap): the same CPU arithmetic as the overlapped one
    results["shard_offload_serial"] = fit(ShardStrategy(units=["Block"], prefetch=1, offload="optimizer",
                                                        offload_overlap=False), precision, device)
    # a host slower than the GPU: optimizer.step() returns with units still to step, and the next forward's gathers
    # wait for each (their copies queued by the host thread on its own stream)
    for name, overlap in (("behind", True), ("behind_serial", False)):
        results[f"shard_offload_{name}"] = fit(
            ShardStrategy(units=["Block"], prefetch=1, offload="optimizer", offload_overlap=overlap,
                          elementwise_optimizers=[SlowAdamW]), precision, device, optimizer="slow adamw")
    # the first step, and the first three, of offload against the device's step (see offload_matches_the_device_step)
    for steps in (1, 3):
        results[f"first{steps}_shard"] = fit(ShardStrategy(units=["Block"], prefetch=1), precision, device,
                                             max_steps=steps)
        for offload in ("optimizer", "params"):
            results[f"first{steps}_offload_{offload}"] = fit(
                ShardStrategy(units=["Block"], prefetch=1, offload=offload), precision, device, max_steps=steps)
    if precision == "bf16-mixed":  # fp32 gathers under the same autocast: the arithmetic of the plain run
        results["shard_fp32_gathers"] = fit(ShardStrategy(units=["Block"], prefetch=1,
                                                          mixed_precision=MixedPrecision()), precision, device)
    torch.save(results, out)


def run_fit_all(tmp_path, precision: str, device: str = "cuda") -> dict:
    out = tmp_path / f"{precision}.pt"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(out), precision, device], cwd=ROOT,
                          capture_output=True, text=True, timeout=280, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out, weights_only=True)


def assert_same_training(run: dict, reference: dict, rtol: float, atol: float, name: str) -> None:
    assert len(run["losses"]) == len(reference["losses"]) == 24
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]), rtol=rtol, atol=atol,
                               msg=lambda m: f"{name}: per-step losses differ from plain Lightning: {m}")
    assert run["state"].keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        torch.testing.assert_close(run["state"][key], value, rtol=rtol, atol=atol,
                                   msg=lambda m, k=key: f"{name}: parameter {k} differs from plain Lightning: {m}")


def assert_ran_on_the_gpu(results: dict) -> None:
    assert results["plain"]["param_device"] == "cuda:0"
    for name, run in results.items():
        if name.startswith("plain"):
            continue
        if name.startswith("shard_offload"):
            assert run["shard_device"] == "cpu" and run["pinned"] and run["backend"] == "nccl", (name, run)
        elif name.startswith("shard"):
            assert run["shard_device"] == "cuda:0" and run["backend"] == "nccl", (name, run["shard_device"])
            assert run["units"] == 4, name  # 3 blocks and the root: gathers, prefetch and frees happen


def test_world_size_one_32_true_matches_plain_lightning(tmp_path):
    results = run_fit_all(tmp_path, "32-true")
    assert_ran_on_the_gpu(results)
    # The same fp32 kernels on the same data: what differs is where the parameters live (views into a flat buffer)
    # and the engine's world-1 reduction (a division by 1); on the CPU the two runs are bit-identical. 1e-6 relative
    # leaves room for a kernel picked for another alignment; a stale or missing gradient or a buffer read before its
    # stream hand-over moves the losses by far more. AdamW with no implementation chosen steps fused in the sharded
    # run (torch would pick foreach: the same formula, rounded apart by an ulp at times, which bf16 then amplifies:
    # measured on an H100, 2.5e-7 on a parameter after 24 steps in fp32, 0.1% on a bf16 loss), so it is compared
    # with plain Lightning running the fused kernel too; a user's choice of foreach is kept and matches plain's.
    assert results["shard"]["fused"] and not results["shard_foreach"]["fused"]
    assert_same_training(results["shard"], results["plain_fused"], rtol=1e-6, atol=1e-7, name="32-true")
    assert_same_training(results["shard_foreach"], results["plain"], rtol=1e-6, atol=1e-7, name="32-true foreach")
    # torch's Muon orthogonalises in bf16: a 1-ulp difference can round the other way and grow (the README's
    # Optimizers section); at world 1 the inputs are the plain run's, so it stays within the same bound
    assert_same_training(results["shard_muon"], results["plain_muon"], rtol=1e-6, atol=1e-7, name="32-true Muon")
    offload_matches_the_device_step(results, "32-true")


def test_world_size_one_bf16_mixed_matches_plain_lightning(tmp_path):
    results = run_fit_all(tmp_path, "bf16-mixed")
    assert_ran_on_the_gpu(results)
    plain = results["plain_fused"]  # AdamW's kernel as the sharded step picks it (see the 32-true test)
    # fp32 gathers under the Trainer's autocast: autocast casts the same fp32 weights to bf16 for the same ops as
    # in the plain run, so the arithmetic is the same; 1e-5 rather than 1e-6 because a 1-ulp fp32 difference
    # (a kernel picked for another alignment) that flips one bf16 rounding moves that element by 2^-9.
    assert_same_training(results["shard_fp32_gathers"], plain, rtol=1e-5, atol=1e-6, name="bf16-mixed, fp32 gathers")
    # The default bf16-mixed gathers bf16 weights: the weights autocast leaves in fp32 in the plain run (LayerNorm,
    # the embeddings and positions) are rounded to bf16 (8 significant bits, 2^-9 relative) here, so the runs are
    # different arithmetic and drift apart over the steps. The same comparison on the CPU (autocast there; the
    # two other comparisons are bit-identical on the CPU) measured a per-step loss gap of at most 0.3% and
    # parameter updates (final - initial) at most 6.4% apart in L2 (LayerNorm weights; 1.9% on average): the
    # bounds leave 4-7x room for the GPU's own rounding. A broken path (stale weights, lost updates) is ~100% off.
    run = results["shard"]
    losses, reference = torch.tensor(run["losses"]), torch.tensor(plain["losses"])
    assert ((losses - reference).abs() / reference).max() < 0.02, (losses, reference)
    assert run["state"].keys() == plain["state"].keys()
    for key, value in plain["state"].items():
        update, expected = run["state"][key] - plain["initial"][key].cpu(), value - plain["initial"][key].cpu()
        assert expected.norm() > 0, key  # every parameter trains
        assert (update - expected).norm() / expected.norm() < 0.25, (key, (update - expected).norm() / expected.norm())
    offload_matches_the_device_step(results, "bf16-mixed")


def offload_matches_the_device_step(results: dict, precision: str) -> None:
    """Offload steps AdamW on the CPU (torch's fused CPU kernel), the device run on the GPU (its fused kernel): the
    same formula in fp32, rounded apart by an ulp at times. Under bf16-mixed such an ulp can flip a bf16 rounding
    of the next gather and grow over the steps (on an H200, 9 of 126 elements of a parameter 5e-4 apart after 24
    steps), so a bound on 24 steps cannot tell that from a defect. Instead:
    * after the first step, from the same weights and the same gradients (the same GPU kernels computed them),
      every weight within 4 ulps of the device run's, plus 8 ulps of the learning rate (the update's own rounding,
      which dominates near zero): a lost, stale or doubled update is off by ~lr;
    * after three steps, each parameter's update within 2% of the device run's in L2: one step lost or applied to a
      stale copy is a third of it;
    * the overlapped step (each unit stepped as its gradient lands) equals offload's step after the backward bit
      for bit over the whole epoch: the same CPU kernels on the same tensors; any difference is a stream or staging
      defect, not rounding. So does it with a host slower than the GPU, where the next forward runs behind it."""
    for offload in ("optimizer", "params"):
        first, device_first = results[f"first1_offload_{offload}"], results["first1_shard"]
        for key, value in device_first["state"].items():
            torch.testing.assert_close(first["state"][key], value, rtol=4 * 2**-23, atol=8 * 2**-23 * LR,
                                       msg=lambda m, k=key: f"{precision}, offload={offload}, first step: {k} is"
                                       f" more than 4 ulps (+ 8 of the lr) from the device step's: {m}")
        assert first["overlapped"] == 1, (offload, first["overlapped"])
        three, device_three = results[f"first3_offload_{offload}"], results["first3_shard"]
        for key, value in device_three["state"].items():
            initial = device_three["initial"][key].cpu()
            expected, update = value - initial, three["state"][key] - initial
            assert expected.norm() > 0, key
            gap = float((update - expected).norm() / expected.norm())
            assert gap < 0.02, f"{precision}, offload={offload}, three steps: {key}'s update is {gap:.1%} off"
        assert results[f"shard_offload_{offload}"]["overlapped"] == 24
    assert results["shard_offload_serial"]["overlapped"] == 0
    for overlapped, serial in (("optimizer", "serial"), ("behind", "behind_serial")):
        overlapped, serial = results[f"shard_offload_{overlapped}"], results[f"shard_offload_{serial}"]
        assert serial["losses"] == overlapped["losses"], precision
        for key, value in serial["state"].items():
            assert torch.equal(overlapped["state"][key], value), (precision, key)
    assert results["shard_offload_behind"]["behind"] > 0


def test_a_training_step_makes_no_host_sync():
    """Issue 30: the host must never wait for the GPU inside a step (bf16 gathers, norm clipping, the optimizer
    step, zero_grad): under sync debug mode "error" any synchronizing call raises; a `.item()` is the control."""
    from lightning_shard.engine.shard_module import shard_module
    from tests.models import TinyGPT

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    runtime = shard_module(model, units=["Block"], param_dtype=torch.bfloat16, device=device)
    with runtime.shaped_parameters():
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runtime.attach_optimizer(optimizer)
    batch = TinyGPT.batch(torch.Generator().manual_seed(0), 8).to(device)

    def step() -> None:
        runtime.run_step(lambda: TinyGPT.loss(model, batch, 0)).backward()
        runtime.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], 1.0)
        runtime.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):  # the optimizer's state and the plans are made in the first steps
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.ones((), device=device).item()
    finally:
        torch.cuda.set_sync_debug_mode(0)


# -- two ranks on one GPU through gloo, the engine alone -----------------------------------------------------------
def gloo_refuses(device: torch.device) -> str | None:
    """Why gloo cannot run the engine's collectives on ``device``'s tensors here, or None if it can."""
    import torch.distributed as dist

    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # as engine/comm/collectives.py
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        gathered = torch.empty(world, device=device)
        all_gather(gathered, torch.full((1,), rank + 1.0, device=device))
        reduced = torch.empty(1, device=device)
        reduce_scatter(reduced, torch.full((world,), rank + 1.0, device=device))
        summed = torch.full((1,), rank + 1.0, device=device)
        dist.all_reduce(summed)
        sent = torch.full((1,), rank + 1.0, device=device)
        dist.broadcast(sent, src=0)
    except (RuntimeError, ValueError, NotImplementedError) as err:  # gloo says "not supported" in its own words
        return f"gloo refuses {device.type} tensors: {type(err).__name__}: {str(err).splitlines()[0]}"
    expected = sum(range(1, world + 1))
    assert gathered.tolist() == [r + 1.0 for r in range(world)] and reduced.item() == expected, "gloo's answers"
    assert summed.item() == expected and sent.item() == 1.0, "gloo's answers"
    return None


def device_or_refusal(device_type: str) -> tuple[torch.device, str | None]:
    """Device 0 of ``device_type``, made current (every rank of a world sharing one GPU), and why gloo cannot run the
    engine's collectives on its tensors here, or None (every rank calls it: it runs them)."""
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device, gloo_refuses(device)


def two_ranks_one_device(rank: int, world: int, device_type: str, steps: int = 20) -> dict:
    """Each sharding mode and DDP, both on ``device_type`` (every rank on device 0), the same global batches."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_shard.checkpoint.full import full_state_dict
    from lightning_shard.engine.shard_module import shard_module
    from tests.engine_scenarios import train
    from tests.models import TinyGPT

    device, refused = device_or_refusal(device_type)
    if refused:
        return {"refused": refused}
    g = torch.Generator().manual_seed(1234)
    batches = [TinyGPT.batch(g, 12).to(device) for _ in range(steps)]
    report = {}
    for mode in ("full", "grad_op", "none"):
        torch.manual_seed(0)
        reference = TinyGPT()
        sharded = copy.deepcopy(reference).to(device)
        ddp = DDP(reference.to(device), device_ids=[0] if device.type == "cuda" else None)
        expected_losses = train(ddp, TinyGPT.loss, batches, rank, world)
        runtime = shard_module(sharded, sharding=mode, prefetch=1, device=device)
        losses = train(sharded, TinyGPT.loss, batches, rank, world, runtime=runtime)
        runtime.after_optimizer_step()  # closes the stall measurements of all the steps (train() does not)
        report[mode] = {
            "streams": type(runtime.streams).__name__, "exposed": runtime.last_step_stats["exposed_seconds"],
            "losses": losses, "expected_losses": expected_losses, "units": len(runtime.units),
            "shard_device": str(runtime.units[0].storage.shard.device),
            "state": full_state_dict(runtime, rank0_only=False),
            "expected": {k: v.detach().cpu() for k, v in reference.state_dict().items()},
        }
    return report


def assert_two_ranks_match_ddp(reports: list[dict], device: str) -> None:
    for rank, report in enumerate(reports):
        for mode, r in report.items():
            assert r["shard_device"] == device and r["units"] == 4, (rank, mode, r["shard_device"], r["units"])
            # the CUDA streams ran, and the compute stream's waits on them were timed by events
            assert r["streams"] == ("CudaStreams" if device.startswith("cuda") else "HostStreams"), r["streams"]
            assert 0 <= r["exposed"] < 60, (rank, mode, r["exposed"])
            # as tests/test_engine_parity.py on the CPU: the same per-rank arithmetic as DDP, 1e-5 relative
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["expected_losses"]), rtol=1e-5,
                                       atol=1e-6, msg=lambda m: f"[rank {rank}/{mode}] losses differ from DDP: {m}")
            assert r["losses"][-1] < r["losses"][0], (mode, r["losses"])
            assert r["state"].keys() == r["expected"].keys()
            for key, value in r["expected"].items():
                torch.testing.assert_close(r["state"][key], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=key: f"[rank {rank}/{mode}] {k} differs from DDP: {m}")


def test_two_ranks_on_one_gpu_through_gloo_match_ddp():
    from tests.world import run_world

    reports = run_world(two_ranks_one_device, 2, "cuda", timeout=240)
    refused = [r["refused"] for r in reports if "refused" in r]
    if refused:
        pytest.skip(refused[0])
    assert_two_ranks_match_ddp(reports, "cuda:0")


@pytest.mark.parametrize("offload", [None, "optimizer"])
def test_async_save_copies_device_shards_into_pinned_memory_and_writes_what_a_synchronous_save_writes(tmp_path,
                                                                                                     offload):
    """``async_save``'s staging on a GPU: the device tensors copied into pinned host memory without the host waiting,
    on the stream the next steps' kernels follow (two of them run before the write); under offload, from the host
    shards. The checkpoint is the synchronous save's, bit for bit (tests/test_checkpoint_async.py on the CPU)."""
    from tests import async_checkpoint_scenarios as scenarios
    from tests.test_checkpoint_async import consolidated, same
    from tests.world import run_world

    results = run_world(scenarios.engine_both_ways, 2, "cuda", str(tmp_path), offload, timeout=240)
    refused = [r["refused"] for r in results if "refused" in r]
    if refused:
        pytest.skip(refused[0])
    for r in results:
        assert r["held"] == [[2]] and "cuda:0" in r["devices"] and r["pinned"], r
        assert r["held_bytes"] == r["bytes"]
    assert same(consolidated(tmp_path / "async"), consolidated(tmp_path / "sync"))


@pytest.mark.parametrize("world", [2, 3])
def test_world_2_and_3_on_one_gpu_with_the_whole_cuda_path_match_ddp(world):
    """World 1 skips most of the CUDA path (no side-stream gathers, no reductions to hand over): a stream race shows
    only at world > 1. gloo moves real data between the processes, CUDA tensors included (it stages them through host
    memory itself); where it refuses one of the engine's collectives the test skips, naming it."""
    from tests.cuda_world_scenarios import SCENARIOS, against_ddp, assert_like_ddp
    from tests.world import run_world

    names = tuple(SCENARIOS)
    reports = run_world(against_ddp, world, "cuda", names, timeout=280)
    refused = [r["refused"] for r in reports if "refused" in r]
    if refused:
        pytest.skip(refused[0])
    assert_like_ddp(reports, names)
    for report in reports:
        for name in names:
            r = report[name]
            assert r["streams"] == "CudaStreams", (name, r["streams"])  # the side streams and their events ran
            assert r["shard_device"] == ("cpu" if "offload" in name else "cuda:0"), (name, r["shard_device"])


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    fit_all(*sys.argv[1:4])
