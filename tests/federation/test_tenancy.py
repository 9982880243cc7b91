"""Tenancy and admission at the edge, without Ray: keys → tenants, session namespaces, token
buckets, the loopback-only rule for an open federation, and the config's key rules."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from federation import openai_api as api
from federation.config import FederationConfig, check_exposure, env_api_keys
from federation.tenancy import OPEN_TENANT, RateLimits, Tenants, TokenBucket, namespaced, tenant_of

KEY_A, KEY_B = "sk-tenant-a-0001", "sk-tenant-b-0002"


def test_no_keys_is_one_open_tenant():
    t = Tenants(())
    assert t.open and t.authenticate(None) == OPEN_TENANT == t.authenticate("Bearer anything")


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic " + KEY_A, KEY_A,
                                    "Bearer sk-tenant-a-0003", "Bearer " + KEY_A + "x"])
def test_a_missing_or_wrong_key_is_401_with_an_openai_body(header):
    with pytest.raises(api.APIError) as e:
        Tenants((KEY_A, KEY_B)).authenticate(header)
    assert e.value.status == 401 and e.value.code == "invalid_api_key"
    assert e.value.body()["error"]["message"] and KEY_A not in e.value.message


def test_each_key_is_its_own_tenant_and_namespace():
    t = Tenants((KEY_A, KEY_B))
    a, b = t.authenticate("Bearer " + KEY_A), t.authenticate("bearer " + KEY_B)
    assert a == tenant_of(KEY_A) != b == tenant_of(KEY_B)
    assert KEY_A not in a  # the key itself never travels
    assert namespaced(a, "chat-1") != namespaced(b, "chat-1")
    assert namespaced(a, "x/y") != namespaced(tenant_of("sk-tenant-a-0001x"), "y")


def test_token_bucket_admits_a_burst_then_paces():
    b = TokenBucket(rate=2.0, burst=3.0)
    t0 = b.stamp
    assert [b.take(t0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(t0) == pytest.approx(0.5)  # one token every 1/rate s
    assert b.take(t0 + 0.5) == 0.0
    assert b.take(t0 + 0.5) == pytest.approx(0.5)
    assert b.take(t0 + 100) == 0.0 and b.tokens == pytest.approx(2.0)  # capped at the burst


def test_rate_limits_are_per_tenant_with_retry_after():
    limits = RateLimits(rate=1.0, burst=2.0)
    limits.admit("a")
    limits.admit("a")
    with pytest.raises(api.APIError) as e:
        limits.admit("a")
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
    limits.admit("b")  # another tenant's bucket is untouched
    RateLimits(rate=0, burst=0).admit("a")  # 0 = off


def test_an_open_federation_listens_on_loopback_only():
    open_cfg, keyed = FederationConfig(), FederationConfig(api_keys=(KEY_A,))
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_exposure(host, open_cfg)
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        with pytest.raises(ValueError, match="without API keys"):
            check_exposure(host, open_cfg)
        check_exposure(host, keyed)


def test_keys_from_the_environment_and_their_rules():
    assert env_api_keys({"FEDSERVE_API_KEYS": f" {KEY_A}, {KEY_B} ,"}) == (KEY_A, KEY_B)
    assert env_api_keys({}) == ()
    for bad in (("short",), (" " + KEY_A,)):
        with pytest.raises(ValidationError):
            FederationConfig(api_keys=bad)
