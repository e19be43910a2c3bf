-- read_run: the authoritative state of one run, read in one step for restore: identity,
-- generation high-water mark, state version, the lease, Redis server time, and on request
-- the checkpoint at the high-water mark and the scenario. Writes nothing.
--
-- KEYS[1]  run state hash     ratchet:{<run>}:state
-- KEYS[2]  lease hash         ratchet:{<run>}:lease
-- KEYS[3]  checkpoint string  ratchet:{<run>}:ckpt
-- KEYS[4]  scenario string    ratchet:{<run>}:scenario
-- KEYS[5]  archive list       ratchet:{<run>}:archive
-- KEYS[6]  key digests string ratchet:{<run>}:keys
--
-- ARGV[1]  "1" to include the checkpoint and the archive, "0" not to
-- ARGV[2]  "1" to include the scenario, "0" not to
-- ARGV[3]  with the checkpoint: "0" for the whole archive, or N > 0 for its last N
--          segments and the run's key digests (a worker's restore of a windowed state)
--
-- Replies:
--   {"run", task_id, env_instance_id, generation, state_version, created_at_ms,
--    owner, lease_version, expires_at_ms, now_ms, checkpoint_or_0, scenario_or_0,
--    archive_or_0, archive_from, keys_or_0}
--     owner is "" when the lease is free; checkpoint_or_0 / scenario_or_0 are the bytes
--     when requested and the integer 0 when not; archive_or_0 is the list of archive
--     segments, oldest first, with the checkpoint (in the same step) and 0 without it;
--     archive_from is the index of its first segment (0 for the whole archive);
--     keys_or_0 the key digests (bytes, possibly empty) when the last N were asked for
--   {"no_run"}
--
-- Time: *_ms values are Redis server time, milliseconds since the epoch.

if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'no_run'}
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local st = redis.call('HMGET', KEYS[1], 'task_id', 'env_instance_id', 'generation',
  'state_version', 'created_at_ms')
local lease = redis.call('HMGET', KEYS[2], 'owner', 'lease_version', 'expires_at_ms')
local ckpt = 0
local archive = 0
local archive_from = 0
local digests = 0
if ARGV[1] == '1' then
  ckpt = redis.call('GET', KEYS[3])
  local tail = tonumber(ARGV[3] or '0') or 0
  if tail > 0 then
    local length = redis.call('LLEN', KEYS[5])
    archive_from = math.max(length - tail, 0)
    archive = redis.call('LRANGE', KEYS[5], archive_from, -1)
    digests = redis.call('GET', KEYS[6]) or ''
  else
    archive = redis.call('LRANGE', KEYS[5], 0, -1)
  end
end
local scenario = 0
if ARGV[2] == '1' then
  scenario = redis.call('GET', KEYS[4])
end
return {'run', st[1], st[2], tonumber(st[3]), tonumber(st[4]), tonumber(st[5]),
  lease[1] or '', tonumber(lease[2] or '0'), tonumber(lease[3] or '0'), now_ms,
  ckpt, scenario, archive, archive_from, digests}
