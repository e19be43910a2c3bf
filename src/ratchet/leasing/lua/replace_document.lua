-- replace_document: swap a run's stored document for the same document signed again.
--
-- Used when a checkpoint key is retired: documents signed with it are re-signed with the
-- signing key first (the caller verified the old bytes and made the new ones from the
-- very same document; this script only makes the swap atomic). Compare-and-set on the
-- exact old bytes, so a concurrent change is never overwritten.
--
-- KEYS[1]  document     ratchet:{<run>}:scenario
-- KEYS[2]  state hash   ratchet:{<run>}:state  (must exist)
--
-- ARGV[1]  the document bytes the caller verified (must be what is stored)
-- ARGV[2]  the new document bytes
--
-- Replies:
--   {"replaced"}
--   {"changed"}   the stored bytes are not ARGV[1]; nothing written
--   {"no_run"}

if redis.call('EXISTS', KEYS[2]) == 0 then
  return {'no_run'}
end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return {'changed'}
end
redis.call('SET', KEYS[1], ARGV[2])
return {'replaced'}
