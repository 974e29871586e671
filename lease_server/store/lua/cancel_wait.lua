-- cancel_wait.lua: a waiter gives up (its wait ran out or its client went away).
-- A grant that raced ahead of the cancel wins: the caller gets the lease and must use or release it.
-- KEYS: nodes alive free fit pool_free holders sliced slice_fit leases deadlines queue waiters wait_due waiting_by usage fence events grants bookings booking_occ booking_due recall held_by sched elastic shrink_due victims evict_miss
-- ARGV[6] = waiter / lease id     ARGV[7] = reason ("timeout" | "cancelled")
-- ARGV[8] = user: only the request's own user may cancel it
-- returns {OK, lease JSON} (granted meanwhile) | {REMOVED, position it had} | {NO_SUCH} | {NOT_OWNER}
local id, reason, user = ARGV[6], ARGV[7], ARGV[8]
local lease = redis.call('HGET', K_LEASES, id)
if lease then
  if cjson.decode(lease).user ~= user then return {NOT_OWNER} end
  return {OK, lease}
end
local raw = redis.call('HGET', K_WAITERS, id)
if not raw then return {NO_SUCH} end
local w = cjson.decode(raw)
if w.user ~= user then return {NOT_OWNER} end
local position = redis.call('ZLEXCOUNT', K_QUEUE, '[' .. w.pool .. '|', '[' .. w.member)
redis.call('ZREM', K_QUEUE, w.member)
redis.call('HDEL', K_WAITERS, id)
redis.call('ZREM', K_WAIT_DUE, id)
-- a waiter gone: the node held for it, if it was the head, may serve another (blocked_memo)
redis.call('HDEL', K_EVICT_MISS, w.pool .. '|~blocked')
count_waiting(w.user, -1)
emit('wait_' .. reason, {lease = id, user = w.user, pool = w.pool, gpus = w.gpus,
                         waited_ms = NOW - w.enqueued_at})
-- The waiter may have been the blocked head holding a node back: serve the others now.
dispatch(w.pool)
return {REMOVED, position}
