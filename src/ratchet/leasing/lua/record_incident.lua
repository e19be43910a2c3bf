-- record_incident: keep, for operators, why a worker refused to continue a run (a restore
-- that failed closed: tampered checkpoint, drifted environment, rolled-back store).
--
-- Bounded: the newest ARGV[2] records are kept. The record is opaque JSON; the time is
-- stamped here from Redis' clock.
--
-- KEYS[1]  incidents list  ratchet:{<run>}:incidents
-- KEYS[2]  state hash      ratchet:{<run>}:state  (must exist: incidents only for real runs)
--
-- ARGV[1]  record (JSON text)
-- ARGV[2]  how many records to keep (integer)
--
-- Replies:
--   {"recorded", now_ms}
--   {"no_run"}
--
-- Time: *_ms values are Redis server time, milliseconds since the epoch.

if redis.call('EXISTS', KEYS[2]) == 0 then
  return {'no_run'}
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('LPUSH', KEYS[1], tostring(now_ms) .. '|' .. ARGV[1])
redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2]) - 1)
return {'recorded', now_ms}
