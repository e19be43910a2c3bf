-- release_lease: give the lease up; only the current owner with the current lease version.
--
-- The owner is cleared and the expiry set to now; the lease version is kept, so the next
-- holder still gets a higher version than every earlier one. Releasing after expiry is
-- allowed while nobody has taken the lease over (it changes nothing but the owner field).
--
-- One script for every lease ratchet keeps (see renew_lease).
--
-- KEYS[1]  lease hash  ratchet:{<run>}:lease, or a thread's ratchet:lg:{<T>}:meta
-- KEYS[2]  optional: the expiry index ratchet:index:expiry (zset), on a single Redis only
--          (see acquire_lease)
--
-- ARGV[1]  owner id (text)
-- ARGV[2]  lease version the caller holds (integer)
-- ARGV[3]  with KEYS[2]: the run id (text)
-- ARGV[4]  with KEYS[2]: "reap" keeps the run in the index scored now (another worker
--          picks it up at once), "drop" takes it off the index
--
-- Replies:
--   {"released", lease_version, now_ms}
--   {"lease_lost", owner, lease_version, expires_at_ms, now_ms}  another owner or version
--   {"no_run"}                                                  no such lease record
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

redis.call('HSET', KEYS[1], 'owner', '', 'expires_at_ms', now_ms)
if #KEYS >= 2 then
  if ARGV[4] == 'reap' then
    redis.call('ZADD', KEYS[2], now_ms, ARGV[3])
  else
    redis.call('ZREM', KEYS[2], ARGV[3])
  end
end
return {'released', version, now_ms}
