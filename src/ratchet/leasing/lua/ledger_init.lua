-- ledger_init: make the declared tools' ledger of one run in the run's own keys, once.
--
-- Creating it needs no lease (a submitter makes it before the run exists, to observe it
-- for generation 1): only its instance id (random, drawn by the caller) and version 1 are
-- written, and only when the ledger does not exist yet, so a ledger in use is never reset.
--
-- KEYS[1]  ledger hash  ratchet:{<run>}:ledger  (see ledger_admit)
--
-- ARGV[1]  the instance id to use if the ledger is new (text)
--
-- Replies:
--   {instance, version}   the ledger's instance id and version (new or as found)

if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'instance', ARGV[1], 'version', 1, 'effects', 0,
    'refused_stale', 0, 'refused_epoch', 0)
end
local meta = redis.call('HMGET', KEYS[1], 'instance', 'version')
return {meta[1], tonumber(meta[2])}
