"""A unit: modules whose parameters are gathered, freed and reduced together, and its state during a step."""

from __future__ import annotations

from typing import Optional

from torch import nn

from lightning_shard.engine.comm.collectives import Pending
from lightning_shard.engine.storage.flat_shard import FlatShard


class Unit:
    def __init__(self, name: str, members: list[nn.Module], storage: FlatShard, reshard_after_forward: bool):
        self.name = name
        self.index = -1  # its place among the model's units, the same on every rank (shard_module sets it)
        self.members = members
        self.storage = storage
        self.reshard_after_forward = reshard_after_forward
        self.is_gathered = False  # gathered data valid and registered on the members
        # its gathered copy may have been written by code other than its backward since it was gathered (gather.py:
        # written back to the shard when freed), and the shard's version counter then
        self.writable, self.gathered_version = False, -1
        self.inflight: Optional[Pending] = None  # a prefetch all-gather not yet waited for
        self.launched_version = -1  # the shard's version counter when its last all-gather was issued
        self.backward_pending = 0  # forward calls whose post-backward has not fired yet in this backward
        # a call under grad with no input needing grad (raw data into a first block): its backward cannot be seen
        # ending, so the unit is reduced at the end of backward, not when its other calls' backward ends
        self.unseen_backward = False
        # the same for the forward calls since the last backward: what a next backward through their graph
        # (retain_graph) waits for again, until a new forward call (rearmed: a backward ended since)
        self.calls_watched, self.call_unwatched, self.rearmed = 0, False, False
        self.watches_backward_end = True  # its backward's end is seen as it happens, not at the end of backward
        self.saved_for_backward = True  # autograd saved its gathered parameters in this step's forward
        self.call_began = -1  # autograd's sequence number when its last forward call began (after its input hooks)
        self.parameters_watched = False  # its gathered parameters' gradients say that a backward began (unit_hooks.py)
        self.checkpointed = False  # a module reading its parameters is recomputed in backward
        # this step, code outside the unit computed with its gathered parameters (read them: kept gathered to the end
        # of backward), or got a copy of one it returned; either way reduced at the end of backward (outside.py)
        self.read_outside = self.returned_parameters = False

    def forget_calls(self) -> None:
        """A new step (or a failed backward): no forward call waits for its backward."""
        self.backward_pending = self.calls_watched = 0
        self.unseen_backward = self.call_unwatched = self.rearmed = False

    def await_calls_again(self) -> None:
        """A backward ended: one more through the same graph (``retain_graph``) waits for the same calls' backward."""
        self.backward_pending, self.unseen_backward = self.calls_watched, self.call_unwatched
        self.rearmed = True

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, numel={self.storage.padded_numel})"
