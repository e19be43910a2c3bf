-- ledger_record: record what became of a call the ledger admitted (ledger_admit) or that a
-- tool's recovery found: 'committed' with its receipt (the version moves on by one), or
-- 'aborted' (the tool refused it with no effect, or a lookup showed it never happened).
--
-- These are facts about calls that already happened or did not, so they are recorded
-- whoever reports them (a worker whose lease lapsed during the call included): refusing
-- one would lose the only record of an effect. They never lower a fence, and a key's
-- receipt, once committed, never changes.
--
-- KEYS[1]  ledger hash  ratchet:{<run>}:ledger  (see ledger_admit)
-- KEYS[2]  calls hash   ratchet:{<run>}:calls
--
-- ARGV[1]  op: "commit" or "abort"
-- ARGV[2]  idempotency key (text)
-- ARGV[3]  "1" when ARGV[4..6] describe a call that has no row (a tool that records calls
--          only once they returned, or one a lookup found); "0" otherwise
-- ARGV[4]  tool name (text)
-- ARGV[5]  intent digest (hex text)
-- ARGV[6]  approval digest (hex text; "": none)
-- ARGV[7]  commit: the receipt's JSON object without receipt_id and env_version_after,
--          which are filled in here from the ledger's instance and new version (text)
-- ARGV[8]  the fence the call was made under, "lv:sv" ("": none), recorded as the highest
--          seen when it is higher
-- ARGV[9]  the fence's store epoch ("": none), bound when the ledger has none yet
--
-- Replies:
--   {"committed", receipt_json, version}  the key's receipt (this one, or the one it
--                                 already had) and the ledger's version now
--   {"aborted"}                   the key may be sent again
--   {"kept", status}              abort of a key that is not 'started' (nothing changed)
--   {"no_call"}                   no row for the key and none described
--   {"no_ledger"}                 the ledger was never made (ledger_init)

-- Counters move by HGET + HSET, not HINCRBY: the worker's Redis user holds only the
-- commands its scripts issue, and HINCRBY would let it move a generation by hand.
local function bump(field)
  local n = tonumber(redis.call('HGET', KEYS[1], field) or '0') + 1
  redis.call('HSET', KEYS[1], field, n)
end

if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'no_ledger'}
end
local key = ARGV[2]
local raw = redis.call('HGET', KEYS[2], key)
local row = nil
if raw then
  row = cjson.decode(raw)
end
local approval = false
if ARGV[6] ~= '' then
  approval = ARGV[6]
end

if ARGV[1] == 'abort' then
  if row and row['status'] ~= 'started' then
    return {'kept', row['status']}
  end
  if not row then
    if ARGV[3] ~= '1' then
      return {'kept', ''}
    end
    row = {tool = ARGV[4], intent = ARGV[5], approval = approval, attempts = 0,
      receipt = false}
  end
  row['status'] = 'aborted'
  redis.call('HSET', KEYS[2], key, cjson.encode(row))
  return {'aborted'}
end

if row and row['status'] == 'committed' then
  return {'committed', row['receipt'], tonumber(redis.call('HGET', KEYS[1], 'version'))}
end
if not row then
  if ARGV[3] ~= '1' then
    return {'no_call'}
  end
  row = {tool = ARGV[4], intent = ARGV[5], approval = approval, attempts = 1,
    receipt = false}
end
local meta = redis.call('HMGET', KEYS[1], 'instance', 'version', 'lv', 'sv', 'epoch')
local version = tonumber(meta[2]) + 1
local receipt = string.sub(ARGV[7], 1, -2) .. ',"env_version_after":' .. version ..
  ',"receipt_id":"' .. meta[1] .. '/' .. (version - 1) .. '"}'
row['status'] = 'committed'
row['receipt'] = receipt
if tonumber(row['attempts'] or 0) < 1 then
  row['attempts'] = 1
end
redis.call('HSET', KEYS[2], key, cjson.encode(row))
redis.call('HSET', KEYS[1], 'version', version)
bump('effects')
if ARGV[8] ~= '' then
  local sep = string.find(ARGV[8], ':', 1, true)
  local lv = tonumber(string.sub(ARGV[8], 1, sep - 1))
  local sv = tonumber(string.sub(ARGV[8], sep + 1))
  local seen_lv = tonumber(meta[3] or '-1')
  local seen_sv = tonumber(meta[4] or '-1')
  if lv > seen_lv or (lv == seen_lv and sv > seen_sv) then
    redis.call('HSET', KEYS[1], 'lv', lv, 'sv', sv)
  end
end
if ARGV[9] ~= '' and (not meta[5] or meta[5] == '') then
  redis.call('HSET', KEYS[1], 'epoch', ARGV[9])
end
return {'committed', receipt, version}
