-- idle_warn.lua: warn the holder of an idle lease; it is reclaimed at reclaim_at unless the
-- owner says "I'm still using it" (keep.lua) or releases it first. Warns once per idle period.
-- KEYS: leases events
-- ARGV[6] = lease id   ARGV[7] = token (the lease judged idle; a newer grant is not warned)
-- ARGV[8] = grace ms   ARGV[9] = evidence JSON (policy and samples behind the verdict)
-- returns {OK, lease JSON} | {NO_SUCH} | {STALE} | {WARNED} (already warned, or warm: nothing done)
local id, token, grace_ms = ARGV[6], ARGV[7], tonumber(ARGV[8])
local raw = redis.call('HGET', K_LEASES, id)
if not raw then return {NO_SUCH} end
local lease = cjson.decode(raw)
if tostring(lease.token) ~= token then return {STALE} end
if lease.reclaim_at or lease.warm_since then return {WARNED} end  -- (a warm lease is lendable, not idle)
local evidence = cjson.decode(ARGV[9])
lease.warned_at = NOW
lease.reclaim_at = NOW + grace_ms
lease.idle_evidence = evidence
redis.call('HSET', K_LEASES, id, cjson.encode(lease))
emit('idle_warning', {lease = id, user = lease.user, pool = lease.pool, node = lease.node,
                      label = lease.label, session = lease.session, reclaim_at = lease.reclaim_at / 1000,
                      grace_s = grace_ms / 1000, evidence = evidence})
return {OK, cjson.encode(lease)}
