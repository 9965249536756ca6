"""The executor: how the engine's steps reach its workers. The engine
builds each step's plan (step_plan.py) and hands it to its executor, which
runs it on every worker and returns the driver's logits (and prompt
logprobs, and the report of the tier copies: worker.Worker.execute).

* `LocalExecutor`: one worker, in this process;
* `tensor_parallel.TensorParallelExecutor`: N workers on torch.distributed,
  this process's worker being rank 0's; the others receive each plan as a
  tensor.

Both run the same `Worker`, by the same route: an engine knows its
executor only by these methods.
"""

from __future__ import annotations

import torch

from ..core.tiers import TierPlan, TierReport
from .step_plan import StepPlan
from .worker import PromptLogprobs, Worker


class LocalExecutor:
    world = 1
    closed = False  # (one process: nothing to stop)

    def __init__(self, worker: Worker):
        self.worker = worker

    def execute(self, plan: StepPlan) -> tuple[torch.Tensor, PromptLogprobs | None, TierReport | None]:
        return self.worker.execute(plan)

    def keep_accepted(self, accepted: dict[int, int]) -> None:
        """The drafts each sequence of the last plan kept (by its index)."""
        self.worker.keep_accepted(accepted)

    def copy_tiers(self, plan: TierPlan) -> TierReport | None:
        """Tier copies decided outside a step (a step that ran nothing, a
        flush, a reset): made now."""
        return self.worker.copy_tiers(plan)

    def watch(self, on_failure) -> None:
        """Call `on_failure(message)` if a worker process exits or hangs: in
        one process there is none to watch."""

    def close(self) -> None:
        pass
