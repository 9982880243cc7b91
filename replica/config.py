"""Engine configuration: a frozen dataclass validated once; derived values are properties."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replica.errors import InvalidRequestError

CPU_KV_CACHE_BYTES = 1 << 30  # the CPU pool when neither num_kv_blocks nor kv_cache_bytes is given
CPU_BATCH_TOKENS, CUDA_BATCH_TOKENS = 256, 8192  # a step's token budget by default (batch_tokens)
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    """How one replica's engine runs.

    model: "smollm2-135m" (the embedded GGUF), a .gguf path, a Hugging Face directory, or
    "synthetic:<preset>" (GPU benchmarks only).
    """

    model: str = "smollm2-135m"
    device: str = "cpu"
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int | None = None  # KV pool size when num_kv_blocks is not given; None:
    # on CUDA gpu_memory_utilization of the memory free after weights, on CPU CPU_KV_CACHE_BYTES
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9  # CUDA: the share of free memory the KV pool and the
    # step's buffers may take (the pool gets that minus the measured activation peak)
    kv_dtype: str | None = None  # "float32" | "bfloat16"; None: bfloat16 on CUDA, float32 on CPU
    fast_prefill: bool | None = None  # prompt tokens past kernels.prefill.MIN_POSITION attend
    # through tiled attention (kernels/prefill.py); None: on CUDA only
    max_running_streams: int = 64  # 1 = serialized-decode mode
    max_batch_tokens: int | None = None  # token budget of one step (decodes + prefill chunks);
    # None: 256 on CPU, 8192 on CUDA (see batch_tokens)
    max_waiting_streams: int = 4096
    retain_sessions: bool = True  # keep a session's KV after its turn for the next one
    threads: int | None = None  # CPU threads for kernels (None: torch's setting)
    poison_freed_kv: bool = False  # debug/tests: NaN-fill blocks as they are freed
    overlap_events: bool | None = None  # detokenize and deliver a step's token events while the
    # next step runs on the device (EngineCore.step); None: on CUDA only
    lookahead: bool | None = None  # launch a decode step before the step before it has
    # returned its tokens to the host, its tokens fed on the device (greedy streams only;
    # EngineCore.step); None: on CUDA only

    def __post_init__(self) -> None:
        checks = {
            "block_size": self.block_size >= 1,
            "kv_cache_bytes": self.kv_cache_bytes is None or self.kv_cache_bytes > 0,
            "gpu_memory_utilization": 0.0 < self.gpu_memory_utilization <= 1.0,
            "kv_dtype": self.kv_dtype is None or self.kv_dtype in KV_DTYPES,
            "num_kv_blocks": self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            "max_running_streams": self.max_running_streams >= 1,
            "max_batch_tokens": self.max_batch_tokens is None or self.max_batch_tokens >= 1,
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
    def batch_tokens(self) -> int:
        """The step's token budget. On a GPU a step's weights are read once however many tokens
        it carries, and prefill-sized steps dequantize each weight once per step
        (kernels/triton_f16.py): 8192 prefilled 8 x 6,581-token prompts at 24.2K tok/s on the
        H200 against 21.6K with 4096 (GPU_NOTES v10), at the price of a longer pause for the
        streams decoding during a long prefill. On CPU a step's time grows with its tokens, and
        256 keeps running streams' inter-token latency low while prompts are chunked in."""
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        return CPU_BATCH_TOKENS if self.device == "cpu" else CUDA_BATCH_TOKENS

    @property
    def cuda(self) -> bool:
        return self.device != "cpu"

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV pool's element type: bf16 on CUDA (half the bytes a decode step reads),
        fp32 on CPU (the C kernels read fp32)."""
        if self.kv_dtype is not None:
            return KV_DTYPES[self.kv_dtype]
        return torch.bfloat16 if self.cuda else torch.float32

    @property
    def use_fast_prefill(self) -> bool:
        return self.cuda if self.fast_prefill is None else self.fast_prefill

    @property
    def use_overlap_events(self) -> bool:
        return self.cuda if self.overlap_events is None else self.overlap_events

    @property
    def use_lookahead(self) -> bool:
        return self.cuda if self.lookahead is None else self.lookahead

    @property
    def serialized(self) -> bool:
        """The old mitigation: one stream decodes at a time."""
        return self.max_running_streams == 1
