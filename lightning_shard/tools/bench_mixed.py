"""A unit of several dtypes gathered in one collective (its bytes, ``engine/storage/mixed_shard.py``) against one collective
per dtype, on the CPU (gloo), one thread per rank:

    python -m lightning_shard.tools.bench_mixed --world 2 --hidden 2048 --intermediate 5632 --rank-lora 16

The unit is one Llama decoder layer of that size as Hugging Face's LoRA recipe makes it: a bf16 base (its seven
linear layers and two norms) and fp32 LoRA adapters on all seven linear layers, gathered in bf16 (bf16-mixed).
``one``: the engine's gather of the unit and its free (the adapters cast into the rank's range of its master shard,
one all-gather of the range into the unit's buffer, given its memory back for it). ``per dtype``: the same bytes as
two groups each split evenly over the ranks, as a unit per dtype would hold them: the adapters' shard cast, then one
all-gather of the base's bytes and one of the adapters', each into a buffer allocated for it and freed.
Configurations are interleaved (A B A B) and medians reported, with their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from lightning_shard.tools import spawn_ranks


def _layer(hidden: int, intermediate: int, rank_lora: int) -> torch.nn.Module:
    import peft
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=max(1, hidden // 256))

    class OneLayer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = LlamaDecoderLayer(config, 0)

    torch.manual_seed(0)
    model = OneLayer().to(torch.bfloat16)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return peft.get_peft_model(model, peft.LoraConfig(r=rank_lora, target_modules=targets))


def _rank(rank: int, world: int, args: argparse.Namespace, port: int, out: str) -> None:
    import pickle

    from lightning_shard.engine.shard_module import shard_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    runtime = shard_module(_layer(args.hidden, args.intermediate, args.rank_lora), units=["LlamaDecoderLayer"],
                           param_dtype=torch.bfloat16)
    unit = next(u for u in runtime.units if u is not runtime.root_unit)
    slots = unit.storage.slots
    base_bytes = sum(s.gather_nbytes for s in slots if not s.requires_grad)
    adapters = sum(s.numel for s in slots if s.requires_grad)
    per_rank_base = -(-base_bytes // world)
    base_shard = torch.zeros(per_rank_base, dtype=torch.uint8)
    adapter_master = torch.zeros(-(-adapters // world), dtype=torch.float32)

    def one() -> None:
        runtime.schedule.gather(unit)
        runtime.schedule.reshard(unit)

    def per_dtype() -> None:  # each group's gathered buffer allocated and freed, as the engine's is
        base_out = torch.empty(per_rank_base * world, dtype=torch.uint8)
        adapter_out = torch.empty(adapter_master.numel() * world, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(base_out, base_shard)
        dist.all_gather_into_tensor(adapter_out, adapter_master.to(torch.bfloat16))
        del base_out, adapter_out

    times: dict[str, list[float]] = {"one": [], "per dtype": []}
    for i in range(args.warmup + args.repeats):
        for name, fn in (("one", one), ("per dtype", per_dtype)):
            dist.barrier()
            start = time.perf_counter()
            fn()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    result = {name: statistics.median(values) for name, values in times.items()}
    result.update(bytes=unit.storage.gathered_nbytes, base=base_bytes, adapters=adapters * 2)
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--rank-lora", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    results = spawn_ranks(_rank, args.world, args)
    first = results[0]
    one, per_dtype = max(r["one"] for r in results), max(r["per dtype"] for r in results)
    print(f"torch {torch.__version__}, gloo, {args.world} ranks, one thread each; a Llama layer hidden {args.hidden},"
          f" intermediate {args.intermediate}, LoRA r={args.rank_lora} on 7 linears, bf16-mixed")
    print(f"unit gathered: {first['bytes'] / 2**20:.1f} MiB (base {first['base'] / 2**20:.1f} MiB, adapters"
          f" {first['adapters'] / 2**20:.2f} MiB in bf16)")
    print(f"  one all-gather of the unit's bytes   {one * 1e3:8.2f} ms (median, slowest rank)")
    print(f"  one all-gather per dtype (two)       {per_dtype * 1e3:8.2f} ms")
    print(f"  ratio one / per dtype                {one / per_dtype:8.3f}")


if __name__ == "__main__":
    main()
