-- takeover: the operator's explicit path to a thread's lease while another owner may still
-- hold it live (a wedged node, a worker that will never come back but whose lease has not
-- run out). acquire_lease refuses a live lease; this script does not, and so it records
-- every use: who took the lease, from whom, when and why.
--
-- KEYS[1]  thread meta hash   ratchet:lg:{<T>}:meta
-- KEYS[2]  takeover log list  ratchet:lg:{<T>}:takeovers
--
-- ARGV[1]  owner id of the caller (text, non-empty, no '|')
-- ARGV[2]  ttl (integer milliseconds, > 0)
-- ARGV[3]  thread id (text, kept in meta for operators)
-- ARGV[4]  reason (text, non-empty; last in the log entry, so it may hold '|')
-- ARGV[5]  how many log entries to keep (integer, > 0)
--
-- Reply:
--   {"taken", lease_version, expires_at_ms, now_ms, previous_owner, previous_lease_version,
--    previous_live}
--     previous_owner is "" when the lease was free; previous_live is 1 when the previous
--     owner's lease was unexpired (by Redis TIME) when it was taken, else 0
--
-- Log entry (LPUSH, newest first, trimmed to ARGV[5]):
--   "<now_ms>|<owner>|<lease_version>|<previous_owner>|<previous_lease_version>|
--    <previous_live>|<reason>" (one line)
--
-- The new lease version is max(lease_version + 1, now_ms), exactly as acquire_lease makes
-- it, so every write of the previous owner (whose lease version is now lower) is refused
-- by put.lua, put_writes.lua and rewrite.lua from this moment on.
--
-- Time: *_ms values are Redis server time, milliseconds since the epoch.

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cur = redis.call('HMGET', KEYS[1], 'owner', 'lease_version', 'expires_at_ms')
local owner = cur[1] or ''
local previous = tonumber(cur[2] or '0')
local expires = tonumber(cur[3] or '0')
local live = 0
if owner ~= '' and now_ms < expires then
  live = 1
end

local version = math.max(previous + 1, now_ms)
local new_expires = now_ms + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'lease_version', version,
  'expires_at_ms', new_expires, 'acquired_at_ms', now_ms, 'thread_id', ARGV[3])
redis.call('LPUSH', KEYS[2], table.concat({now_ms, ARGV[1], version, owner, previous, live,
  ARGV[4]}, '|'))
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[5]) - 1)
return {'taken', version, new_expires, now_ms, owner, previous, live}
