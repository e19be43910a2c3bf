-- rewrite: the administrative changes of a thread (delete_thread, prune, delete_for_runs).
-- They never reset the thread: the generation moves forward and a new signed head record
-- is stored, so a replayed older head or checkpoint is refused as stale.
--
-- Mode "wipe" drops every checkpoint, blob and write of the thread; mode "drop" drops the
-- listed checkpoints (with their writes), applies the head updates, and then drops every
-- blob that no remaining checkpoint reads (by the blob lists in KEYS[4]).
-- With fence "1" the current lease also ends: max(lease_version + 1, now_ms) and no owner, so a worker
-- still running on the thread has its next write refused instead of resurrecting it.
-- With an owner in ARGV[5] the caller is a write owner (a claimed writer) and the rewrite
-- is fenced like put.lua: owner and lease version must be the current ones and the lease
-- unexpired by Redis TIME, checked first, in the same step as the rewrite.
--
-- KEYS[1]  thread meta hash    ratchet:lg:{<T>}:meta
-- KEYS[2]  heads hash          ratchet:lg:{<T>}:heads
-- KEYS[3]  checkpoint records  ratchet:lg:{<T>}:ckpts
-- KEYS[4]  blob lists          ratchet:lg:{<T>}:refs
-- KEYS[5]  generations hash    ratchet:lg:{<T>}:gens
-- KEYS[6]  index zset          ratchet:lg:{<T>}:index
-- KEYS[7]  blobs hash          ratchet:lg:{<T>}:blobs
-- KEYS[8]  writes hash         ratchet:lg:{<T>}:writes
-- KEYS[9]  writes index zset   ratchet:lg:{<T>}:windex
--
-- ARGV[1]  expected generation (integer; the current high-water mark)
-- ARGV[2]  new head record (bytes, signed by the caller for generation ARGV[1] + 1)
-- ARGV[3]  mode ("wipe" | "drop")
-- ARGV[4]  fence ("1" ends the current lease, "0" keeps it)
-- ARGV[5]  owner id of a fenced caller, or "" for an unfenced (administrative) rewrite
-- ARGV[6]  lease version the fenced caller holds (integer; 0 when ARGV[5] is "")
-- ARGV[7]  n: number of checkpoint digests that follow
-- ARGV[8 .. 7+n]  checkpoint digests to drop (32 hex)
-- then pairs: namespace digest, checkpoint digest of its new head ("" = no head)
--
-- Replies:
--   {"rewritten", generation, lease_version}
--   {"absent"}                                    the thread was never written
--   {"generation_moved", generation, head_record}
--   {"lease_lost", owner, lease_version, expires_at_ms, now_ms}     fenced caller only
--   {"lease_expired", owner, lease_version, expires_at_ms, now_ms}  fenced caller only
--
-- Time: the lease check and the ended lease's expiry use Redis server time (TIME), in
-- milliseconds.

local m = redis.call('HMGET', KEYS[1], 'generation', 'head', 'lease_version', 'owner',
  'expires_at_ms')
if ARGV[5] ~= '' then
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local owner = m[4] or ''
  local held = tonumber(m[3] or '0')
  local expires = tonumber(m[5] or '0')
  if owner ~= ARGV[5] or held ~= tonumber(ARGV[6]) then
    return {'lease_lost', owner, held, expires, now_ms}
  end
  if now_ms >= expires then
    return {'lease_expired', owner, held, expires, now_ms}
  end
end
if not m[1] and not m[3] then
  return {'absent'}
end
local generation = tonumber(m[1] or '0')
local version = tonumber(m[3] or '0')
if generation ~= tonumber(ARGV[1]) then
  return {'generation_moved', generation, m[2] or ''}
end

local function pad(n)
  local s = tostring(n)
  return string.rep('0', 20 - #s) .. s
end

local n = tonumber(ARGV[7])
if ARGV[3] == 'wipe' then
  redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9])
else
  for i = 8, 7 + n do
    local d = ARGV[i]
    local entry = redis.call('HGET', KEYS[5], d)
    if entry then
      local ns, gen = string.match(entry, '^([^|]*)|(%d+)$')
      redis.call('ZREM', KEYS[6], ns .. '|' .. pad(gen) .. '|' .. d)
    end
    redis.call('HDEL', KEYS[3], d)
    redis.call('HDEL', KEYS[4], d)
    redis.call('HDEL', KEYS[5], d)
    local fields = redis.call('ZRANGEBYLEX', KEYS[9], '[' .. d .. '|', '(' .. d .. '}')
    for _, field in ipairs(fields) do
      redis.call('HDEL', KEYS[8], field)
    end
    redis.call('ZREMRANGEBYLEX', KEYS[9], '[' .. d .. '|', '(' .. d .. '}')
  end
  for i = 8 + n, #ARGV, 2 do
    if ARGV[i + 1] == '' then
      redis.call('HDEL', KEYS[2], ARGV[i])
    else
      redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
    end
  end
  if n > 0 then
    local read = {}
    for _, refs in ipairs(redis.call('HVALS', KEYS[4])) do
      for field in string.gmatch(refs, '%S+') do
        read[field] = true
      end
    end
    for _, field in ipairs(redis.call('HKEYS', KEYS[7])) do
      if not read[field] then
        redis.call('HDEL', KEYS[7], field)
      end
    end
  end
end

generation = generation + 1
redis.call('HSET', KEYS[1], 'generation', generation, 'head', ARGV[2])
if ARGV[4] == '1' then
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  version = math.max(version + 1, now_ms)
  redis.call('HSET', KEYS[1], 'owner', '', 'lease_version', version, 'expires_at_ms', now_ms)
end
return {'rewritten', generation, version}
