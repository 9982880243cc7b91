"""The engine on one machine: model, paged KV pool, scheduler, sampler, Serve replica."""

from replica.config import EngineConfig
from replica.engine import Engine
from replica.errors import (ContextLengthError, EngineDeadError, FedserveError,
                            InvalidRequestError, ModelFormatError, UnknownModelError)
from replica.request import Request, RequestOutput, StreamEvent
from replica.sampling import SamplingParams

__all__ = [
    "ContextLengthError", "Engine", "EngineConfig", "EngineDeadError", "FedserveError",
    "InvalidRequestError", "ModelFormatError", "Request", "RequestOutput", "SamplingParams",
    "StreamEvent", "UnknownModelError",
]
