"""Typed errors raised inside the engine; the HTTP edge translates them once into OpenAI bodies."""


class FedserveError(Exception):
    """Base class. `status` is the HTTP status the edge maps it to; `param` names the bad field."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(FedserveError):
    """The request itself is wrong (empty prompt, bad sampling values, ...)."""

    status = 400
    code = "invalid_request"


class ContextLengthError(InvalidRequestError):
    """Prompt plus requested tokens do not fit the model's context."""

    code = "context_length_exceeded"


class UnknownModelError(FedserveError):
    """The model name is not one this engine (or federation) serves."""

    status = 404
    code = "model_not_found"


class ModelFormatError(FedserveError):
    """A model file is corrupt, truncated, or of a kind we do not read."""

    status = 400
    code = "model_format_error"


class EngineDeadError(FedserveError):
    """The engine's step loop has stopped; no request can be served by it."""

    status = 503
    code = "engine_dead"


class RequestCancelled(FedserveError):
    """The request was cancelled (client disconnect or abort) before it finished."""

    status = 499
    code = "cancelled"


class DeviceMemoryError(FedserveError):
    """The device has no room for a KV pool after the weights and the step's buffers."""

    status = 503
    code = "insufficient_device_memory"
