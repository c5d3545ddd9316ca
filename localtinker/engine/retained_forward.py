"""A ``forward``'s autograd graph kept for the ``forward_backward`` that follows it on the same datums.

The SDK's ``forward_backward_custom`` (DPO, any client-side custom loss) runs ``forward`` for the
logprobs, differentiates the custom loss on the client, then sends the same datums to
``forward_backward`` with ``weights = −dC/dlogprobs`` under ``cross_entropy``. Recomputing that forward
is a third of the work: a DPO step cost 1.47 × an SFT step on the same tokens. Kept here instead, the
second call only runs the backward, through exactly the graph that produced the logprobs the client saw.

Exact by construction: the second call is served from the kept graph only when its datums have the
same tokens and targets, the weights have not changed (no ``optim_step``, no reload) and every token
its loss can move was tracked by the forward (the forward tracks the tokens its own ``weights`` mark,
all of them when it marks none; the SDK's custom-loss forward sends the datums' weights). Anything
else drops the graph and runs the call as usual.

Costs: the kept micro-batches run with autograd, and their graphs hold their activations at once
until the next call (~1.2 MB per token on SmolLM2-135M). So a forward keeps its micro-batches while
fewer than the engine's ``RETAINED_FORWARD_TOKENS`` are kept (checked before each: at most one
micro-batch over, and one micro-batch is what a ``forward_backward`` holds anyway); the rest run
without a graph and their datums' forward runs again in the backward call. One per engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localtinker.engine.datums import PreparedDatum
from localtinker.engine.losses import gradient_tokens


@dataclass
class LogprobBatch:
    """One micro-batch's token logprobs (with their graph when kept) and which rows have a graph."""

    datum_rows: dict[int, torch.Tensor]  # datum index -> its rows in ``logprobs``
    logprobs: torch.Tensor  # [rows]
    tracked: torch.Tensor  # bool [rows]


@dataclass
class RetainedForward:
    model_id: str
    version: int  # the model's weights version when the forward ran
    tokens: list[torch.Tensor]
    targets: list[torch.Tensor]
    batches: list[LogprobBatch]  # the kept micro-batches, with their graphs
    recompute: list[int]  # datums in no kept micro-batch: the backward call runs their forward again

    def serves(self, model_id: str, version: int, datums: list[PreparedDatum], loss_fn: str,
               config: dict[str, float]) -> bool:
        """True when ``loss_fn`` on ``datums`` can back-propagate through this graph with the same result."""
        if model_id != self.model_id or version != self.version or len(datums) != len(self.tokens):
            return False
        if not all(torch.equal(d.tokens, t) and torch.equal(d.targets, y)
                   for d, t, y in zip(datums, self.tokens, self.targets)):
            return False
        for batch in self.batches:
            for index, rows in batch.datum_rows.items():
                moved = gradient_tokens(loss_fn, datums[index].loss_inputs, config)
                if bool((moved & ~batch.tracked[rows]).any()):
                    return False
        return True


def forward_tracking(datum: PreparedDatum) -> torch.Tensor:
    """bool [T]: the tokens a kept forward tracks — those its ``weights`` mark, or all when it marks none."""
    weights = datum.loss_inputs.get("weights")
    if weights is None or not bool((weights != 0).any()):
        return torch.ones_like(datum.targets, dtype=torch.bool)
    return weights != 0
