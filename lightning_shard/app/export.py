"""``python -m lightning_shard.export CKPT OUT_FOLDER``: a checkpoint (sharded directory or full file) as a Hugging
Face folder that ``from_pretrained`` loads (``lightning_shard.checkpoint.export_checkpoint``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from lightning_shard.app.cli import ArgumentParser, fail
from lightning_shard.checkpoint import files
from lightning_shard.checkpoint.export_checkpoint import export_checkpoint
from lightning_shard.checkpoint.safetensors_writer import parse_size

PROG = "python -m lightning_shard.export"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: Optional[list[str]] = None) -> int:
    parser = ArgumentParser(prog=PROG, description="Write a checkpoint's model as a Hugging Face folder (safetensors"
                            " files, their index, config.json; a peft model's adapter), reading a file's worth of"
                            " weights at a time.")
    parser.add_argument("checkpoint", help="a checkpoint written by lightning_shard (sharded directory or full file),"
                                           " or another strategy's full checkpoint with --model-config")
    parser.add_argument("out", help="the folder to write (replaced if it exists)")
    parser.add_argument("--model-config", help="a transformers config.json, or a folder holding one: written into OUT"
                                               " and used to find the model's weights in the checkpoint")
    parser.add_argument("--prefix", help="where the model sits in the LightningModule, e.g. 'model.' (default: the"
                                         " checkpoint's record, or found from --model-config)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="the files' floating dtype (default: as saved)")
    parser.add_argument("--max-shard-size", default="5GB", help="bytes per file, e.g. 5GB or 500MiB (default 5GB)")
    args = parser.parse_args(argv)
    source, out = Path(os.path.abspath(args.checkpoint)), Path(os.path.abspath(args.out))
    if not source.exists():
        fail(PROG, f"the checkpoint {str(source)!r} does not exist.")
    if out == source or str(out).startswith(str(source) + os.sep) or str(source).startswith(str(out) + os.sep):
        fail(PROG, f"OUT {str(out)!r} and the checkpoint {str(source)!r} overlap; write it elsewhere.")
    if not out.parent.is_dir():
        fail(PROG, f"the folder of OUT, {str(out.parent)!r}, does not exist.")
    try:
        parse_size(args.max_shard_size)
        export_checkpoint(source, out, model_config=args.model_config, prefix=args.prefix,
                          dtype=DTYPES.get(args.dtype), max_shard_size=args.max_shard_size)
    except (files.CheckpointError, OSError, ValueError, ImportError) as err:
        fail(PROG, str(err))
    written = sorted(p.name for p in out.iterdir())
    print(f"wrote {out}: {', '.join(written)}")
    if "config.json" not in written and "adapter_config.json" not in written:
        print("no config.json: the checkpoint has no record of a Hugging Face model (not saved by ShardStrategy, or"
              " its module held none): the names are the checkpoint's own; give --model-config to write one and find"
              " the model's names, or --prefix to strip the LightningModule's")
    if "adapter_config.json" in written:
        print(f"load it: PeftModel.from_pretrained(base_model, {str(out)!r})")
    elif "config.json" in written:
        architecture = (json.loads((out / "config.json").read_text()).get("architectures") or ["AutoModel"])[0]
        print(f"load it: transformers.{architecture}.from_pretrained({str(out)!r})")
    return 0
