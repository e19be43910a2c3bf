-- put_writes: store pending writes of one checkpoint, fenced by the thread's lease.
--
-- The lease is checked exactly as in put.lua (ARGV[3] = 0 claims the thread for the
-- caller; otherwise owner and lease version must be current and unexpired by Redis TIME).
-- Writes do not move the head or the generation. A slot (task id, index) is written once:
-- a repeated regular write keeps the first; the special channels (error, interrupt,
-- scheduled, resume: mode "replace") overwrite, as LangGraph's own savers do.
--
-- KEYS[1]  thread meta hash   ratchet:lg:{<T>}:meta
-- KEYS[2]  writes hash        ratchet:lg:{<T>}:writes
-- KEYS[3]  writes index zset  ratchet:lg:{<T>}:windex
--
-- ARGV[1]  thread id (text)
-- ARGV[2]  owner id of the caller (text, non-empty)
-- ARGV[3]  lease version the caller holds (integer; 0 = claim)
-- ARGV[4]  lease ttl (integer milliseconds, > 0)
-- ARGV[5]  checkpoint digest (32 hex)
-- ARGV[6..] triples: write digest (32 hex), mode ("keep" | "replace"), signed write (bytes)
--
-- Replies:
--   {"stored", lease_version, expires_at_ms, now_ms, written}   written = slots written
--   {"held", owner, lease_version, expires_at_ms, now_ms}
--   {"lease_lost", owner, lease_version, expires_at_ms, now_ms}
--   {"lease_expired", owner, lease_version, expires_at_ms, now_ms}
--
-- Time: *_ms values are Redis server time, milliseconds since the epoch.

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local m = redis.call('HMGET', KEYS[1], 'owner', 'lease_version', 'expires_at_ms')
local owner = m[1] or ''
local version = tonumber(m[2] or '0')
local expires = tonumber(m[3] or '0')
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

local written = 0
for i = 6, #ARGV, 3 do
  local field = ARGV[5] .. '|' .. ARGV[i]
  if ARGV[i + 1] == 'replace' or redis.call('HEXISTS', KEYS[2], field) == 0 then
    redis.call('HSET', KEYS[2], field, ARGV[i + 2])
    redis.call('ZADD', KEYS[3], 0, field)
    written = written + 1
  end
end
expires = now_ms + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], 'thread_id', ARGV[1], 'owner', ARGV[2], 'lease_version', version,
  'expires_at_ms', expires)
if claimed then
  redis.call('HSET', KEYS[1], 'acquired_at_ms', now_ms)
end
return {'stored', version, expires, now_ms, written}
