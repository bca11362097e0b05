"""``python -m lightning_shard.consolidate CKPT_DIR [OUT.ckpt]``: one full checkpoint file from a sharded one
(``lightning_shard.checkpoint.consolidate``), and the line that loads it in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from lightning_shard.app.cli import ArgumentParser, fail
from lightning_shard.checkpoint import files
from lightning_shard.checkpoint.consolidate import consolidate, default_out

PROG = "python -m lightning_shard.consolidate"


def main(argv: Optional[list[str]] = None) -> int:
    parser = ArgumentParser(prog=PROG, description="Turn a sharded checkpoint directory into one ordinary"
                                                   " Lightning checkpoint file.")
    parser.add_argument("checkpoint_dir", help="a sharded checkpoint directory written by lightning_shard")
    parser.add_argument("out", nargs="?", help="the full checkpoint file to write (default: beside the directory,"
                                               " NAME.full.ckpt)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else default_out(args.checkpoint_dir)
    try:
        checkpoint = consolidate(args.checkpoint_dir, out)
    except (files.CheckpointError, FileNotFoundError) as err:
        fail(PROG, str(err))
    n = sum(v.numel() for v in checkpoint["state_dict"].values())
    print(f"wrote {out}: {len(checkpoint['state_dict'])} tensors, {n:,} elements,"
          f" {len(checkpoint['optimizer_states'])} optimizer state(s)")
    print(f"load it in one process: YourLightningModule.load_from_checkpoint({str(out)!r})")
    return 0
