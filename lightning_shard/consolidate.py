"""``python -m lightning_shard.consolidate CKPT_DIR OUT``: one full checkpoint file from a sharded one
(``lightning_shard.checkpoint.consolidate``)."""

import sys

from lightning_shard.checkpoint.consolidate import main

if __name__ == "__main__":
    sys.exit(main())
