"""``python -m lightning_shard.train [Hydra overrides]``: the Hydra training app (``lightning_shard.app.train``)."""

from lightning_shard.app.train import main

if __name__ == "__main__":
    main()  # Hydra's main returns the job's metric, which is not an exit status
