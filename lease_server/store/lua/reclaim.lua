-- reclaim.lua: take back a warned idle lease whose grace has run out. Atomic against release,
-- renew and keep: a lease released or kept in the meantime is left alone, and the GPUs of a
-- newer grant (another token) are never touched.
-- KEYS: nodes alive free fit pool_free holders sliced slice_fit draining leases deadlines ended ended_at queue waiters wait_due waiting_by usage fence events grants bookings booking_occ booking_due recall lease_util ledger held_by sched elastic shrink_due victims evict_miss
-- ARGV[6] = lease id   ARGV[7] = token   ARGV[8] = evidence JSON (samples up to now)
-- returns {OK, ended JSON} | {NO_SUCH} | {STALE} | {NOT_DUE}
local id, token = ARGV[6], ARGV[7]
local raw = redis.call('HGET', K_LEASES, id)
if not raw then return {NO_SUCH} end
local lease = cjson.decode(raw)
if tostring(lease.token) ~= token then return {STALE} end
if not lease.reclaim_at or lease.reclaim_at > NOW then return {NOT_DUE} end
local evidence = cjson.decode(ARGV[8])
lease.idle_evidence = evidence
local idle_min = math.floor((evidence.idle_s or 0) / 60)
local idle_for = 'its GPUs were idle for ' .. idle_min .. ' min'
local ended, ended_json = end_lease(lease, 'revoked', 'reclaimed: ' .. idle_for ..
  ' and the owner did not keep it within the grace period', 'reclaimer', nil, nil, 'reclaimed', idle_for)
emit('reclaimed', {lease = id, user = lease.user, pool = lease.pool, node = lease.node,
                   gpus = ended.gpus, label = lease.label, session = lease.session, evidence = evidence})
dispatch(lease.pool)
return {OK, ended_json}
