-- post_evidence: leave a signed approval or reviewer decision for the run's next worker.
--
-- The evidence is opaque JSON here; the worker verifies the signature, the bindings and
-- the nonce before it consumes anything (a nonce is consumed in the commit that uses it,
-- so evidence left in the inbox after use is refused as a replay, never applied twice).
-- Bounded: the newest ARGV[2] entries are kept.
--
-- KEYS[1]  inbox list   ratchet:{<run>}:inbox
-- KEYS[2]  state hash   ratchet:{<run>}:state  (must exist)
--
-- ARGV[1]  evidence (JSON text)
-- ARGV[2]  how many entries to keep (integer)
--
-- Replies:
--   {"posted", length}
--   {"no_run"}

if redis.call('EXISTS', KEYS[2]) == 0 then
  return {'no_run'}
end
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2]) - 1)
return {'posted', redis.call('LLEN', KEYS[1])}
