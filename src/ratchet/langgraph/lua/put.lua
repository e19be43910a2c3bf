-- put: store one LangGraph checkpoint of a thread, fenced by the thread's lease, and move
-- the namespace's head to it under the next generation. One script, so the lease check,
-- the generation compare-and-set, the checkpoint, its new channel values and the head
-- never move apart.
--
-- KEYS[1]  thread meta hash       ratchet:lg:{<T>}:meta
-- KEYS[2]  heads hash             ratchet:lg:{<T>}:heads
-- KEYS[3]  checkpoint records     ratchet:lg:{<T>}:ckpts
-- KEYS[4]  blob lists             ratchet:lg:{<T>}:refs
-- KEYS[5]  generations            ratchet:lg:{<T>}:gens
-- KEYS[6]  index zset             ratchet:lg:{<T>}:index
-- KEYS[7]  blobs hash             ratchet:lg:{<T>}:blobs
--
-- ARGV[1]  thread id (text, kept in meta for operators)
-- ARGV[2]  owner id of the caller (text, non-empty)
-- ARGV[3]  lease version the caller holds (integer; 0 = claim)
-- ARGV[4]  lease ttl (integer milliseconds, > 0)
-- ARGV[5]  expected generation (integer; the current high-water mark)
-- ARGV[6]  new head record (bytes, signed by the caller for generation ARGV[5] + 1)
-- ARGV[7]  namespace digest (32 hex)
-- ARGV[8]  checkpoint digest (32 hex)
-- ARGV[9]  checkpoint record (bytes, signed by the caller)
-- ARGV[10] blob fields the checkpoint reads (32-hex digests separated by spaces; may be "")
-- ARGV[11..] pairs: blob field (32 hex), signed blob (bytes)
--
-- Replies:
--   {"stored", generation, lease_version, expires_at_ms, now_ms}
--   {"held", owner, lease_version, expires_at_ms, now_ms}     another live owner (claim)
--   {"lease_lost", owner, lease_version, expires_at_ms, now_ms}
--   {"lease_expired", owner, lease_version, expires_at_ms, now_ms}
--   {"generation_moved", generation, head_record}             head_record "" when none
--   {"missing_blob", field}
--
-- Order of checks (the first that fails decides the reply; nothing is written then):
--   1. the lease. ARGV[3] = 0 means "no lease in the config": the caller claims the thread
--      if it is free, expired or already the caller's (a claim of a free or expired lease
--      bumps the lease version; the caller's own live lease keeps its version). Otherwise
--      owner and lease version must be the current ones and the lease unexpired by Redis
--      server time (TIME). The parent pointer is not checked: forks are legal new heads.
--   2. the generation: the high-water mark must still be ARGV[5], the one the caller built
--      the new signed head record on (else the caller re-reads and re-signs).
--   3. every blob field the checkpoint reads (ARGV[10]) is either sent now or stored.
-- Then: store the new blobs, the checkpoint record, its blob list, its generation and
-- index entry (replacing an earlier record of the same checkpoint), point the namespace's
-- head at it, advance the generation, store the head record and extend the lease.
--
-- Time: *_ms values are Redis server time, milliseconds since the epoch.

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local m = redis.call('HMGET', KEYS[1], 'owner', 'lease_version', 'expires_at_ms',
  'generation', 'head')
local owner = m[1] or ''
local version = tonumber(m[2] or '0')
local expires = tonumber(m[3] or '0')
local generation = tonumber(m[4] or '0')
local held = tonumber(ARGV[3])
local claimed = false

if held == 0 then
  if owner ~= '' and owner ~= ARGV[2] and now_ms < expires then
    return {'held', owner, version, expires, now_ms}
  end
  if owner ~= ARGV[2] or now_ms >= expires then
    version = math.max(version + 1, now_ms)
    claimed = true
  end
else
  if owner ~= ARGV[2] or version ~= held then
    return {'lease_lost', owner, version, expires, now_ms}
  end
  if now_ms >= expires then
    return {'lease_expired', owner, version, expires, now_ms}
  end
end

if generation ~= tonumber(ARGV[5]) then
  return {'generation_moved', generation, m[5] or ''}
end

local sent = {}
for i = 11, #ARGV, 2 do
  sent[ARGV[i]] = true
end
for field in string.gmatch(ARGV[10], '%S+') do
  if not sent[field] and redis.call('HEXISTS', KEYS[7], field) == 0 then
    return {'missing_blob', field}
  end
end

local function pad(n)
  local s = tostring(n)
  return string.rep('0', 20 - #s) .. s
end

for i = 11, #ARGV, 2 do
  redis.call('HSET', KEYS[7], ARGV[i], ARGV[i + 1])
end
local old = redis.call('HGET', KEYS[5], ARGV[8])
if old then
  local old_gen = string.match(old, '|(%d+)$')
  redis.call('ZREM', KEYS[6], ARGV[7] .. '|' .. pad(old_gen) .. '|' .. ARGV[8])
end
generation = generation + 1
redis.call('HSET', KEYS[3], ARGV[8], ARGV[9])
redis.call('HSET', KEYS[4], ARGV[8], ARGV[10])
redis.call('HSET', KEYS[5], ARGV[8], ARGV[7] .. '|' .. generation)
redis.call('ZADD', KEYS[6], 0, ARGV[7] .. '|' .. pad(generation) .. '|' .. ARGV[8])
redis.call('HSET', KEYS[2], ARGV[7], ARGV[8])
expires = now_ms + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], 'thread_id', ARGV[1], 'generation', generation, 'head', ARGV[6],
  'owner', ARGV[2], 'lease_version', version, 'expires_at_ms', expires)
if claimed then
  redis.call('HSET', KEYS[1], 'acquired_at_ms', now_ms)
end
return {'stored', generation, version, expires, now_ms}
