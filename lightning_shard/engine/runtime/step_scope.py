"""A step is the root's scope: the root unit has no forward of its own in Lightning (``training_step`` is not
``forward``), so the strategy wraps each ``*_step`` in :meth:`StepScope.run_step`, and the root module's own forward
does the same when called outside a step. The root unit stays gathered from the start of a step until its backward
has finished, since backward begins with it. A step's start is where what the ranks agree on once a step is agreed
(the parameters they train, the buffers) and where the last step's leftovers are cleared.

Mixed into ShardRuntime (hooks.py): its units, schedule, reducer, elision, groups and step state."""

from __future__ import annotations

from typing import Any, Callable

import torch

from lightning_shard.engine.runtime.arguments import expects_backward, explain_mixed_dtype_on_cpu, in_backward
from lightning_shard.engine.runtime.backward_watch import refuse_unseen_gradients, watch_outputs


class StepScope:
    # a forward's output awaits its backward (a root call of ``model(model(x))``, of ``model(a) + model(b)``): the next
    # root call is no new step for the units' calls, whose backward is still to come
    _forward_awaits_backward = False

    def run_step(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one ``*_step`` as the root's scope (see the module note)."""
        self._steps_driven = True
        self._enter_step(step=True)
        output, failed = None, True
        try:
            output = step(*args, **kwargs)
            failed = False
            return output
        except RuntimeError as err:
            explain_mixed_dtype_on_cpu(err, self.units)
            raise
        finally:
            self._exit_step(output, failed)

    def _enter_step(self, step: bool) -> None:
        """``step``: a training/eval step every rank runs (``run_step``, or a root forward where no one calls
        ``run_step``), not a forward outside the steps (a callback's sample on rank 0): only a step runs the
        ranks' agreements (the trainable parameters, the buffers), which every rank must join."""
        if self._held and self._depth == 0:
            if torch.is_grad_enabled():
                raise RuntimeError(
                    "lightning_shard: a forward with gradients inside keep_gathered(): held units run no collective,"
                    " so their gradients would never be reduced. Leave keep_gathered() to train, or run this forward"
                    " under torch.no_grad() (evaluation, generation).")
            self._depth += 1
            return
        if self._depth == 0 and self._final_callback_queued and not in_backward():
            self._recover_from_failed_backward()
        if self._depth == 0 and not self._final_callback_queued:
            self._joined_by_all = step and self.groups.shard_size > 1  # every rank runs it: may agree at its end
            if not self.reducer.left_unreduced:
                refuse_unseen_gradients(self.units, self.reducer, "a step's start")
            # a previous step that ran no backward may have left units gathered: their data may be stale
            for unit in self.units:
                self.schedule.reshard(unit, keep_storage=self._backward_graph_kept)
                if self.restage_each_step:
                    unit.storage.shards_changed()  # offload: copied from the master again, whatever wrote it since
                if not self._forward_awaits_backward:
                    unit.forget_calls()
                    unit.read_outside = unit.returned_parameters = False
            for unit in self.units:
                self._follow_requires_grad(unit)
            if step and self.world_size > 1 and torch.is_grad_enabled():
                self.reducer.compare_trainable()  # (with whether work in the background failed on any rank)
            elif step and self.world_size == 1 and self.reducer.background is not None:
                if self.reducer.background.failed():  # one rank: nothing to agree on
                    self.reducer.background.raise_failure()
            if step and self.broadcast_buffers:
                if self._buffers_stale:
                    self.sync_buffers()
                # DDP's broadcast_buffers: the next step starts from rank 0's buffers if this one may change them
                self._buffers_stale = torch.is_grad_enabled() and self.reducer.sync_grads
            if torch.is_grad_enabled():
                self.figures.forward_since_step = True
            if self.root_unit is not None:
                self.schedule.gather(self.root_unit, exposed=True)
            self.schedule.start_forward()
            self.elision.start_forward()
        self._depth += 1

    def _exit_step(self, output: Any, failed: bool = False) -> None:
        """``failed``: the step is raising (on this rank only, maybe): nothing is agreed, the error goes on."""
        if self._depth == 0:  # its _enter_step raised (the root's forward hook runs even so)
            return
        self._depth -= 1
        if self._depth > 0 or self._held:
            return
        self.elision.end_forward()
        self.schedule.record_order()
        if self._final_callback_queued:
            return
        if not expects_backward(output):
            for unit in self.units:
                self.schedule.reshard(unit, keep_storage=self._backward_graph_kept)
            if self._joined_by_all and not failed:  # (a backward compares them as it ends)
                self.schedule.compare_issued(self.groups.agreements)
            return
        self._forward_awaits_backward = True
        if self.root_unit is not None:  # gathered again should a backward begin after one freed it (retain_graph)
            watch_outputs(output, lambda _: self._pre_backward(self.root_unit))
