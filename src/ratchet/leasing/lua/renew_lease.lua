-- renew_lease: extend the caller's lease; only the current owner with the current lease
-- version may renew, and only before the lease has expired (Redis server time).
-- One script for every lease ratchet keeps: a run's and a LangGraph thread's (whose lease
-- fields live in its meta hash).
--
-- KEYS[1]  lease hash  ratchet:{<run>}:lease, or a thread's ratchet:lg:{<T>}:meta
-- KEYS[2]  optional: the expiry index ratchet:index:expiry (zset), on a single Redis only
--          (see acquire_lease)
--
-- ARGV[1]  owner id (text)
-- ARGV[2]  lease version the caller holds (integer)
-- ARGV[3]  ttl (integer milliseconds, > 0), counted from now
-- ARGV[4]  with KEYS[2]: the run id (text), scored by the new expiry once renewed
--
-- Replies:
--   {"renewed", lease_version, expires_at_ms, now_ms}
--   {"lease_lost", owner, lease_version, expires_at_ms, now_ms}     another owner or version
--   {"lease_expired", owner, lease_version, expires_at_ms, now_ms}  still named, past expiry
--   {"no_run"}                                                      no such lease record
--
-- Time: *_ms values are Redis server time, milliseconds since the epoch.

if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'no_run'}
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cur = redis.call('HMGET', KEYS[1], 'owner', 'lease_version', 'expires_at_ms')
local owner = cur[1] or ''
local version = tonumber(cur[2] or '0')
local expires = tonumber(cur[3] or '0')

if owner ~= ARGV[1] or version ~= tonumber(ARGV[2]) then
  return {'lease_lost', owner, version, expires, now_ms}
end
if now_ms >= expires then
  return {'lease_expired', owner, version, expires, now_ms}
end

expires = now_ms + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'expires_at_ms', expires)
if #KEYS >= 2 then
  redis.call('ZADD', KEYS[2], expires, ARGV[4])
end
return {'renewed', version, expires, now_ms}
