-- purge_run: remove a finished run's records, leaving a compact tombstone.
--
-- The caller verified the run first (its checkpoint at the high-water mark is terminal,
-- nothing in its inbox is unconsumed, an export was written if one was asked for) and
-- passes the generation and state version it verified: a run that moved since, or whose
-- lease is live, is not touched. The tombstone keeps the run id taken for good (create_run
-- refuses an id with a tombstone), so the run's idempotency keys, which derive from its
-- id, can never be issued again; the global nonce records (ratchet:nonce:<nonce>) are
-- not touched, so its nonces can never be consumed again either.
--
-- KEYS[1]  run state hash      ratchet:{<run>}:state
-- KEYS[2]  lease hash          ratchet:{<run>}:lease
-- KEYS[3]  tombstone hash      ratchet:{<run>}:tombstone
-- KEYS[4..15] the run's other keys, deleted: ckpt, scenario, history, commits, nonces,
--          incidents, inbox, archive, keys, ledger, calls, placement
-- KEYS[16..] optional: the cross-run indexes the run is removed from (the runs, expiry and
--          phase indexes), on a single Redis only (in Redis Cluster they live in other
--          slots; the caller removes the run from them itself)
--
-- ARGV[1]  the run id (text): the index member
-- ARGV[2]  the generation the caller verified (integer)
-- ARGV[3]  the state version the caller verified (integer)
-- ARGV[4]  the verified terminal phase (text)
-- ARGV[5]  the verified checkpoint's digest (lowercase hex text)
-- ARGV[6]  the export file's name ("" when none was written)
--
-- Replies:
--   {"purged", now_ms}
--   {"gone"}                      no such run (purged already, or never created)
--   {"moved", generation, state_version}  the run changed since it was verified
--   {"held", owner}               a live lease: a worker holds the run
--
-- Time: now_ms is Redis server time (TIME), milliseconds since the epoch.

local st = redis.call('HMGET', KEYS[1], 'generation', 'state_version', 'task_id',
  'created_at_ms')
if not st[1] then
  return {'gone'}
end
if tonumber(st[1]) ~= tonumber(ARGV[2]) or tonumber(st[2]) ~= tonumber(ARGV[3]) then
  return {'moved', tonumber(st[1]), tonumber(st[2])}
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = redis.call('HMGET', KEYS[2], 'owner', 'expires_at_ms')
if lease[1] and lease[1] ~= '' and now_ms < tonumber(lease[2] or '0') then
  return {'held', lease[1]}
end
redis.call('HSET', KEYS[3], 'purged_at_ms', now_ms, 'generation', st[1],
  'state_version', st[2], 'task_id', st[3] or '', 'created_at_ms', st[4] or '',
  'phase', ARGV[4], 'checkpoint_digest', ARGV[5], 'export', ARGV[6])
redis.call('DEL', KEYS[1], KEYS[2])
for i = 4, 15 do
  redis.call('DEL', KEYS[i])
end
for i = 16, #KEYS do
  redis.call('ZREM', KEYS[i], ARGV[1])
end
return {'purged', now_ms}
