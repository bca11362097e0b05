"""Where a step's host time goes: one configuration of the step benchmark, in this process, profiled for a few
steps after warm-up.

    python -m lightning_shard.tools.profile_host --device cuda --config plain --precision bf16-mixed
    python -m lightning_shard.tools.profile_host --device cuda --config shard_full --precision bf16-mixed --python
    python -m lightning_shard.tools.profile_host --device cuda --model hf-llama --seq 256 --config shard_full

Prints the step's wall time, the GPU's busy time in it (the sum of its kernels and copies: where they do not overlap,
plain and lightning_shard at world 1, wall minus busy is the time the GPU waited for the host; FSDP2's copies run on
side streams, so its "waited" reads low), and the operators that took the most host time of their own
(torch.profiler). Run each configuration in its own process, as above: a run after another in one process is slower
on a GPU.

``--python``: Python's own profiler instead (cProfile, which slows Python code several times over, so only its
ranking means something): the functions with the most time of their own. On a GPU, backward (and so the engine's
backward hooks) runs on autograd's own thread, which cProfile does not see: there, ``tools/bench_overhead --device
cuda --hooks`` times each hook.
"""

from __future__ import annotations

import argparse
import io
import pstats

import lightning as L
import torch

from lightning_shard.app.cli import ArgumentParser, at_least
from lightning_shard.tools.bench import _data, _strategy
from lightning_shard.tools.bench_models import DEFAULTS, MODELS, BenchLM, build_model
from lightning_shard.tools.bench_probes import ProfileSteps

ROWS = 25
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")


def report(probe: ProfileSteps) -> str:
    per_step = 1e3 / probe.count
    lines = [f"{probe.count} steps profiled: wall {probe.wall * per_step:.2f} ms per step (under the profiler)"]
    if probe.python:
        text = io.StringIO()
        pstats.Stats(probe.profiler, stream=text).sort_stats("tottime").print_stats(ROWS)
        return "\n".join(lines) + "\n" + text.getvalue()
    averages = probe.profiler.key_averages()
    if probe.cuda:
        from torch.autograd import DeviceType

        # as torch's own table sums it: kernels and copies, not the annotations that span them
        busy = sum(e.self_device_time_total for e in averages
                   if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1e3 / probe.count
        lines.append(f"GPU busy {busy:.2f} ms per step: the GPU waited {probe.wall * per_step - busy:.2f} ms")
    launches = sum(e.count for e in averages if e.key in LAUNCHES)
    lines.append(f"kernel launches per step: {launches / probe.count:.0f}")
    lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=ROWS, max_name_column_width=60))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m lightning_shard.tools.profile_host", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="gpt")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--config", choices=("plain", "fsdp2", "shard_full", "shard_grad_op"), default="shard_full")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="bf16-mixed")
    parser.add_argument("--python", action="store_true", help="cProfile's ranking of Python functions instead")
    parser.add_argument("--profiled", type=at_least(1), default=3, help="steps profiled after warm-up (default: 3)")
    for option in ("warmup", "depth", "width", "heads", "seq", "batch", "vocab"):
        parser.add_argument(f"--{option}", type=at_least(1), default=None, help="default: the step benchmark's")
    args = parser.parse_args(argv)
    for option, value in DEFAULTS[args.model, args.device].items():
        if getattr(args, option, None) is None:
            setattr(args, option, value)
    args.steps = args.profiled
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    module = BenchLM(build_model(args), fsdp2=args.config == "fsdp2")
    probe = ProfileSteps(args.warmup, args.profiled, cuda, python=args.python)
    trainer = L.Trainer(accelerator=args.device, devices=1, strategy=_strategy(args.config, 1),
                        precision=args.precision, max_steps=args.warmup + args.profiled, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[probe])
    trainer.fit(module, _data(args, 1))
    print(f"== {args.model} {args.config} {args.precision} on {args.device}"
          f" (depth {args.depth}, width {args.width}, seq {args.seq}, batch {args.batch})")
    print(report(probe), flush=True)


if __name__ == "__main__":
    main()
