-- claim_reap: claim the right to re-enqueue a run whose lease expired, once per lease
-- version.
--
-- A run stays in the expiry index while work remains; when its lease expired (or was
-- released for reaping) a reaper claims it here before enqueuing a job. The claim records
-- the lease version it was made for, so two reapers racing on the same expiry cannot both
-- enqueue it. A claim older than ARGV[1] may be taken again: that only happens when the
-- reaper that made it died between the claim and the enqueue (the run would otherwise
-- stay stranded); a second job for one run is harmless, because its lease decides.
--
-- KEYS[1]  lease hash  ratchet:{<run>}:lease
--
-- ARGV[1]  reclaim_after_ms: age after which an unfinished claim may be taken again (ms)
--
-- Replies:
--   {"claimed", lease_version, now_ms}
--   {"live", owner, lease_version, expires_at_ms, now_ms}   the lease is held and unexpired
--   {"already", lease_version, claimed_at_ms, now_ms}        claimed for this version already
--   {"no_run"}
--
-- Time: *_ms values are Redis server time, milliseconds since the epoch.

if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'no_run'}
end

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cur = redis.call('HMGET', KEYS[1], 'owner', 'lease_version', 'expires_at_ms',
                       'reaped_version', 'reaped_at_ms')
local owner = cur[1] or ''
local version = tonumber(cur[2] or '0')
local expires = tonumber(cur[3] or '0')
local reaped_version = tonumber(cur[4] or '-1')
local reaped_at = tonumber(cur[5] or '0')

if owner ~= '' and expires > now_ms then
  return {'live', owner, version, expires, now_ms}
end
if reaped_version == version and now_ms - reaped_at < tonumber(ARGV[1]) then
  return {'already', version, reaped_at, now_ms}
end

redis.call('HSET', KEYS[1], 'reaped_version', version, 'reaped_at_ms', now_ms)
return {'claimed', version, now_ms}
