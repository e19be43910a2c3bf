-- index_run: write one run's cross-run index entries after a script that could not
-- (Redis Cluster: the indexes live in other slots, split into shards; all the keys below
-- are the run's own shard of each index, so they share one slot). Also used on a single
-- Redis for the few index writes its scripts leave to the caller (a retried create, a
-- phase recorded by store init), with the unsharded keys.
--
-- The additions come first and the removals last: a command that fails (junk at a key:
-- WRONGTYPE) ends the script there, so a failure can leave a run listed under its new
-- phase and its old one, never under none. (A MULTI would run the removals anyway.)
--
-- KEYS[1]     the runs index's shard
-- KEYS[2]     the expiry index's shard
-- KEYS[3..]   the phase indexes' shards, in ratchet.leasing.keyspace.PHASES order
--
-- ARGV[1]  the run id (text): the member
-- ARGV[2]  which phase to list the run under, 1..n (KEYS[2 + n]); 0: leave the phases
--          alone
-- ARGV[3]  the score there (integer ms: when the run entered the phase)
-- ARGV[4]  "1": keep an existing entry's score there (ZADD NX); "0": set it
-- ARGV[5]  "" or the run's creation time (integer ms): added to the runs index (ZADD NX)
-- ARGV[6]  "" or the lease expiry (integer ms): set in the expiry index (ZADD)
--
-- Replies: {"indexed"}

local run_id = ARGV[1]
local phases = #KEYS - 2
local phase = tonumber(ARGV[2])
if ARGV[5] ~= '' then
  redis.call('ZADD', KEYS[1], 'NX', ARGV[5], run_id)
end
if ARGV[6] ~= '' then
  redis.call('ZADD', KEYS[2], ARGV[6], run_id)
end
if phase >= 1 and phase <= phases then
  if ARGV[4] == '1' then
    redis.call('ZADD', KEYS[2 + phase], 'NX', ARGV[3], run_id)
  else
    redis.call('ZADD', KEYS[2 + phase], ARGV[3], run_id)
  end
  for n = 1, phases do
    if n ~= phase then
      redis.call('ZREM', KEYS[2 + n], run_id)
    end
  end
end
return {'indexed'}
