-- ledger_admit: the declared tools' ledger of one run, kept in the run's own keys. Admit a
-- new owner's fence, or a call, only for the run's live lease at its current generation
-- (storage-side fencing: a worker that lost its lease is refused here, whatever it
-- believes), then judge the key and the precondition, and write the call's 'started'
-- row when asked. Nothing in the ledger moves for a refusal but its counters.
--
-- KEYS[1]  ledger hash  ratchet:{<run>}:ledger  instance, version (starts at 1), epoch (the
--                       store epoch bound on first use), lv / sv (the highest fence seen),
--                       effects, refused_stale, refused_epoch
-- KEYS[2]  calls hash   ratchet:{<run>}:calls   idempotency key -> row (JSON: tool, intent,
--                       approval, status: started | committed | aborted, attempts,
--                       receipt: the receipt's JSON text or false)
-- KEYS[3]  lease hash   ratchet:{<run>}:lease
-- KEYS[4]  state hash   ratchet:{<run>}:state
--
-- ARGV[1]  op: "fence" (raise the fence), "check" (judge a call, write nothing), "start"
--          (judge it and write its started row)
-- ARGV[2]  the fence's lease version (integer)
-- ARGV[3]  the fence's state version: the generation the holder stands at (integer)
-- ARGV[4]  the fence's store epoch (text; "": none)
-- ARGV[5]  idempotency key (text; check and start)
-- ARGV[6]  tool name (text; check and start)
-- ARGV[7]  intent digest (hex text; check and start)
-- ARGV[8]  approval digest (hex text; "": none)
-- ARGV[9]  the environment version the call was planned against (integer)
-- ARGV[10] again: "1" when a started row may be called over (recovery decided so)
--
-- Replies:
--   {"ok", version}                admitted (fence: raised; start: the row is written)
--   {"committed", receipt_json}    the key has a receipt for this intent: no call
--   {"lease", why}                 not the run's live lease at its generation (why: no_run,
--                                  lost, expired, generation); counted as refused_stale
--   {"stale", lv, sv}              a higher fence was seen; counted
--   {"epoch", bound}               another store epoch is bound; counted
--   {"conflict", row_json}         the key belongs to another intent or tool
--   {"unresolved"}                 a started row exists and again is not "1"
--   {"precondition", version}      the version is not the one the call was planned against
--   {"no_ledger"}                  the ledger was never made (ledger_init)
--
-- Time: the lease expiry is judged by Redis server time (TIME).

-- Counters move by HGET + HSET, not HINCRBY: the worker's Redis user holds only the
-- commands its scripts issue, and HINCRBY would let it move a generation by hand.
local function bump(field)
  local n = tonumber(redis.call('HGET', KEYS[1], field) or '0') + 1
  redis.call('HSET', KEYS[1], field, n)
end

if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'no_ledger'}
end
local op = ARGV[1]
local lv = tonumber(ARGV[2])
local sv = tonumber(ARGV[3])

local lease = redis.call('HMGET', KEYS[3], 'lease_version', 'expires_at_ms', 'owner')
local generation = redis.call('HGET', KEYS[4], 'generation')
local why = nil
if not lease[1] or not generation then
  why = 'no_run'
else
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if tonumber(lease[1]) ~= lv or (lease[3] or '') == '' then
    why = 'lost'
  elseif now_ms >= tonumber(lease[2] or '0') then
    why = 'expired'
  elseif tonumber(generation) ~= sv then
    why = 'generation'
  end
end
if why then
  bump('refused_stale')
  return {'lease', why}
end

local meta = redis.call('HMGET', KEYS[1], 'epoch', 'lv', 'sv', 'version')
local bound = meta[1]
if ARGV[4] ~= '' and bound and bound ~= '' and bound ~= ARGV[4] then
  bump('refused_epoch')
  return {'epoch', bound}
end
local seen_lv = tonumber(meta[2] or '-1')
local seen_sv = tonumber(meta[3] or '-1')
if lv < seen_lv or (lv == seen_lv and sv < seen_sv) then
  bump('refused_stale')
  return {'stale', seen_lv, seen_sv}
end
local version = tonumber(meta[4])

local function raise()
  if lv > seen_lv or (lv == seen_lv and sv > seen_sv) then
    redis.call('HSET', KEYS[1], 'lv', lv, 'sv', sv)
  end
  if ARGV[4] ~= '' and (not bound or bound == '') then
    redis.call('HSET', KEYS[1], 'epoch', ARGV[4])
  end
end

if op == 'fence' then
  raise()
  return {'ok', version}
end

local key = ARGV[5]
local raw = redis.call('HGET', KEYS[2], key)
local row = nil
if raw then
  row = cjson.decode(raw)
  if row['intent'] ~= ARGV[7] or row['tool'] ~= ARGV[6] then
    return {'conflict', raw}
  end
  if row['status'] == 'committed' then
    return {'committed', row['receipt']}
  end
  if row['status'] == 'started' and ARGV[10] ~= '1' then
    return {'unresolved'}
  end
end
if version ~= tonumber(ARGV[9]) then
  return {'precondition', version}
end
if op == 'start' then
  raise()
  local attempts = 1
  if row then
    attempts = tonumber(row['attempts'] or 0) + 1
  end
  local approval = false
  if ARGV[8] ~= '' then
    approval = ARGV[8]
  end
  redis.call('HSET', KEYS[2], key, cjson.encode({
    tool = ARGV[6], intent = ARGV[7], approval = approval, status = 'started',
    attempts = attempts, receipt = false
  }))
end
return {'ok', version}
