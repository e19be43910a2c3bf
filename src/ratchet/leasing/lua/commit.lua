-- commit: the fenced checkpoint commit. One script, so the checkpoint content and the
-- generation high-water mark never move apart.
--
-- KEYS[1]  lease hash          ratchet:{<run>}:lease
-- KEYS[2]  run state hash      ratchet:{<run>}:state
-- KEYS[3]  checkpoint string   ratchet:{<run>}:ckpt
-- KEYS[4]  history list        ratchet:{<run>}:history
-- KEYS[5]  commit ids hash     ratchet:{<run>}:commits
-- KEYS[6]  consumed nonces set ratchet:{<run>}:nonces
-- KEYS[7]  archive list        ratchet:{<run>}:archive
--
-- ARGV[1]  owner id (text)
-- ARGV[2]  lease version the caller holds (integer)
-- ARGV[3]  expected state version (integer)
-- ARGV[4]  generation of the checkpoint (integer; must be high-water + 1)
-- ARGV[5]  checkpoint (bytes, signed by the caller, opaque to the script)
-- ARGV[6]  commit id (text, no '|')
-- ARGV[7]  checkpoint digest (lowercase hex text, computed by the caller)
-- ARGV[8]  history limit (integer entries, >= 1)
-- ARGV[9]  archive segment to append (bytes, opaque; empty: nothing to append)
-- ARGV[10..] nonces to consume (text), zero or more
--
-- Replies:
--   {"committed", generation, state_version, lease_expires_at_ms, now_ms}
--   {"already_applied", commit_generation, generation, state_version}
--   {"commit_id_conflict", commit_generation}
--   {"no_run"}
--   {"lease_lost", owner, lease_version, expires_at_ms, now_ms}
--   {"lease_expired", owner, lease_version, expires_at_ms, now_ms}
--   {"generation_mismatch", generation, state_version}   generation = the high-water mark
--   {"stale_state", generation, state_version}
--   {"nonce_replayed", nonce}
--
-- Order of checks (the first that fails decides the reply; nothing is written then):
--   1. the run exists;
--   2. the commit id was applied before (a retry after a lost reply) -> already_applied,
--      whatever the lease says now; the same id with a different checkpoint is a conflict;
--   3. owner and lease version are the lease's current ones, and the lease has not
--      expired by Redis server time (TIME);
--   4. the checkpoint's generation is exactly high-water + 1;
--   5. the expected state version is the current one;
--   6. no nonce in ARGV[10..] is already in this run's consumed-nonce set.
-- Then: store the checkpoint, append the archive segment (the checkpoint signs the chain
-- over every segment, so they move together), advance generation and state version
-- together, add the nonces to the run's set, push a history entry and remember the commit
-- id; the history and the commit-id hash are trimmed together to ARGV[8] entries. The
-- archive is never trimmed: it is the run's evidence.
--
-- Nonces: this script consumes them for this run only (the per-run set lives in this
-- run's slot). The global record that stops a nonce from being used by a second run is a
-- separate key per nonce, claimed with SET NX before this script is called (see
-- ratchet.leasing.store): a Redis Cluster script cannot reach keys in other slots.
--
-- Time: *_ms values are Redis server time, milliseconds since the epoch.

local st = redis.call('HMGET', KEYS[2], 'generation', 'state_version')
if not st[1] then
  return {'no_run'}
end
local generation = tonumber(st[1])
local state_version = tonumber(st[2])

local seen = redis.call('HGET', KEYS[5], ARGV[6])
if seen then
  local gen, digest = string.match(seen, '^(%d+)|(.*)$')
  if digest == ARGV[7] then
    return {'already_applied', tonumber(gen), generation, state_version}
  end
  return {'commit_id_conflict', tonumber(gen)}
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = redis.call('HMGET', KEYS[1], 'owner', 'lease_version', 'expires_at_ms')
local owner = lease[1] or ''
local version = tonumber(lease[2] or '0')
local expires = tonumber(lease[3] or '0')
if owner ~= ARGV[1] or version ~= tonumber(ARGV[2]) then
  return {'lease_lost', owner, version, expires, now_ms}
end
if now_ms >= expires then
  return {'lease_expired', owner, version, expires, now_ms}
end

if tonumber(ARGV[4]) ~= generation + 1 then
  return {'generation_mismatch', generation, state_version}
end
if tonumber(ARGV[3]) ~= state_version then
  return {'stale_state', generation, state_version}
end
for i = 10, #ARGV do
  if redis.call('SISMEMBER', KEYS[6], ARGV[i]) == 1 then
    return {'nonce_replayed', ARGV[i]}
  end
end

generation = generation + 1
state_version = state_version + 1
redis.call('SET', KEYS[3], ARGV[5])
if ARGV[9] ~= '' then
  redis.call('RPUSH', KEYS[7], ARGV[9])
end
redis.call('HSET', KEYS[2], 'generation', generation, 'state_version', state_version,
  'updated_at_ms', now_ms, 'last_commit_id', ARGV[6])
for i = 10, #ARGV do
  redis.call('SADD', KEYS[6], ARGV[i])
end
-- history entry: generation|state_version|lease_version|owner|commit_id|digest|at_ms
local length = redis.call('LPUSH', KEYS[4], generation .. '|' .. state_version .. '|' ..
  version .. '|' .. owner .. '|' .. ARGV[6] .. '|' .. ARGV[7] .. '|' .. now_ms)
redis.call('HSET', KEYS[5], ARGV[6], generation .. '|' .. ARGV[7])
local limit = tonumber(ARGV[8])
while length > limit do
  local old = redis.call('RPOP', KEYS[4])
  local old_id = string.match(old, '^[^|]*|[^|]*|[^|]*|[^|]*|([^|]*)|')
  if old_id then
    redis.call('HDEL', KEYS[5], old_id)
  end
  length = length - 1
end
return {'committed', generation, state_version, expires, now_ms}
