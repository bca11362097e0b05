"""``python -m lightning_shard.consolidate CKPT_DIR [OUT.ckpt]``: one full checkpoint file from a sharded one
(``lightning_shard.app.consolidate``)."""

import sys

from lightning_shard.app.consolidate import main

if __name__ == "__main__":
    sys.exit(main())
