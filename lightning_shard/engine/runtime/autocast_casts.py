"""Autocast's cast cache against the per-unit reduction.

Under ``torch.autocast`` torch caches the low-precision cast of each leaf parameter that requires grad until the
outermost autocast region exits, and a cast cached under ``no_grad`` carries an autograd node too (pytorch#165068). A
later forward with grad in the same region reuses that cast and its node, made before the unit's input watch node
(backward_watch.py). Autograd runs nodes newest first: that one runs after the watch node has fired, so the unit's
gradient lands after the unit was reduced (refused at the optimizer step as never reduced). It happens where
parameters are gathered in a dtype autocast casts from (``MixedPrecision()`` under ``bf16-mixed``, or ``32-true`` under
the user's own autocast) and a unit computed in the region before: a ``no_grad`` pass first (KTO's KL estimate through
the policy), or a forward and backward before (two ``manual_backward`` in one step). DDP is exact there: its reducer
hooks each parameter's gradient accumulation, whenever it runs.

A forward with grad drops the cache where it holds casts made before and no graph awaiting its backward can share
them: its casts are made afresh, inside the unit's call. Values and gradients are the same (one cast of the same
weights). A cast shared by two forwards of one backward (DDP's bf16 sum of both, then one cast) is never dropped: the
first forward's graph still awaits its backward."""

from __future__ import annotations

from typing import Optional

import torch


class AutocastCasts:
    def __init__(self, device_type: str) -> None:
        try:
            torch.is_autocast_enabled(device_type)
            self.device_type: Optional[str] = device_type
        except RuntimeError:  # a device autocast has no mode for ("meta"): nothing is ever cached
            self.device_type = None
        self.stale = False  # the cache may hold casts made outside any graph still to be backpropagated
        self.graph_pending = False  # a forward with grad ran since the last backward ended: its graph may share casts

    def before_forward(self) -> None:
        """At each unit's pre-forward."""
        if self.device_type is None or not (torch.is_autocast_enabled(self.device_type)
                                            and torch.is_autocast_cache_enabled()):
            return
        if not torch.is_grad_enabled():
            self.stale = True
            return
        if self.stale and not self.graph_pending:
            torch.clear_autocast_cache()
        self.stale, self.graph_pending = False, True

    def backward_ended(self) -> None:
        """The casts its graph made are older than any later forward's watch nodes."""
        self.stale, self.graph_pending = True, False
