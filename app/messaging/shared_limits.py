"""Per-tenant limits kept in Redis, so that every API process on every host counts against one figure.

Each limit is one Lua script: Redis runs a script atomically, so two processes that check and take
at the same moment cannot both take the last token or slot. Every script reads Redis' own clock
(TIME), never the caller's: hosts whose clocks disagree still share one bucket.

- the request rate: a token bucket per tenant (a hash: tokens, at);
- open event streams: a sorted set per tenant, one member per open stream, scored by when its
  lease ends. A process renews the leases of its streams while they are open (``renew``), so the
  slots of a process that died free themselves within one lease;
- refusals: per tenant, when its last 429 told it to come back.
"""

from __future__ import annotations

import redis.asyncio

KEY_PREFIX = "muonforge:limits"
TIMEOUT = 0.25  # seconds: a Redis that does not answer within this is treated as down
# Redis connections an API process may use for its limits; past them a check waits for one (up
# to POOL_WAIT seconds) rather than fail: a burst of requests is not a Redis outage.
MAX_CONNECTIONS, POOL_WAIT = 100, 5.0

TOKEN_BUCKET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local held = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(held[1]) or burst
local at = tonumber(held[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local wait = 0
if tokens < 1 then wait = (1 - tokens) / rate else tokens = tokens - 1 end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return tostring(wait)
"""

TAKE_SLOT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local cap, lease = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= cap then return 0 end
redis.call('ZADD', KEYS[1], now + lease, ARGV[3])
redis.call('PEXPIRE', KEYS[1], math.ceil(lease * 1000))
return 1
"""

RENEW_SLOTS = """
local t = redis.call('TIME')
local until_ = tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', until_, ARGV[i + 1])
  redis.call('PEXPIRE', key, math.ceil(tonumber(ARGV[1]) * 1000))
end
return #KEYS
"""

TELL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local retry_after = tonumber(ARGV[1])
local told = tonumber(redis.call('GET', KEYS[1]))
redis.call('SET', KEYS[1], tostring(now + retry_after), 'PX', math.ceil(retry_after * 1000) + 1)
if told and now < told then return 1 end
return 0
"""


def key(kind: str, tenant_id: str) -> str:
    return f"{KEY_PREFIX}:{kind}:{tenant_id}"


class SharedLimits:
    """The scripts above on one Redis, for the coroutines of one API process."""

    def __init__(self, url: str) -> None:
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            url,
            socket_timeout=TIMEOUT,
            socket_connect_timeout=TIMEOUT,
            max_connections=MAX_CONNECTIONS,
            timeout=POOL_WAIT,
        )
        self._client = redis.asyncio.Redis(connection_pool=pool)
        self._bucket = self._client.register_script(TOKEN_BUCKET)
        self._take_slot = self._client.register_script(TAKE_SLOT)
        self._renew = self._client.register_script(RENEW_SLOTS)
        self._tell = self._client.register_script(TELL)

    async def take_token(self, tenant_id: str, rate: float, burst: int) -> float:
        """0 if the tenant's request took a token, else the seconds until its next token."""
        return float(await self._bucket(keys=[key("rate", tenant_id)], args=[rate, burst]))

    async def take_slot(self, tenant_id: str, slot: str, cap: int, lease: float) -> bool:
        """Whether ``slot`` (a stream) got one of the tenant's ``cap`` slots, held for ``lease`` seconds."""
        return bool(await self._take_slot(keys=[key("streams", tenant_id)], args=[cap, lease, slot]))

    async def renew(self, slots: list[tuple[str, str]], lease: float) -> None:
        """Hold the slots, (tenant, slot), ``lease`` seconds more from now."""
        if slots:
            keys = [key("streams", tenant_id) for tenant_id, _ in slots]
            await self._renew(keys=keys, args=[lease, *(slot for _, slot in slots)])

    async def free_slot(self, tenant_id: str, slot: str) -> None:
        await self._client.zrem(key("streams", tenant_id), slot)

    async def tell(self, tenant_id: str, retry_after: float) -> bool:
        """Record a refusal that says ``Retry-After: retry_after``; whether it came before the time
        the tenant's previous refusal told it to wait for."""
        return bool(await self._tell(keys=[key("told", tenant_id)], args=[retry_after]))

    async def close(self) -> None:
        await self._client.aclose(close_connection_pool=True)
