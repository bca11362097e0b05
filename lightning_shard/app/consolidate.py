"""``python -m lightning_shard.consolidate CKPT_DIR [OUT.ckpt]``: one full checkpoint file from a sharded one
(``lightning_shard.checkpoint.consolidate``), and the line that loads it in one process."""

from __future__ import annotations

import os
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
    source = Path(os.path.abspath(args.checkpoint_dir))  # absolute, not resolved: `.` has a name, last.ckpt stays
    out = Path(args.out) if args.out else default_out(source)
    _check_out(source, out)
    try:
        checkpoint = consolidate(source, out)
    except (files.CheckpointError, OSError, RuntimeError) as err:
        fail(PROG, str(err))
    n = sum(v.numel() for v in checkpoint["state_dict"].values())
    print(f"wrote {out}: {len(checkpoint['state_dict'])} tensors, {n:,} elements,"
          f" {len(checkpoint['optimizer_states'])} optimizer state(s)")
    print(f"load it in one process: YourLightningModule.load_from_checkpoint({str(out)!r})")
    return 0


def _check_out(source: Path, out: Path) -> None:
    """Never write over a directory (the checkpoint itself included) or into a folder that is not there."""
    if out.is_dir():
        fail(PROG, f"{str(out)!r} is a directory; OUT must be a file path (default: NAME.full.ckpt beside the"
                   f" checkpoint).")
    real_source, real_out = os.path.realpath(source), os.path.realpath(out)
    if real_out == real_source or real_out.startswith(real_source + os.sep):
        fail(PROG, f"OUT {str(out)!r} lies inside the checkpoint {str(source)!r}; write it elsewhere.")
    if not out.parent.is_dir():
        fail(PROG, f"the folder of OUT, {str(out.parent)!r}, does not exist.")
