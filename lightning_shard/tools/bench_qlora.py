"""QLoRA memory: a ~1B Llama with a 4-bit (nf4, double-quantized) base and LoRA adapters on all its linear layers,
trained a few steps on N gloo ranks; each rank's peak resident memory in training next to the strategy's estimate.

    python -m lightning_shard.tools.bench_qlora --world 1
    python -m lightning_shard.tools.bench_qlora --world 2
    python -m lightning_shard.tools.bench_qlora --world 2 --layers 2    # a quick look

The model (TinyLlama-1.1B's shape by default: 22 layers, hidden 2048, intermediate 5632, 32/4 heads, vocab 32000) is
built on the meta device with bitsandbytes' 4-bit layers (transformers' ``replace_with_bnb_linear``, the head in
full precision), prepared as peft prepares k-bit training (norms, embeddings and head in fp32) and given LoRA
adapters; ``shard_module`` makes each unit real as it shards it (its 4-bit weights packed from the start: nothing
is loaded, so they are zeros; memory and kernels are the same). Steps run under bf16 autocast with fp32 gradient
reduction, AdamW on the adapters. Peak resident memory, setup apart: the high-water mark of resident memory
(``VmHWM``) through setup, and through the training steps (reset after setup, once what setup freed is handed back
to the system: ``malloc_trim``), each above the process after its imports. The estimate is ``estimate_memory`` of
the model before sharding: a training step's peak (its 4-bit layers' activations measured on fake tensors as
bitsandbytes' CPU kernels use memory: the dequantized weight in fp32 and in the compute dtype, in forward and again
in backward).
"""

from __future__ import annotations

import argparse
import ctypes
import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_shard.app.cli import ArgumentParser, at_least
from lightning_shard.tools import spawn_ranks
from lightning_shard.tools.bench_memory import _rss
from lightning_shard.tools.bench_probes import HostPeak

GiB, MiB = 2**30, 2**20
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def qlora_llama(args: argparse.Namespace) -> torch.nn.Module:
    """The model on the meta device, as QLoRA users build it."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(2048, args.seq),
                         tie_word_embeddings=False)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.uint8)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = replace_with_bnb_linear(model, quantization_config=quantization, modules_to_not_convert=["lm_head"])
    model = prepare_model_for_kbit_training(model.to(torch.bfloat16), use_gradient_checkpointing=False)
    return get_peft_model(model, LoraConfig(r=args.rank_lora, lora_alpha=2 * args.rank_lora, target_modules=TARGETS,
                                            lora_dropout=0.0))


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=ids, labels=ids, use_cache=False).loss


def _rank_main(rank: int, world: int, args: argparse.Namespace, port: int, out: str) -> None:
    from lightning_shard.engine.shard_module import shard_module
    from lightning_shard.memory.estimate import estimate_memory

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=60))
    start = _rss()
    model = qlora_llama(args)
    units = ["LlamaDecoderLayer"]
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank))
    estimate, note = None, ""
    if rank == 0:
        try:
            estimate = estimate_memory(model, world, units=units, param_dtype=torch.bfloat16,
                                       step=_loss, batch=ids, autocast=torch.bfloat16).as_dict()
        except Exception as err:  # (bitsandbytes' kernels on fake tensors): without the activations, said so
            note = f"activations not estimated ({type(err).__name__}: {str(err)[:120]})"
            estimate = estimate_memory(model, world, units=units, param_dtype=torch.bfloat16).as_dict()
    runtime = shard_module(model, units=units, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                           device=torch.device("cpu"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    runtime.attach_optimizer(optimizer)
    setup_peak = HostPeak._read("VmHWM") * 1024
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what setup freed goes back to the system: RSS then follows the tensors
    steps = HostPeak()
    steps.start()  # the high-water mark from here
    times = []
    for _ in range(args.steps):
        began = time.perf_counter()
        _loss(model, ids).backward()
        runtime.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
    held = sum(u.storage.shard.nbytes for u in runtime.units)
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump({"start": start, "setup": setup_peak, "steps": steps._read("VmHWM") * 1024, "estimate": estimate,
                     "note": note,
                     "times": times, "held": held, "params": sum(p.numel() for p in qlora_llama(args).parameters())}, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m lightning_shard.tools.bench_qlora", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=at_least(1), default=2)
    for option, default in (("layers", 22), ("hidden", 2048), ("intermediate", 5632), ("heads", 32), ("kv-heads", 4),
                            ("vocab", 32000), ("seq", 256), ("batch", 1), ("steps", 2), ("rank-lora", 16)):
        parser.add_argument(f"--{option}", type=at_least(1), default=default, help=f"default {default}")
    args = parser.parse_args(argv)
    ranks = spawn_ranks(_rank_main, args.world, args)
    print(f"QLoRA Llama: {ranks[0]['params'] / 1e9:.2f}B parameters as counted by the model ({args.layers} layers,"
          f" hidden {args.hidden}, intermediate {args.intermediate}, vocab {args.vocab}; nf4 with double quantization,"
          f" LoRA r={args.rank_lora} on 7 linears), {args.world} gloo rank(s), seq {args.seq} x batch {args.batch} per"
          f" rank, bf16 autocast, torch {torch.__version__}")
    for rank, r in enumerate(ranks):
        print(f"rank {rank}: resident memory above the process's start: {(r['steps'] - r['start']) / GiB:.2f} GiB at"
              f" the peak of the training steps, {(r['setup'] - r['start']) / GiB:.2f} GiB at the peak of setup;"
              f" shards held {r['held'] / MiB:.0f} MiB; step {min(r['times']):.1f} s")
    estimate = ranks[0]["estimate"]
    print(f"estimate (per rank): peak {estimate['peak'] / GiB:.2f} GiB; " +
          ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in estimate.items() if v and k != "peak"))
    if ranks[0]["note"]:
        print(f"note: {ranks[0]['note']}")


if __name__ == "__main__":
    main()
