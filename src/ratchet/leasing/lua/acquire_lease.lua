-- acquire_lease: take a lease if it is free, expired, or already the caller's. One
-- script for every lease ratchet keeps: a run's, and a LangGraph thread's (whose lease
-- fields live in its meta hash, which the first claim creates). Free or expired (or held
-- by the same owner id): owner = caller, lease_version = max(lease_version + 1, now_ms),
-- expires_at = now + ttl (why the store's time is the floor: see the end of this header).
--
-- KEYS[1]  lease hash      ratchet:{<run>}:lease, or a thread's ratchet:lg:{<T>}:meta
-- KEYS[2]  record hash     the run's ratchet:{<run>}:state (it must exist), or the
--                          thread's meta hash again
-- KEYS[3]  optional: the expiry index ratchet:index:expiry (zset). Given only on a single
--          Redis: in Redis Cluster it lives in another slot and the caller updates it in
--          a call of its own.
--
-- ARGV[1]  owner id (text, non-empty, no '|')
-- ARGV[2]  ttl (integer milliseconds, > 0)
-- ARGV[3]  with KEYS[3]: the run id (text), scored by the new expiry once acquired
-- ARGV[4]  optional: a thread id (text). Given, the record need not exist (a thread's
--          first claim creates its meta hash) and the id is kept in it for operators.
--
-- Replies:
--   {"acquired", lease_version, expires_at_ms, now_ms, generation, state_version,
--    task_id, env_instance_id, took_over, previous_owner, previous_lease_version,
--    phase, phase_at_ms}
--      took_over: 1 when the lease had an owner whose lease had expired (a takeover),
--      else 0; previous_owner ('' when free) and previous_lease_version (0 when the run
--      was never leased): the lease this one replaced, so a takeover names what it ended;
--      phase and phase_at_ms: the phase the last commit declared and when the run entered
--      it ('' and 0: none recorded), so that on Redis Cluster the caller can put the run
--      back in its phase's index if a crash left it out (a repair at every acquire)
--   {"held", owner, lease_version, expires_at_ms, now_ms}  another live owner holds it
--   {"no_run"}                                      (runs only: no such run)
--   Fields the record does not hold read as 0 or "" (a thread keeps no state version,
--   task id or environment instance).
--
-- Time: *_ms values are Redis server time, milliseconds since the epoch.
--
-- The version only ever grows, so every new holder fences out every earlier one,
-- including an earlier incarnation of the caller. Taking the store's time as a floor
-- keeps that true across a rewound store (an AOF cut back, a failover to a replica that
-- missed writes): the lease hash comes back with an old version, but a lease granted
-- after the rewind still outranks every lease granted before it, so an adapter that has
-- seen the old holder's fence refuses the old holder once the new one raises its own.
-- Without the floor the new holder would get the old holder's number again and the two
-- fences would be equal. (This holds while the store's clock does not step back further
-- than the rewind.) Expiry is judged by Redis server time (TIME) only; no worker clock is
-- involved.

local thread_id = ARGV[4] or ''
if thread_id == '' and redis.call('EXISTS', KEYS[2]) == 0 then
  return {'no_run'}
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cur = redis.call('HMGET', KEYS[1], 'owner', 'lease_version', 'expires_at_ms')
local owner = cur[1] or ''
local version = tonumber(cur[2] or '0')
local expires = tonumber(cur[3] or '0')

if owner ~= '' and owner ~= ARGV[1] and now_ms < expires then
  return {'held', owner, version, expires, now_ms}
end

local took_over = 0
if owner ~= '' and now_ms >= expires then
  took_over = 1
end
local previous = version
version = math.max(version + 1, now_ms)
expires = now_ms + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'lease_version', version,
  'expires_at_ms', expires, 'acquired_at_ms', now_ms)
if thread_id ~= '' then
  redis.call('HSET', KEYS[1], 'thread_id', thread_id)
end
if #KEYS >= 3 then
  redis.call('ZADD', KEYS[3], expires, ARGV[3])
end
local st = redis.call('HMGET', KEYS[2], 'generation', 'state_version', 'task_id',
  'env_instance_id', 'phase', 'phase_at_ms')
return {'acquired', version, expires, now_ms, tonumber(st[1] or '0'), tonumber(st[2] or '0'),
  st[3] or '', st[4] or '', took_over, owner, previous, st[5] or '', tonumber(st[6] or '0')}
