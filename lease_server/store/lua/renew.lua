-- renew.lua: extend a live lease. The fencing token must match: a client holding an old grant
-- (for example one that was paused past its deadline while the lease expired) cannot revive it.
-- A lease already past its deadline but not yet swept is expired here, not renewed: its GPUs
-- were free to be taken from the moment the deadline passed.
-- KEYS: nodes alive free fit pool_free holders sliced slice_fit draining leases deadlines ended ended_at queue waiters wait_due waiting_by usage fence events grants bookings booking_occ booking_due recall lease_util ledger held_by sched elastic shrink_due victims evict_miss
-- ARGV[6] = lease id   ARGV[7] = token   ARGV[8] = user   ARGV[9] = "1" if admin
-- ARGV[10] = new ttl ms, or 0 to keep the lease's own ttl
-- ARGV[11] = the holder's activity as JSON ({"executing": true, ...}) or "" (an idle-score signal)
-- returns {OK, lease JSON} | {NO_SUCH} | {ENDED, ended JSON} | {NOT_OWNER} | {STALE} | {EXPIRED, JSON}
local id, token, user, admin, ttl_ms = ARGV[6], ARGV[7], ARGV[8], ARGV[9], tonumber(ARGV[10])
local lease, raw, e = owned_lease(id, token, user, admin == '1', true)
if not lease then
  if e and e.state == 'expired' and not string.find(e.end_reason or '', '(warm_max)', 1, true) then
    emit('renew_miss', {lease = id, user = e.user, late_ms = NOW - e.expires_at})
  end
  return raw
end
if lease.expires_at < NOW and (not lease.warm_until or lease.warm_until > NOW) then
  emit('renew_miss', {lease = id, user = lease.user, late_ms = NOW - lease.expires_at})  -- (warm_max is no miss)
end
local expired = expire_if_due(lease, raw, true)
if expired then return expired end
if ttl_ms == 0 then ttl_ms = lease.ttl_ms end
lease.expires_at = NOW + ttl_ms
if lease.warm_until and lease.expires_at > lease.warm_until then  -- warm_max: kept warm no longer
  lease.expires_at = lease.warm_until
end
lease.ttl_ms = ttl_ms
lease.renewed_at = NOW
lease.renewals = lease.renewals + 1
if ARGV[11] and ARGV[11] ~= '' then
  lease.activity = cjson.decode(ARGV[11])
  lease.activity_at = NOW
end
redis.call('HSET', K_LEASES, id, cjson.encode(lease))
redis.call('ZADD', K_DEADLINES, lease.expires_at, id)
return {OK, cjson.encode(lease)}
