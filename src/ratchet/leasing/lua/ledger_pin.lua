-- ledger_pin: pin the live contract of a run's declared-server tools in its tool ledger,
-- once (the first job that lists the server's tools); later jobs compare with it.
--
-- The value is signed by the caller (key id, HMAC and digest, as text): the script only
-- keeps the first one. No lease is checked: a stale worker that pins first pins what the
-- server listed to it, and a worker that sees another contract refuses to go on.
--
-- KEYS[1]  ledger hash  ratchet:{<run>}:ledger  (see ledger_admit)
--
-- ARGV[1]  the signed contract to pin if the ledger has none (text)
--
-- Replies:
--   {"ok", pinned}   the pinned value (this one, or the one found)
--   {"missing"}      the run has no ledger (nothing is written)

if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'missing'}
end
redis.call('HSETNX', KEYS[1], 'contract', ARGV[1])
return {'ok', redis.call('HGET', KEYS[1], 'contract')}
