-- drop_expiry_entry: take a run off the expiry index only if its score is still the one
-- the reaper read.
--
-- A worker that acquires the run after the reaper's read re-scores it (zadd); removing it
-- unconditionally would strand that worker's run if it then died. This script touches
-- only the index key, so it runs in the index's own cluster slot.
--
-- KEYS[1]  expiry index  ratchet:index:expiry (zset: run id -> lease expiry ms)
--
-- ARGV[1]  run id (text)
-- ARGV[2]  the score the caller read (integer, ms)
--
-- Replies:
--   {"dropped"}
--   {"kept", score}     re-scored since: someone holds or released the run again
--   {"absent"}

local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then
  return {'absent'}
end
if tonumber(score) ~= tonumber(ARGV[2]) then
  return {'kept', tostring(score)}
end
redis.call('ZREM', KEYS[1], ARGV[1])
return {'dropped'}
