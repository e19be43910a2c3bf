-- commit: the fenced checkpoint commit, of one generation or of a batch of consecutive
-- generations. One script, so the checkpoint content and the generation high-water mark
-- never move apart.
--
-- KEYS[1]  lease hash          ratchet:{<run>}:lease
-- KEYS[2]  run state hash      ratchet:{<run>}:state
-- KEYS[3]  checkpoint string   ratchet:{<run>}:ckpt
-- KEYS[4]  history list        ratchet:{<run>}:history
-- KEYS[5]  commit ids hash     ratchet:{<run>}:commits
-- KEYS[6]  consumed nonces set ratchet:{<run>}:nonces
-- KEYS[7]  archive list        ratchet:{<run>}:archive
-- KEYS[8]  key digests string  ratchet:{<run>}:keys
-- KEYS[9]  optional: the expiry index ratchet:index:expiry (zset), on a single Redis only,
--          updated when the batch releases the lease (see release_lease)
-- KEYS[10..] optional, after KEYS[9], on a single Redis only: every phase index
--          ratchet:index:phase:<phase> (zset); the script moves the run from its old
--          phase's index to its new one (the key whose name ends in ':<phase>') when the
--          batch changes the run's phase. Without them the reply reports the move and the
--          caller updates the indexes (Redis Cluster: they live in other slots).
--
-- ARGV[1]  owner id (text)
-- ARGV[2]  lease version the caller holds (integer)
-- ARGV[3]  expected state version of the first commit (integer; commit i of the batch
--          expects ARGV[3] + i - 1, so it can only apply after every commit before it)
-- ARGV[4]  history limit (integer entries, >= 1)
-- ARGV[5]  number of commits in the batch (integer, >= 1)
-- ARGV[6]  release: "" keeps the lease; "drop" or "reap" releases it once every commit of
--          the batch applied (or was already applied), exactly as release_lease would
--          with that mode: owner cleared, expiry set to now, the run taken off the expiry
--          index ("drop") or scored now in it ("reap")
-- ARGV[7]  the run id (text; the member of the indexes in KEYS[8..])
-- ARGV[8..] one group per commit, in generation order:
--          generation of the checkpoint (integer; must be high-water + 1)
--          checkpoint (bytes, signed by the caller, opaque to the script)
--          commit id (text, no '|')
--          checkpoint digest (lowercase hex text, computed by the caller)
--          archive segment to append (bytes, opaque; empty: nothing to append)
--          key digests to append (bytes, opaque; empty: none): the 8-byte digests of the
--            keys of the executed writes the segment adds, which the checkpoint signs
--          not after (integer ms of Redis time; 0: none): the commit is refused once
--            TIME has passed it (the expiry of the approval the commit's pending write
--            carries, so an approved write is never committed for execution late,
--            whatever the worker's clock says)
--          phase (text; "": the commit leaves the run's phase as it is): the phase the
--            checkpoint is in, unsigned metadata for listings
--          nonce count k (integer, >= 0), then k nonces to consume (text)
--
-- Replies: one entry per commit examined, in order; the script stops after the first entry
-- that is neither committed nor already_applied (the commits before it are applied):
--   {"committed", generation, state_version, lease_expires_at_ms, now_ms}
--   {"already_applied", commit_generation, generation, state_version}
--   {"commit_id_conflict", commit_generation}
--   {"no_run"}
--   {"lease_lost", owner, lease_version, expires_at_ms, now_ms}
--   {"lease_expired", owner, lease_version, expires_at_ms, now_ms}
--   {"generation_mismatch", generation, state_version}   generation = the high-water mark
--   {"stale_state", generation, state_version}
--   {"nonce_replayed", nonce}
--   {"approval_expired", commit_generation, not_after_ms, now_ms}
--   {"bad_batch"}   (the only entry) the ARGV groups do not add up; nothing was read
-- and, after the last commit's entry when ARGV[6] asks for a release and every commit
-- applied:
--   {"released", lease_version, now_ms}
--   {"lease_lost", owner, lease_version, expires_at_ms, now_ms}  (only when every commit was
--                                                          already applied: the lease
--                                                          moved on since)
-- and last, when the applied commits changed the run's phase:
--   {"phase", old_phase, new_phase, now_ms}   old_phase "" for a run that had none; the
--                                             indexes moved already when KEYS[9..] came
-- A retry whose commits were all applied and whose lease version has no owner any more
-- (released by the first send; an acquire would have raised the version) answers
-- "released" again and writes nothing.
--
-- Order of checks for each commit (the first that fails decides its entry; nothing of it
-- is written then):
--   1. the run exists;
--   2. the commit id was applied before (a retry after a lost reply) -> already_applied,
--      whatever the lease says now; the same id with a different checkpoint is a conflict;
--   3. owner and lease version are the lease's current ones, and the lease has not
--      expired by Redis server time (TIME);
--   4. the checkpoint's generation is exactly high-water + 1;
--   5. the expected state version is the current one;
--   6. no nonce of the commit is already in this run's consumed-nonce set;
--   7. its "not after" time, when set, has not passed by Redis server time.
-- Then the commit applies: its archive segment and its key digests are appended (the
-- checkpoint signs the chain over every segment and the hash of every digest, so they
-- move together), generation and state version advance
-- together, its nonces join the run's set, a history entry is pushed and its commit id
-- remembered. The checkpoint key and the state hash are written once, for the last commit
-- applied (with the phase of the last applied commit that names one: phase and
-- phase_at_ms change, and the phase indexes move, only when that phase differs from the
-- run's) (an earlier checkpoint of the batch is superseded inside this one atomic script,
-- so no reader could ever see it; its digest stays in the history). The history and the
-- commit-id hash are trimmed together to the newest ARGV[4] entries once they exceed it
-- by an eighth (so trimming runs once per ARGV[4] / 8 commits, not on every one). The
-- archive is never trimmed: it is the run's evidence.
--
-- Nonces: this script consumes them for this run only (the per-run set lives in this
-- run's slot). The global record that stops a nonce from being used by a second run is a
-- separate key per nonce, claimed with SET NX before this script is called (see
-- ratchet.leasing.store): a Redis Cluster script cannot reach keys in other slots.
--
-- Time: *_ms values are Redis server time, milliseconds since the epoch.

-- The layout is checked whole before anything is read or written.
local count = tonumber(ARGV[5])
local release = ARGV[6]
if not count or count < 1 or (release ~= '' and release ~= 'drop' and release ~= 'reap') then
  return {{'bad_batch'}}
end
local groups = {}
local pos = 8
for c = 1, count do
  local not_after = tonumber(ARGV[pos + 6])
  local nonce_count = tonumber(ARGV[pos + 8])
  if not not_after or not_after < 0 or not nonce_count or nonce_count < 0
      or pos + 8 + nonce_count > #ARGV then
    return {{'bad_batch'}}
  end
  groups[c] = pos
  pos = pos + 9 + nonce_count
end
if pos ~= #ARGV + 1 then
  return {{'bad_batch'}}
end

local st = redis.call('HMGET', KEYS[2], 'generation', 'state_version', 'phase')
if not st[1] then
  return {{'no_run'}}
end
local generation = tonumber(st[1])
local state_version = tonumber(st[2])
local old_phase = st[3] or ''
local phase = old_phase

local replies = {}
local now_ms, owner, version, expires
local last_ckpt, last_id
local segments, digests, history, commit_ids = {}, {}, {}, {}

local function read_lease()
  if not now_ms then
    local t = redis.call('TIME')
    now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local lease = redis.call('HMGET', KEYS[1], 'owner', 'lease_version', 'expires_at_ms')
    owner = lease[1] or ''
    version = tonumber(lease[2] or '0')
    expires = tonumber(lease[3] or '0')
  end
end

-- The index of one phase among KEYS[10..] (nil when they were not given).
local function phase_index(name)
  local tail = ':' .. name
  for i = 10, #KEYS do
    if string.sub(KEYS[i], -#tail) == tail then
      return KEYS[i]
    end
  end
  return nil
end

-- After the applied commits moved the run to another phase: move it between the phase
-- indexes when they were given, and report the move last (the caller updates the indexes
-- itself when they were not).
local function moved(replies)
  if phase ~= old_phase then
    local new_index = phase_index(phase)
    if new_index then
      if old_phase ~= '' then
        local old_index = phase_index(old_phase)
        if old_index then
          redis.call('ZREM', old_index, ARGV[7])
        end
      end
      redis.call('ZADD', new_index, now_ms, ARGV[7])
    end
    replies[#replies + 1] = {'phase', old_phase, phase, now_ms}
  end
  return replies
end

-- Write what the applied commits of the batch changed (and release the lease when asked
-- and nothing was refused), then reply.
local function finish(refused)
  if last_ckpt then
    redis.call('SET', KEYS[3], last_ckpt)
    if #segments > 0 then
      redis.call('RPUSH', KEYS[7], unpack(segments))
    end
    if #digests > 0 then
      redis.call('APPEND', KEYS[8], table.concat(digests))
    end
    redis.call('HSET', KEYS[2], 'generation', generation, 'state_version', state_version,
      'updated_at_ms', now_ms, 'last_commit_id', last_id)
    if phase ~= old_phase then
      redis.call('HSET', KEYS[2], 'phase', phase, 'phase_at_ms', now_ms)
    end
    local length = redis.call('LPUSH', KEYS[4], unpack(history))
    redis.call('HSET', KEYS[5], unpack(commit_ids))
    local limit = tonumber(ARGV[4])
    if length > limit + math.floor(limit / 8) then
      local old = redis.call('LRANGE', KEYS[4], limit, -1)
      redis.call('LTRIM', KEYS[4], 0, limit - 1)
      local gone = {}
      for _, entry in ipairs(old) do
        local old_id = string.match(entry, '^[^|]*|[^|]*|[^|]*|[^|]*|([^|]*)|')
        if old_id then
          gone[#gone + 1] = old_id
        end
      end
      for i = 1, #gone, 1000 do  -- unpack() has a stack limit: delete in chunks
        redis.call('HDEL', KEYS[5], unpack(gone, i, math.min(i + 999, #gone)))
      end
    end
  end
  if release ~= '' and not refused then
    read_lease()
    if owner == '' and version == tonumber(ARGV[2]) and not last_ckpt then
      -- A retry: every commit was applied and this lease version was released since
      -- (an acquire would have raised the version), by this batch's first send.
      replies[#replies + 1] = {'released', version, now_ms}
      return replies
    end
    if owner ~= ARGV[1] or version ~= tonumber(ARGV[2]) then
      replies[#replies + 1] = {'lease_lost', owner, version, expires, now_ms}
      return replies  -- nothing applied (no phase moved): every commit was a retry
    end
    redis.call('HSET', KEYS[1], 'owner', '', 'expires_at_ms', now_ms)
    if #KEYS >= 9 then
      if release == 'reap' then
        redis.call('ZADD', KEYS[9], now_ms, ARGV[7])
      else
        redis.call('ZREM', KEYS[9], ARGV[7])
      end
    end
    replies[#replies + 1] = {'released', version, now_ms}
  end
  if last_ckpt and phase ~= old_phase then
    return moved(replies)
  end
  return replies
end

for c = 1, count do
  local at = groups[c]
  local target, ckpt, commit_id, digest = tonumber(ARGV[at]), ARGV[at + 1], ARGV[at + 2],
    ARGV[at + 3]
  local segment = ARGV[at + 4]
  local new_digests = ARGV[at + 5]
  local not_after = tonumber(ARGV[at + 6])
  local commit_phase = ARGV[at + 7]
  local first_nonce, last_nonce = at + 9, at + 8 + tonumber(ARGV[at + 8])

  local seen = redis.call('HGET', KEYS[5], commit_id)
  if seen then
    local gen, stored_digest = string.match(seen, '^(%d+)|(.*)$')
    if stored_digest ~= digest then
      replies[#replies + 1] = {'commit_id_conflict', tonumber(gen)}
      return finish(true)
    end
    replies[#replies + 1] = {'already_applied', tonumber(gen), generation, state_version}
  else
    read_lease()
    if owner ~= ARGV[1] or version ~= tonumber(ARGV[2]) then
      replies[#replies + 1] = {'lease_lost', owner, version, expires, now_ms}
      return finish(true)
    end
    if now_ms >= expires then
      replies[#replies + 1] = {'lease_expired', owner, version, expires, now_ms}
      return finish(true)
    end
    if target ~= generation + 1 then
      replies[#replies + 1] = {'generation_mismatch', generation, state_version}
      return finish(true)
    end
    if tonumber(ARGV[3]) + c - 1 ~= state_version then
      replies[#replies + 1] = {'stale_state', generation, state_version}
      return finish(true)
    end
    for i = first_nonce, last_nonce do
      if redis.call('SISMEMBER', KEYS[6], ARGV[i]) == 1 then
        replies[#replies + 1] = {'nonce_replayed', ARGV[i]}
        return finish(true)
      end
    end
    if not_after > 0 and now_ms > not_after then
      replies[#replies + 1] = {'approval_expired', target, not_after, now_ms}
      return finish(true)
    end
    for i = first_nonce, last_nonce do
      redis.call('SADD', KEYS[6], ARGV[i])
    end
    generation = generation + 1
    state_version = state_version + 1
    last_ckpt, last_id = ckpt, commit_id
    if commit_phase ~= '' then
      phase = commit_phase
    end
    if segment ~= '' then
      segments[#segments + 1] = segment
    end
    if new_digests ~= '' then
      digests[#digests + 1] = new_digests
    end
    -- history entry: generation|state_version|lease_version|owner|commit_id|digest|at_ms
    history[#history + 1] = generation .. '|' .. state_version .. '|' .. version .. '|' ..
      owner .. '|' .. commit_id .. '|' .. digest .. '|' .. now_ms
    commit_ids[#commit_ids + 1] = commit_id
    commit_ids[#commit_ids + 1] = generation .. '|' .. digest
    replies[#replies + 1] = {'committed', generation, state_version, expires, now_ms}
  end
end
return finish()
