"""OpenAI-compatible request bodies (pydantic, validated at the edge), response bodies, and the
one place where errors become OpenAI error bodies."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def from_event(cls, err) -> "APIError":
        """From a replica's ErrorEvent (replica/wire.py): its error kind mapped to a status."""
        status = STATUS_OF_CODE.get(err.code, 500)
        kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
        return cls(status, err.message, kind, err.param, err.code)


# the engine's error kinds (replica/errors.py codes) → HTTP status; anything else is our bug
STATUS_OF_CODE = {"invalid_request": 400, "context_length_exceeded": 400, "model_format_error": 400,
                  "model_not_found": 404, "cancelled": 499, "engine_dead": 503,
                  "insufficient_device_memory": 503, "internal_error": 500}


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are tolerated

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1
    session_id: str | None = None
    ignore_eos: bool = False

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and (len(v) > 4 or any(not s for s in v)):
            raise ValueError("stop: at most 4 non-empty strings")
        if v == "":
            raise ValueError("stop must not be empty")
        return v

    def params(self, max_tokens: int | None) -> dict:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {"max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "stop": stop, "ignore_eos": self.ignore_eos}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _content(self) -> "ChatRequest":
        for m in self.messages:
            m.text()
        return self

    def engine_messages(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]

    def session_key(self) -> str:
        """The conversation's identity: its system message and first user message."""
        system = next((m.text() for m in self.messages if m.role in ("system", "developer")), "")
        first = next((m.text() for m in self.messages if m.role == "user"), "")
        return "chat-" + hashlib.sha256(json.dumps([system, first]).encode()).hexdigest()[:24]


class CompletionRequest(_Sampling):
    prompt: str | list[int]

    @field_validator("prompt")
    @classmethod
    def _nonempty(cls, v):
        if not v:
            raise ValueError("prompt must not be empty")
        return v

    def session_key(self) -> str:
        """First 256 prompt tokens (token-id prompts) or first 1,024 characters (text prompts:
        the ingress does not tokenize)."""
        head = self.prompt[:256] if isinstance(self.prompt, list) else self.prompt[:1024]
        return "cmpl-" + hashlib.sha256(json.dumps(head).encode()).hexdigest()[:24]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"

    def texts(self) -> list[str]:
        texts = [self.input] if isinstance(self.input, str) else self.input
        if any(not t for t in texts):
            raise ValueError("input strings must not be empty")
        return texts


def encode_embedding(vector: list[float], encoding_format: str):
    """float: the list itself; base64: little-endian float32 bytes (what the openai client asks)."""
    if encoding_format == "float":
        return vector
    import base64
    import struct

    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic errors → (one clear message, the offending top-level param)."""
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x not in ("body",)]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return f"{where}: {first.get('msg', 'invalid value')}", param


# ---- responses ------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def chat_response(rid: str, model: str, text: str, reason: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": reason, "logprobs": None}], "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, reason: str | None = None,
               use: dict | None = None, choices: bool = True) -> str:
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk",
                            "created": int(time.time()), "model": model,
                            "choices": [{"index": 0, "delta": delta, "finish_reason": reason,
                                         "logprobs": None}] if choices else []}
    if use is not None:
        body["usage"] = use
    return f"data: {json.dumps(body)}\n\n"


def completion_response(rid: str, model: str, text: str, reason: str, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}],
            "usage": use}


def completion_chunk(rid: str, model: str, text: str, reason: str | None = None,
                     use: dict | None = None, choices: bool = True) -> str:
    body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": int(time.time()),
                            "model": model,
                            "choices": [{"index": 0, "text": text, "finish_reason": reason,
                                         "logprobs": None}] if choices else []}
    if use is not None:
        body["usage"] = use
    return f"data: {json.dumps(body)}\n\n"


def error_chunk(err: APIError) -> str:
    return f"data: {json.dumps(err.body())}\n\n"


DONE = "data: [DONE]\n\n"
