"""The federation's one configuration model; the Serve config YAML (cluster/*.yaml) feeds it
through `build_app(args)`, and `fedserve up` builds it from flags."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


CPU_KV_CACHE_BYTES = 1 << 29  # a CPU replica's KV pool unless kv_cache_bytes is given


class FederationConfig(BaseModel):
    """How the federation is laid out and how it admits and routes requests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "smollm2-135m"
    served_model_name: str | None = None  # the name clients use (default: `model`)
    num_replicas: int = Field(2, ge=1)
    one_replica_per_node: bool = True  # max_replicas_per_node=1 (off for one-node tests/`up`)
    replica_num_cpus: float = Field(0.5, gt=0)
    replica_num_gpus: float = Field(0, ge=0)
    ingress_num_cpus: float = Field(0.1, gt=0)
    device: str = "cpu"
    max_running_streams: int = Field(32, ge=1)  # per replica; 1 = serialized-decode mode
    max_batch_tokens: int | None = Field(None, ge=1)  # None: the engine's per-device default
    kv_cache_bytes: int | None = Field(None, gt=0)  # None: CPU 512 MiB; CUDA sized from the
    # device (gpu_memory_utilization of the memory free after the weights)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    max_queued_requests: int = Field(64, ge=0)  # beyond capacity; then 429
    router_policy: Literal["sticky", "round_robin"] = "sticky"
    max_failovers: int = Field(3, ge=0)  # resubmissions of one request after replica deaths
    retry_after_s: int = Field(1, ge=1)
    max_body_bytes: int = Field(4 << 20, ge=1024)
    routing_stats_period_s: float = Field(1.0, gt=0)
    # tenancy and admission (federation/tenancy.py): no keys = one open tenant (loopback only)
    api_keys: tuple[str, ...] = ()
    rate_limit_rps: float = Field(0.0, ge=0)  # per key; 0 = off
    rate_limit_burst: float = Field(0.0, ge=0)  # 0: max(1, 2 × rate)
    max_messages: int = Field(512, ge=1)  # messages in one chat request
    max_completion_tokens: int = Field(16384, ge=1)  # max_tokens of one request

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(len(k.strip()) < 8 or k != k.strip() for k in v):
            raise ValueError("API keys must be at least 8 characters, without surrounding spaces")
        return v

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def engine_kwargs(self) -> dict:
        """EngineConfig fields for each replica."""
        kv_bytes = self.kv_cache_bytes
        if kv_bytes is None and self.device == "cpu":
            kv_bytes = CPU_KV_CACHE_BYTES
        return {"model": self.model, "device": self.device,
                "max_running_streams": self.max_running_streams,
                "max_batch_tokens": self.max_batch_tokens, "kv_cache_bytes": kv_bytes,
                "gpu_memory_utilization": self.gpu_memory_utilization}


def env_api_keys(environ: dict[str, str]) -> tuple[str, ...]:
    """FEDSERVE_API_KEYS: comma-separated keys (the one place the environment is read for them)."""
    return tuple(k.strip() for k in environ.get("FEDSERVE_API_KEYS", "").split(",") if k.strip())


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_exposure(host: str, cfg: FederationConfig) -> None:
    """An open federation (no API keys) may listen on loopback only."""
    if not cfg.api_keys and host not in LOOPBACK and not host.startswith("127."):
        raise ValueError(f"refusing to serve on {host} without API keys: pass --api-key "
                         "(or FEDSERVE_API_KEYS), or listen on 127.0.0.1")
