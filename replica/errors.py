"""Typed errors raised inside the engine; the HTTP edge translates them once into OpenAI bodies."""


class FedserveError(Exception):
    """Base class. `code` names the kind (the HTTP edge maps it to a status: federation/openai_api.py
    STATUS_OF_CODE); `param` names the bad field."""

    code = "internal_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(FedserveError):
    """The request itself is wrong (empty prompt, bad sampling values, ...)."""

    code = "invalid_request"


class ContextLengthError(InvalidRequestError):
    """Prompt plus requested tokens do not fit the model's context."""

    code = "context_length_exceeded"


class UnknownModelError(FedserveError):
    """The model name is not one this engine (or federation) serves."""

    code = "model_not_found"


class ModelFormatError(FedserveError):
    """A model file is corrupt, truncated, or of a kind we do not read."""

    code = "model_format_error"


class EngineDeadError(FedserveError):
    """The engine's step loop has stopped; no request can be served by it."""

    code = "engine_dead"


class RequestCancelled(FedserveError):
    """The request was cancelled (client disconnect or abort) before it finished."""

    code = "cancelled"


class DeviceMemoryError(FedserveError):
    """The device has no room for a KV pool after the weights and the step's buffers."""

    code = "insufficient_device_memory"
