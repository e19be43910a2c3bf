-- renew: extend the caller's lease; only the current owner with the current lease version,
-- and only before expiry (Redis server time).
--
-- KEYS[1]  thread meta hash  ratchet:lg:{<T>}:meta
--
-- ARGV[1]  owner id (text)
-- ARGV[2]  lease version the caller holds (integer)
-- ARGV[3]  ttl (integer milliseconds, > 0)
--
-- Replies:
--   {"renewed", lease_version, expires_at_ms, now_ms}
--   {"lease_lost", owner, lease_version, expires_at_ms, now_ms}
--   {"lease_expired", owner, lease_version, expires_at_ms, now_ms}
--
-- Time: *_ms values are Redis server time, milliseconds since the epoch.

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local m = redis.call('HMGET', KEYS[1], 'owner', 'lease_version', 'expires_at_ms')
local owner = m[1] or ''
local version = tonumber(m[2] or '0')
local expires = tonumber(m[3] or '0')
if owner ~= ARGV[1] or version ~= tonumber(ARGV[2]) then
  return {'lease_lost', owner, version, expires, now_ms}
end
if now_ms >= expires then
  return {'lease_expired', owner, version, expires, now_ms}
end
expires = now_ms + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'expires_at_ms', expires)
return {'renewed', version, expires, now_ms}
