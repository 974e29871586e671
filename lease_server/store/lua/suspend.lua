-- suspend.lua: the owner of a warm lease hands it back with its worker suspended, not ended: the
-- lease ends (released, cause "suspended") and its GPU drains as a suspend (state "suspend"): the
-- node agent suspends the one process that claimed the lease off the GPU (its GPU state to host
-- memory: lease_server/node/suspend.py), sees the GPU clean of it, and reports it (drained.lua,
-- which records the suspended worker and serves the queue). A node whose agent cannot suspend,
-- or a lease that is not a one-GPU warm lease with exactly one claimed process, is refused: its
-- owner ends the worker and releases as before. The worker stays suspended until its notebook's
-- next cell restores it under a new lease, or warm_max after it went warm (the same cap as warm).
-- KEYS: nodes alive free fit pool_free holders sliced slice_fit draining leases deadlines ended ended_at queue waiters wait_due waiting_by usage fence events grants bookings booking_occ booking_due recall lease_util ledger held_by sched elastic shrink_due victims evict_miss
-- ARGV[6] = lease id   ARGV[7] = token   ARGV[8] = user
-- returns {OK, ended JSON} | {NO_SUCH} | {ENDED, ended JSON} | {NOT_OWNER} | {STALE}
--       | {BUSY, why}: not suspended (end the worker and release)
local id, token, user = ARGV[6], ARGV[7], ARGV[8]
local lease, raw = owned_lease(id, token, user)
if not lease then return raw end
if not lease.warm_since then return {BUSY, 'only a warm lease is suspended (its cell still runs)'} end
if lease.gpu_mem_mb then return {BUSY, 'a slice is not suspended'} end
if #lease.gpus ~= 1 then return {BUSY, 'only a one-GPU lease is suspended'} end
local node = lease.node
local inv_raw = redis.call('HGET', K_NODES, node)
if not inv_raw or not string.find(inv_raw, '"suspend":"', 1, true) then
  return {BUSY, 'the node agent of ' .. node .. ' cannot suspend GPU state'}
end
local claimed = 0
for _, p in ipairs(lease.procs or {}) do
  if (p.node or node) == node then claimed = claimed + 1 end
end
if claimed ~= 1 then return {BUSY, claimed .. ' processes claimed it (one is suspended)'} end
lease.suspend_until = lease.warm_until
local _, ended_json = end_lease(lease, 'released', 'suspended to host memory', user, nil, 'named', 'suspended')
dispatch(lease.pool)
return {OK, ended_json}
