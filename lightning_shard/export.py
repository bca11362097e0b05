"""``python -m lightning_shard.export CKPT OUT_FOLDER``: a checkpoint as a Hugging Face folder
(``lightning_shard.app.export``)."""

import sys

from lightning_shard.app.export import main

if __name__ == "__main__":
    sys.exit(main())
