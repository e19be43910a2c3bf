-- create_run: create a run with its scenario and first signed checkpoint in one step.
--
-- The run starts at generation 1 and state version 1 with a free lease (version 0).
-- Every key belongs to one run and carries its hash tag, so the script runs in one slot.
--
-- KEYS[1]  run state hash    ratchet:{<run>}:state
-- KEYS[2]  scenario string   ratchet:{<run>}:scenario
-- KEYS[3]  checkpoint string ratchet:{<run>}:ckpt
-- KEYS[4]  history list      ratchet:{<run>}:history
-- KEYS[5]  commit ids hash   ratchet:{<run>}:commits
-- KEYS[6]  lease hash        ratchet:{<run>}:lease
-- KEYS[7]  archive list      ratchet:{<run>}:archive
-- KEYS[8]  tombstone hash    ratchet:{<run>}:tombstone (a purged run's: the id stays taken)
-- KEYS[9]  optional: the runs index ratchet:index:runs (zset), on a single Redis only
--          (in Redis Cluster it lives in another slot; the caller adds the run itself)
-- KEYS[10] optional, with KEYS[9] and a phase in ARGV[9]: that phase's index
--          ratchet:index:phase:<phase> (zset), on a single Redis only
--
-- ARGV[1]  task id (text, no '|')
-- ARGV[2]  environment instance id (text, no '|')
-- ARGV[3]  scenario (bytes, opaque to the script)
-- ARGV[4]  checkpoint for generation 1 (bytes, signed by the caller, opaque to the script)
-- ARGV[5]  commit id (text, no '|'), recognised on a retry after a lost reply
-- ARGV[6]  checkpoint digest (lowercase hex text, computed by the caller)
-- ARGV[7]  first archive segment (bytes, opaque; empty: the checkpoint names no archive)
-- ARGV[8]  the run id (text): the member added to KEYS[9] and KEYS[10], scored by the
--          creation time
-- ARGV[9]  the run's first phase (text; "": none recorded), kept in the state hash as
--          phase, with phase_at_ms = the creation time (unsigned metadata for listings)
--
-- Replies:
--   {"created", generation, state_version, now_ms}
--   {"already_applied", generation, state_version, created_at_ms, phase, phase_at_ms}
--                                                   this commit id created the run before;
--                                                   phase / phase_at_ms are the run's now
--                                                   ("" and 0 when it has none)
--   {"exists", generation, state_version}           another call created the run
--   {"purged"}                                      a run with this id was purged
--
-- Time: now_ms is Redis server time (TIME), milliseconds since the epoch.

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if redis.call('EXISTS', KEYS[8]) == 1 then
  return {'purged'}
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  local cur = redis.call('HMGET', KEYS[1], 'generation', 'state_version', 'created_at_ms',
    'phase', 'phase_at_ms')
  local seen = redis.call('HGET', KEYS[5], ARGV[5])
  if seen and seen == ('1|' .. ARGV[6]) then
    return {'already_applied', tonumber(cur[1]), tonumber(cur[2]), tonumber(cur[3]),
      cur[4] or '', tonumber(cur[5] or '0')}
  end
  return {'exists', tonumber(cur[1]), tonumber(cur[2])}
end

redis.call('HSET', KEYS[1],
  'task_id', ARGV[1],
  'env_instance_id', ARGV[2],
  'generation', 1,
  'state_version', 1,
  'created_at_ms', now_ms,
  'updated_at_ms', now_ms,
  'last_commit_id', ARGV[5])
if ARGV[9] ~= '' then
  redis.call('HSET', KEYS[1], 'phase', ARGV[9], 'phase_at_ms', now_ms)
end
redis.call('SET', KEYS[2], ARGV[3])
redis.call('SET', KEYS[3], ARGV[4])
redis.call('HSET', KEYS[6], 'owner', '', 'lease_version', 0, 'expires_at_ms', 0)
redis.call('DEL', KEYS[4], KEYS[5], KEYS[7])
if ARGV[7] ~= '' then
  redis.call('RPUSH', KEYS[7], ARGV[7])
end
-- history entry: generation|state_version|lease_version|owner|commit_id|digest|at_ms
redis.call('LPUSH', KEYS[4], '1|1|0||' .. ARGV[5] .. '|' .. ARGV[6] .. '|' .. now_ms)
redis.call('HSET', KEYS[5], ARGV[5], '1|' .. ARGV[6])
if #KEYS >= 9 then
  redis.call('ZADD', KEYS[9], 'NX', now_ms, ARGV[8])
end
if #KEYS >= 10 then
  redis.call('ZADD', KEYS[10], 'NX', now_ms, ARGV[8])
end
return {'created', 1, 1, now_ms}
