"""The simulated process group (lightning_shard/simulate/): every collective the engine and FSDP2 use, worlds 1-16,
odd sizes, dtypes (4-bit weights' bytes included), its time accounting, groups across nodes; the engine and FSDP2
on a simulated world of 8; the estimator against the memory a simulated rank of 8 measures for a real model's shapes;
the command on the CPU. Each simulated world is the default process group of this process for the test's length
(destroyed after); the runs of the command are processes of their own."""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from lightning_shard.simulate import backend
from lightning_shard.simulate.links import GB, LINKS, Link

pytestmark = pytest.mark.timeout(240)


@contextmanager
def simulated(world: int, rank: int = 0, **options):
    sim = backend.start(world, rank, **options)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's deprecation of the older collective names
            yield sim
    finally:
        dist.destroy_process_group()


def _all_gather(output, shard, async_op=False):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, shard, async_op=async_op)


def _reduce_scatter(output, flat, op=dist.ReduceOp.SUM):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, flat, op=op)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_every_collective_gives_what_identical_ranks_would_and_counts_nccl_tests_bytes(world, dtype):
    link = LINKS["h100-nvlink"]
    with simulated(world, rank=world - 1) as sim:
        rank, size = world - 1, 2 * world + 1  # an odd shard
        shard = torch.arange(size).to(dtype)
        gathered = torch.full((world * size,), 7).to(dtype)
        _all_gather(gathered, shard)
        assert torch.equal(gathered, shard.repeat(world))
        in_place = torch.zeros(world * size, dtype=dtype)  # the shard a slice of the output (FSDP2's copy-in)
        in_place[rank * size:(rank + 1) * size] = shard
        _all_gather(in_place, in_place[rank * size:(rank + 1) * size])
        assert torch.equal(in_place, shard.repeat(world))
        flat = torch.arange(world * size).to(dtype)
        out = torch.empty(size, dtype=dtype)
        if dtype != torch.uint8:  # (4-bit bytes are gathered, never reduced)
            _reduce_scatter(out, flat)
            assert torch.equal(out, flat[rank * size:(rank + 1) * size] * world)
            if dtype.is_floating_point:
                _reduce_scatter(out, flat, op=dist.ReduceOp.AVG)
                assert torch.equal(out, flat[rank * size:(rank + 1) * size])
            summed = torch.arange(3).to(dtype)
            dist.all_reduce(summed)
            assert torch.equal(summed, torch.arange(3).to(dtype) * world)
        flags = torch.tensor([1, 0, 5]).to(dtype)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # an agreement: this rank's, as if every rank agreed
        assert flags.tolist() == [1, 0, 5]
        sent = torch.arange(4).to(dtype)
        dist.broadcast(sent, src=0)
        assert sent.tolist() == [0, 1, 2, 3]
        swapped = torch.empty(world * 2, dtype=dtype)
        dist.all_to_all_single(swapped, torch.arange(world * 2).to(dtype))
        assert torch.equal(swapped, torch.arange(world * 2).to(dtype))
        everyone = [None] * world
        dist.all_gather_object(everyone, {"rank": rank})
        assert everyone == [{"rank": rank}] * world
        dist.barrier()
        element = shard.element_size()
        ledger = sim.ledger
        assert ledger["all_gather"][1] >= 2 * world * size * element  # both gathers, counted at their output
        if world == 1:
            assert sum(entry[2] for entry in ledger.values()) == 0  # one rank communicates nothing
        else:
            assert ledger["all_gather"][0] >= 2
            gather = 2 * link.seconds("all_gather", world * size * element, world)
            assert ledger["all_gather"][2] >= gather


def test_the_cost_model_is_nccl_tests_formula():
    nvlink = LINKS["h100-nvlink"]
    assert nvlink.seconds("all_gather", 8 * 2**30, 8) == pytest.approx(12.5e-6 + 8 * 2**30 * 7 / 8 / (370 * GB))
    assert nvlink.seconds("reduce_scatter", 2**30, 8) == pytest.approx(12.5e-6 + 2**30 * 7 / 8 / (370 * GB))
    assert nvlink.seconds("all_reduce", 2**30, 8) == pytest.approx(12.5e-6 + 2**30 * 2 * 7 / 8 / (480 * GB))
    assert nvlink.seconds("broadcast", 2**30, 8) == pytest.approx(12.5e-6 + 2**30 / (370 * GB))
    assert nvlink.seconds("all_gather", 2**30, 1) == 0 and LINKS["zero"].seconds("all_reduce", 2**30, 8) == 0
    assert all(LINKS[name].source for name in LINKS)  # every preset says where its figures come from


SLOW = Link("slow", "a link slow enough to time on a busy machine", 0.15, {k: 1e12 for k in
                                                                          ("all_gather", "reduce_scatter", "all_reduce",
                                                                           "broadcast", "all_to_all")}, "a test's")


@pytest.mark.parametrize("sharing", ["serial", "free"])
def test_time_is_spent_in_wait_and_a_link_carries_one_collective_at_a_time(sharing):
    """On the CPU a collective's time passes from its issue, spent in wait() (or at once when synchronous). On one link
    ``serial`` runs them one after the other (the second of two issued together ends after both), ``free`` at once."""
    with simulated(8, link=SLOW, sharing=sharing):
        shard, out = torch.ones(4), torch.empty(32)
        start = time.perf_counter()
        first = _all_gather(out, shard, async_op=True)
        second = _all_gather(out.clone(), shard, async_op=True)
        issued = time.perf_counter() - start
        assert issued < 0.1  # issuing does not wait
        first.wait()
        assert time.perf_counter() - start >= 0.15
        second.wait()
        both = time.perf_counter() - start
        assert both >= (0.30 if sharing == "serial" else 0.15)
        if sharing == "free":
            assert both < 0.30
        start = time.perf_counter()
        dist.all_reduce(torch.ones(2))  # synchronous: its time passes in the call
        assert time.perf_counter() - start >= 0.15


def test_a_group_across_nodes_takes_the_network():
    """Hybrid sharding at world 16, 8 ranks a node: the shard group on the node's NVLink, the replicas' all-reduce of
    the gradient shards over InfiniBand."""
    from lightning_shard.engine.shard_module import shard_module
    from tests.models import TinyGPT

    with simulated(16, rank=3, per_node=8) as sim:
        model = TinyGPT()
        runtime = shard_module(model, sharding="hybrid", shard_size=8)
        sim.reset_ledger()
        batch = TinyGPT.batch(torch.Generator().manual_seed(0), 4)
        runtime.run_step(lambda: TinyGPT.loss(model, batch, 0)).backward()
        runtime.after_optimizer_step()
        assert sim.links["h100-nvlink"][0] > 0 and sim.links["ib-ndr"][0] > 0, dict(sim.links)
        assert runtime.last_step_stats["cross_group_bytes"] > 0


@pytest.mark.parametrize("world", [8, 5])
def test_the_engine_and_fsdp2_train_on_a_simulated_world(world):
    """Both strategies run their steps on the simulated group (odd world included): the engine's own count of bytes
    gathered is the group's, and this rank holds 1/world of each unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_shard.engine.shard_module import shard_module
    from tests.models import TinyGPT

    batch = TinyGPT.batch(torch.Generator().manual_seed(0), 4)
    with simulated(world) as sim:
        model = TinyGPT()
        numel = sum(p.numel() for p in model.parameters())
        runtime = shard_module(model, units=["Block"], param_dtype=torch.bfloat16)
        with runtime.shaped_parameters():
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runtime.attach_optimizer(optimizer)
        for _ in range(2):
            sim.reset_ledger()
            loss = runtime.run_step(lambda: TinyGPT.loss(model, batch, 0))
            loss.backward()
            runtime.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
            runtime.after_optimizer_step()
        assert torch.isfinite(loss)
        assert runtime.last_step_stats["all_gather_bytes"] == sim.ledger["all_gather"][1]
        shards = sum(u.storage.shard.numel() for u in runtime.units)
        assert numel / world <= shards <= numel / world + world * len(runtime.units)
    with simulated(world) as sim:
        model = TinyGPT()
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        TinyGPT.loss(model, batch, 0).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        assert sim.ledger["all_gather"][0] > 0 and sim.ledger["reduce_scatter"][0] > 0


def test_the_estimate_against_a_simulated_rank_of_eight_on_llama_840m_shapes():
    """HF Llama 840M's layers (hidden 2048, 4 KV heads, vocab 32000; 2 of its 16 layers), bf16 parameters, world 8:
    lightning_shard's estimate of a rank's peak against the live tensor bytes of a simulated rank's steady step.
    Measured 0.92x on the project's CPU machine (2026-12): within 10%, not the 5% the GPU goal asks (docs/gpus.md)."""
    pytest.importorskip("transformers")
    from lightning_shard.simulate.command import run_in_process
    from lightning_shard.simulate.run import RunSpec

    result = run_in_process(RunSpec("ours", "llama-840m", layers=2, seq=64, batch=2, world=8, link="zero",
                                    estimate=True, steps=1, warmup=1))
    ratio = result["estimate"]["peak"] / result["peak"]
    assert 0.9 <= ratio <= 1.1, (ratio, result["estimate"], result["peak"])


def test_the_command_on_the_cpu(capsys):
    from lightning_shard.simulate.command import main

    main(["--device", "cpu", "--layers", "1", "--seq", "16", "--batch", "1", "--steps", "1", "--warmup", "1",
          "--no-zero"])
    out = capsys.readouterr().out
    assert "| ours |" in out and "| fsdp2 |" in out and "world 8 on h100-nvlink" in out
    assert "ours / FSDP2: step" in out
