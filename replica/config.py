"""Engine configuration: a frozen dataclass validated once; derived values are properties."""

from __future__ import annotations

from dataclasses import dataclass

from replica.errors import InvalidRequestError


@dataclass(frozen=True)
class EngineConfig:
    """How one replica's engine runs.

    model: "smollm2-135m" (the embedded GGUF), a .gguf path, a Hugging Face directory, or
    "synthetic:<preset>" (GPU benchmarks only).
    """

    model: str = "smollm2-135m"
    device: str = "cpu"
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int = 1 << 30  # KV pool size when num_kv_blocks is not given
    num_kv_blocks: int | None = None
    max_running_streams: int = 64  # 1 = serialized-decode mode
    max_batch_tokens: int = 256  # token budget of one step (decodes + prefill chunks)
    max_waiting_streams: int = 4096
    retain_sessions: bool = True  # keep a session's KV after its turn for the next one
    threads: int | None = None  # CPU threads for kernels (None: torch's setting)
    poison_freed_kv: bool = False  # debug/tests: NaN-fill blocks as they are freed

    def __post_init__(self) -> None:
        checks = {
            "block_size": self.block_size >= 1,
            "kv_cache_bytes": self.kv_cache_bytes > 0,
            "num_kv_blocks": self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            "max_running_streams": self.max_running_streams >= 1,
            "max_batch_tokens": self.max_batch_tokens >= 1,
            "max_waiting_streams": self.max_waiting_streams >= 0,
            "threads": self.threads is None or self.threads >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise InvalidRequestError(f"EngineConfig.{name}={getattr(self, name)!r} is invalid",
                                          param=name)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise InvalidRequestError(f"unknown device {self.device!r}", param="device")

    @property
    def serialized(self) -> bool:
        """The old mitigation: one stream decodes at a time."""
        return self.max_running_streams == 1
