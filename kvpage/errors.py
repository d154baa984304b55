"""Typed errors that carry what they are about, so callers never read meaning out of a message."""

from __future__ import annotations


class ParameterError(ValueError):
    """A request parameter is invalid; `param` names the field (the OpenAI error's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class TensorParallelFailure(RuntimeError):
    """A rank of the tensor-parallel group died, or a step failed partway on some ranks: the ranks are
    no longer in step, so the engine cannot go on (kvpage/distributed)."""
