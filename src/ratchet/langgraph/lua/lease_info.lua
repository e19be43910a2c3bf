-- lease_info: the thread's lease and generation as Redis sees them now (read only).
--
-- KEYS[1]  thread meta hash  ratchet:lg:{<T>}:meta
--
-- Reply:
--   {"lease", owner, lease_version, expires_at_ms, now_ms, generation}
--     owner is "" when the lease is free; every number is 0 for a thread never touched
--
-- Time: *_ms values are Redis server time, milliseconds since the epoch.

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local m = redis.call('HMGET', KEYS[1], 'owner', 'lease_version', 'expires_at_ms', 'generation')
return {'lease', m[1] or '', tonumber(m[2] or '0'), tonumber(m[3] or '0'), now_ms,
  tonumber(m[4] or '0')}
