-- warm.lua: the owner of a one-node lease keeps its worker warm between cells ("1"), or runs a
-- cell on it again ("0"). A warm lease is lendable: anyone who would otherwise wait evicts it
-- (dispatch, with the pool's warm_evict_notice), and it ends by itself warm_max after it went
-- warm (its deadline is capped there; renew.lua keeps the cap). Going warm serves the queue at
-- once, so a request already waiting evicts it in this same script. A slice goes warm as a whole
-- GPU does; it is lent as memory (_lib_slice.lua evict_for_slice) or, with every other slice of
-- its GPU warm too, as that whole GPU (recall).
-- KEYS: nodes alive free fit pool_free holders sliced slice_fit leases deadlines ended queue waiters wait_due waiting_by usage fence events grants bookings booking_occ booking_due recall lease_util held_by sched elastic shrink_due victims evict_miss
-- ARGV[6] = lease id   ARGV[7] = token ("" = not given: ownership alone suffices; the simulator's
-- replay, which drives leases by id)   ARGV[8] = user   ARGV[9] = "1": warm | "0": run again
-- returns {OK, lease JSON} | {NO_SUCH} | {ENDED, ended JSON} | {NOT_OWNER} | {STALE}
--       | {BUSY, why}: it cannot go warm (it spans nodes, is elastic, or is being recalled or
--         shrunk), or cannot run again (it is being evicted: release it and ask again)
local id, token, user, on = ARGV[6], ARGV[7], ARGV[8], ARGV[9] == '1'
local lease, raw = owned_lease(id, token, user)
if not lease then return raw end
if on then
  if lease.warm_since then return {OK, raw} end
  if lease.elastic then return {BUSY, 'an elastic lease'} end
  for _, g in ipairs(lease.gpus) do
    if (g.node or lease.node) ~= lease.node then return {BUSY, 'a lease that spans nodes'} end
  end
  if lease.recall_at or lease.shrink_to then return {BUSY, 'the lease is being recalled'} end
  warm_lease(lease)
  redis.call('HSET', K_LEASES, id, cjson.encode(lease))
  emit('warm', {lease = id, user = lease.user, pool = lease.pool, node = lease.node,
                gpus = (function() local t = {} for _, g in ipairs(lease.gpus) do t[#t + 1] = g.index end return t end)(),
                warm_until = lease.warm_until})
  dispatch(lease.pool)
  return {OK, redis.call('HGET', K_LEASES, id)}
end
if not lease.warm_since then return {OK, raw} end
if lease.recall_at then return {BUSY, 'the lease is being evicted'} end
local warm_s = (NOW - lease.warm_since) / 1000
cool_lease(lease)
lease.warm_cells = (lease.warm_cells or 0) + 1  -- a cell that started warm (the usage rollups count them)
lease.expires_at = NOW + lease.ttl_ms
redis.call('ZADD', K_DEADLINES, lease.expires_at, id)
local out = cjson.encode(lease)
redis.call('HSET', K_LEASES, id, out)
emit('resumed', {lease = id, user = lease.user, pool = lease.pool, node = lease.node, warm_s = warm_s})
return {OK, out}
