"""``python -m lightning_shard.estimate [Hydra overrides]``: one rank's memory peak (``lightning_shard.app.estimate``)."""

from lightning_shard.app.estimate import main

if __name__ == "__main__":
    main()
