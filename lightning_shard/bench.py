"""``python -m lightning_shard.bench [--device cuda]``: the step-time benchmark (``lightning_shard.tools.bench``)."""

import sys

from lightning_shard.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
