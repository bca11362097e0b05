"""Saving and loading sharded models: full and sharded state, files and integrity, consolidation, pretrained
weights. Built on the engine; no Lightning import (the strategy hands in Lightning's ``CheckpointIO``)."""
