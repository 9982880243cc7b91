"""Tenants and admission at the edge: API keys, per-key token buckets, and the session
namespace that keeps two tenants' KV, placements and prefixes apart.

A tenant is named by a digest of its key (the key itself never reaches a replica, a log or a
header); a session key becomes `<tenant>/<session>` before it leaves the ingress, so the same
X-Session-ID from two keys is two sessions everywhere behind it.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from dataclasses import dataclass, field

from federation import openai_api as api

OPEN_TENANT = "open"  # the tenant of every request when no keys are configured


def tenant_of(key: str) -> str:
    return "t" + hashlib.sha256(key.encode()).hexdigest()[:16]


class Tenants:
    """The configured keys; `authenticate` maps a request's Authorization header to a tenant."""

    def __init__(self, keys: tuple[str, ...] | list[str]) -> None:
        self._keys = {k: tenant_of(k) for k in keys}

    @property
    def open(self) -> bool:
        return not self._keys

    def authenticate(self, authorization: str | None) -> str:
        """The caller's tenant, or APIError 401 (OpenAI's body) for a missing or wrong key."""
        if self.open:
            return OPEN_TENANT
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise api.APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
        given = given.strip()
        for key, tenant in self._keys.items():  # compare every key in constant time
            if hmac.compare_digest(key.encode(), given.encode()):
                return tenant
        raise api.APIError(401, "incorrect API key provided", code="invalid_api_key")


def namespaced(tenant: str, session: str) -> str:
    """The session key behind the ingress: the tenant's namespace, then the client's key."""
    return f"{tenant}/{session}"


@dataclass
class TokenBucket:
    """`rate` requests per second with bursts of `burst`; `take()` admits or says how long to wait."""

    rate: float
    burst: float
    tokens: float = field(init=False)
    stamp: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens, self.stamp = self.burst, time.monotonic()

    def take(self, now: float | None = None) -> float:
        """0.0 if admitted, else the seconds until one request would be."""
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class RateLimits:
    """One token bucket per tenant (off when rate is 0); over the limit → 429 + Retry-After."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, max(burst, 1.0)
        self._buckets: dict[str, TokenBucket] = {}

    def admit(self, tenant: str) -> None:
        if self.rate <= 0:
            return
        bucket = self._buckets.setdefault(tenant, TokenBucket(self.rate, self.burst))
        wait = bucket.take()
        if wait > 0:
            raise api.APIError(429, f"rate limit of {self.rate:g} requests/s for this key reached; "
                               f"retry in {wait:.1f}s", type_="rate_limit_exceeded",
                               code="rate_limited", headers={"Retry-After": str(math.ceil(wait))})
