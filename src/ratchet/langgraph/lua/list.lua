-- list: checkpoint index entries of a thread, newest first by generation (the store's
-- order, never the checkpoint ids, which come from worker clocks).
--
-- KEYS[1]  thread meta hash  ratchet:lg:{<T>}:meta
-- KEYS[2]  index zset        ratchet:lg:{<T>}:index
-- KEYS[3]  generations hash  ratchet:lg:{<T>}:gens
--
-- ARGV[1]  namespace digest (32 hex), or "" for every namespace (then all entries come
--          back unordered and unlimited; the caller sorts them)
-- ARGV[2]  checkpoint digest of the "before" cursor, or "" for none; only entries of an
--          older generation are returned
-- ARGV[3]  limit (integer entries; 0 = no limit; ignored for every namespace)
--
-- Reply:
--   {"ids", generation, head_record, before_generation, members}
--     before_generation  the cursor's generation (0 when there is no cursor or it is
--                        unknown)
--     members            "<ns digest>|<generation, 20 digits>|<checkpoint digest>"

local m = redis.call('HMGET', KEYS[1], 'generation', 'head')
local generation = tonumber(m[1] or '0')
local head = m[2] or ''

local before = 0
if ARGV[2] ~= '' then
  local entry = redis.call('HGET', KEYS[3], ARGV[2])
  if entry then
    before = tonumber(string.match(entry, '|(%d+)$'))
  end
end

local members
if ARGV[1] == '' then
  members = redis.call('ZRANGE', KEYS[2], 0, -1)
else
  local upper = '(' .. ARGV[1] .. '}'
  if ARGV[2] ~= '' then
    local s = tostring(before)
    upper = '(' .. ARGV[1] .. '|' .. string.rep('0', 20 - #s) .. s .. '|'
  end
  local limit = tonumber(ARGV[3])
  if limit > 0 then
    members = redis.call('ZREVRANGEBYLEX', KEYS[2], upper, '[' .. ARGV[1] .. '|',
      'LIMIT', 0, limit)
  else
    members = redis.call('ZREVRANGEBYLEX', KEYS[2], upper, '[' .. ARGV[1] .. '|')
  end
end
return {'ids', generation, head, before, members}
