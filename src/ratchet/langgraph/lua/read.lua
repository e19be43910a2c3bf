-- read: checkpoints of a thread with their channel values and pending writes, together
-- with the thread's generation and signed head record, read in one step.
--
-- With no checkpoint digest in ARGV[2..], the head of namespace ARGV[1] is read (none if
-- the namespace has no head). Missing records and blobs come back as "": the caller
-- treats a checkpoint that is asked for by id and absent as "not found", and a blob that
-- a signed checkpoint names but that is absent as tampering.
--
-- KEYS[1]  thread meta hash    ratchet:lg:{<T>}:meta
-- KEYS[2]  heads hash          ratchet:lg:{<T>}:heads
-- KEYS[3]  checkpoint records  ratchet:lg:{<T>}:ckpts
-- KEYS[4]  blob lists          ratchet:lg:{<T>}:refs
-- KEYS[5]  blobs hash          ratchet:lg:{<T>}:blobs
-- KEYS[6]  writes hash         ratchet:lg:{<T>}:writes
-- KEYS[7]  writes index zset   ratchet:lg:{<T>}:windex
--
-- ARGV[1]  namespace digest (32 hex) whose head is read when no digest follows
-- ARGV[2..] checkpoint digests (32 hex), zero or more
--
-- Reply:
--   {"read", generation, head_record, entries}
--     generation   the high-water mark (0 for a thread never written)
--     head_record  the signed head record ("" when none)
--     entries      one per checkpoint: {digest, record, blobs, writes}
--                  record  signed checkpoint record ("" when absent)
--                  blobs   flat list: field, signed blob ("" when absent), ...
--                  writes  flat list: field, signed write, ... (in field order)

local m = redis.call('HMGET', KEYS[1], 'generation', 'head')
local generation = tonumber(m[1] or '0')
local head = m[2] or ''

local digests = {}
if #ARGV >= 2 then
  for i = 2, #ARGV do
    digests[#digests + 1] = ARGV[i]
  end
else
  local d = redis.call('HGET', KEYS[2], ARGV[1])
  if d then
    digests[1] = d
  end
end

local entries = {}
for _, d in ipairs(digests) do
  local record = redis.call('HGET', KEYS[3], d) or ''
  local blobs = {}
  local writes = {}
  if record ~= '' then
    local refs = redis.call('HGET', KEYS[4], d) or ''
    for field in string.gmatch(refs, '%S+') do
      blobs[#blobs + 1] = field
      blobs[#blobs + 1] = redis.call('HGET', KEYS[5], field) or ''
    end
    local fields = redis.call('ZRANGEBYLEX', KEYS[7], '[' .. d .. '|', '(' .. d .. '}')
    for _, field in ipairs(fields) do
      writes[#writes + 1] = field
      writes[#writes + 1] = redis.call('HGET', KEYS[6], field) or ''
    end
  end
  entries[#entries + 1] = {d, record, blobs, writes}
end
return {'read', generation, head, entries}
