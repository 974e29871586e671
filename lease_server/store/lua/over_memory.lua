-- over_memory.lua: a node agent found a slice using more of its GPU's memory than it was promised
-- (lease_server/node/memwatch.py): warn its holder, or, once it stayed over past the pool's grace,
-- end it. Only the slice named is touched: its neighbours on the GPU run on. The ended slice drains
-- like any lease the server ends: its memory stays promised until its node agent has ended the
-- processes it claimed (never another's) and seen them gone.
-- KEYS: nodes alive free fit pool_free holders sliced slice_fit draining leases deadlines ended ended_at queue waiters wait_due waiting_by usage fence events grants bookings booking_occ booking_due recall lease_util ledger held_by sched elastic shrink_due victims evict_miss
-- ARGV[6] = lease id   ARGV[7] = its fencing token   ARGV[8] = node   ARGV[9] = "warn" | "end"
-- ARGV[10] = MB its processes use now   ARGV[11] = MB it was promised   ARGV[12] = its peak, MB
-- ARGV[13] = the slice that would have held the peak, MB   ARGV[14] = seconds it was over
-- ARGV[15] = the sentence people read (end_reason)   ARGV[16] = the plain reason (cause.why)
-- returns {OK[, ended JSON]} | {NO_SUCH} | {STALE} | {INVALID}: not a slice on that node
local id, token, node, what = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local raw = redis.call('HGET', K_LEASES, id)
if not raw then return {NO_SUCH} end
local lease = cjson.decode(raw)
if tostring(lease.token) ~= token then return {STALE} end
if not lease.gpu_mem_mb or lease.node ~= node then return {INVALID} end
local used, limit, peak, fit = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local over = {used_mb = used, limit_mb = limit, peak_mb = peak, fit_mb = fit, over_s = tonumber(ARGV[14])}
local body = {lease = id, user = lease.user, pool = lease.pool, node = node, gpu = lease.gpus[1].index,
              used_mb = used, gpu_mem_mb = limit, peak_mb = peak, fit_mb = fit}
if what == 'warn' then
  emit('over_memory_warning', body)
  return {OK}
end
lease.over_memory = over
local _, ended_json = end_lease(lease, 'revoked', ARGV[15], 'node agent', nil, 'all', 'over_memory', ARGV[16])
emit('over_memory', body)
dispatch(lease.pool)
return {OK, ended_json}
