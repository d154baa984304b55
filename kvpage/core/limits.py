"""What a request can never do here: the step limits, one rule each, and the sentences that say so.

`width_limit` is the one rule for how many sequences of one request may run at once (they decode in
the same step): the engine checks it before a request enters (naming the user's parameter), the
scheduler again for requests that reach it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.core.request import Request
from kvpage.errors import ParameterError


@dataclass(frozen=True, slots=True)
class StepLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def width_limit(self, width: int) -> tuple[str, int] | None:
        """(name, value) of the limit that `width` sequences decoding in one step exceed, if any."""
        for name, limit in (
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
        ):
            if width > limit:
                return name, limit
        return None

    def check_width(self, name: str, width: int) -> None:
        """ParameterError (naming `name`) unless `width` sequences of one request can run in the same step."""
        broken = self.width_limit(width)
        if broken is not None:
            limit_name, limit = broken
            raise ParameterError(
                name, f"{name}={width}: its {width} sequences run in the same step, but {limit_name}={limit}"
            )

    def unschedulable(self, req: Request) -> str | None:
        """Why `req` can never be scheduled (too long, too wide), or None."""
        n = len(req.prompt_token_ids)
        if n > self.max_model_len and not req.unbounded:
            return f"the prompt has {n} tokens, more than max_model_len={self.max_model_len}"
        if req.plan.copies_kv and req.eviction.evicts:
            return f"a prompt of segments cannot go with the eviction policy {req.eviction.describe()}"
        broken = self.width_limit(req.width)
        if broken is None:
            return None
        name, limit = broken
        if name == "max_num_seqs":
            return f"it runs {req.width} sequences at once, more than max_num_seqs={limit}"
        return f"its {req.width} sequences decode together, more tokens than max_num_batched_tokens={limit}"


def never_fits(req: Request, need: int, free: int, total: int, block_size: int) -> str:
    """A running request that needs `need` more blocks with nothing else left to preempt."""
    k = len(req.resident_sequences)
    return (
        f"request {req.request_id!r} can never fit: its {k} sequence{'s' * (k > 1)} need {need} more "
        f"block{'s' * (need > 1)} to go on, but only {free} are free with nothing else "
        f"running (the cache holds {total} blocks of {block_size} tokens)"
    )
