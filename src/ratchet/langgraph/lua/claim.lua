-- claim: take a thread's lease if it is free, expired, or already the caller's.
--
-- Free or expired (or held by the same owner id) means: owner = caller,
-- lease_version = max(lease_version + 1, now_ms), expires_at = now + ttl. The version
-- only grows (it survives releases and thread deletion), so every new holder fences out
-- every earlier one, including an earlier incarnation of the caller. The store's time as a
-- floor keeps that true across a rewound store (see acquire_lease.lua). Expiry is judged
-- by Redis server time.
--
-- KEYS[1]  thread meta hash  ratchet:lg:{<T>}:meta
--
-- ARGV[1]  thread id (text, kept in meta for operators)
-- ARGV[2]  owner id (text, non-empty)
-- ARGV[3]  ttl (integer milliseconds, > 0)
--
-- Replies:
--   {"acquired", lease_version, expires_at_ms, now_ms, generation}
--   {"held", owner, lease_version, expires_at_ms, now_ms}
--
-- Time: *_ms values are Redis server time, milliseconds since the epoch.

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local m = redis.call('HMGET', KEYS[1], 'owner', 'lease_version', 'expires_at_ms', 'generation')
local owner = m[1] or ''
local version = tonumber(m[2] or '0')
local expires = tonumber(m[3] or '0')
if owner ~= '' and owner ~= ARGV[2] and now_ms < expires then
  return {'held', owner, version, expires, now_ms}
end
version = math.max(version + 1, now_ms)
expires = now_ms + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'thread_id', ARGV[1], 'owner', ARGV[2], 'lease_version', version,
  'expires_at_ms', expires, 'acquired_at_ms', now_ms)
return {'acquired', version, expires, now_ms, tonumber(m[4] or '0')}
