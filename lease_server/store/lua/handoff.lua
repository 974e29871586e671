-- handoff.lua: end a lease and, in the same step, grant its GPUs to its owner's next queued request
-- (a sweep's next trial), so that the worker process already on those GPUs can run that request
-- too instead of a fresh one starting. Only when releasing could not have given the GPUs to anyone
-- else: every waiter of the pool is this user's (read at most as deep as the user has requests
-- queued, up to max_queued_per_user, and never when the pool holds more waiters than that), the pool's oldest waiter
-- is one of the requests named, it fits in exactly the lease's GPUs on one node, no booking is in force in the pool, the
-- lease is neither a booking's nor recalled, and its node is up. Otherwise nothing changes: the
-- caller ends its process and releases as usual, and the scheduler decides.
-- KEYS: nodes alive free fit pool_free holders sliced slice_fit draining leases deadlines ended ended_at queue waiters wait_due waiting_by usage fence events grants bookings booking_occ booking_due recall lease_util ledger held_by sched elastic shrink_due victims evict_miss
-- ARGV[6] = lease id   ARGV[7] = its fencing token   ARGV[8] = user
-- ARGV[9] = the requests it may go to, comma-separated (the pool's oldest waiter must be one of them)
-- returns {OK, ended JSON, new lease JSON} | {BUSY, why not} | {NO_SUCH} | {ENDED, ended JSON}
--       | {NOT_OWNER} | {STALE}
local id, token, user, named = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local lease, raw = owned_lease(id, token, user)
if not lease then return raw end
local lo, hi = '[' .. lease.pool .. '|', '(' .. lease.pool .. '|~'
local first = redis.call('ZRANGEBYLEX', K_QUEUE, lo, hi, 'LIMIT', 0, 1)[1]
if not first then return {BUSY, 'no request of yours is queued'} end
-- More waiters in the pool than the user has queued anywhere: someone else waits (no need to read them).
if redis.call('ZLEXCOUNT', K_QUEUE, lo, hi) > tonumber(redis.call('HGET', K_WAITING_BY, user) or '0') then
  return {BUSY, 'another user waits in the pool'}
end
local to = string.match(first, '|([^|]+)$')
local listed = false
for r in string.gmatch(named, '[^,]+') do
  if r == to then listed = true end
end
if not listed then return {BUSY, 'the oldest request waiting in the pool is not one of those named'} end
local wraw = redis.call('HGET', K_WAITERS, to)
if not wraw then return {BUSY, 'request ' .. to .. ' is not queued'} end
local w = cjson.decode(wraw)
if w.user ~= user or w.pool ~= lease.pool then return {BUSY, 'request ' .. to .. ' is not yours in this pool'} end
local n = #lease.gpus
if lease.gpu_mem_mb or w.gpu_mem_mb then return {BUSY, 'a slice of a GPU is not handed on'} end
if lease.nodes or (w.nodes or 1) > 1 or n > w.gpus or n < (w.gpus_min or w.gpus) then
  return {BUSY, 'the request does not fit in exactly these GPUs'}
end
if lease.resv or lease.borrowed or lease.recall_at or redis.call('ZSCORE', K_RECALL, id) then
  return {BUSY, 'the lease is a booking\'s, borrowed or recalled'}
end
if tonumber(redis.call('ZSCORE', K_ALIVE, lease.node) or '-1') < NOW then return {BUSY, 'the node is down'} end
-- (at most the user's own queued requests, read 64 at a time: the count above bounds them)
local from = lo
while true do
  local members = redis.call('ZRANGEBYLEX', K_QUEUE, from, hi, 'LIMIT', 0, 64)
  for _, m in ipairs(members) do
    local other = redis.call('HGET', K_WAITERS, string.match(m, '|([^|]+)$'))
    if other and string.match(other, '"user":"([^"\\]*)"') ~= user then
      return {BUSY, 'another user waits in the pool'}
    end
  end
  if #members < 64 then break end
  from = '(' .. members[#members]
end
if #active_bookings(lease.pool) > 0 then return {BUSY, 'a booking is in force in the pool'} end
local indexes = {}
for _, g in ipairs(lease.gpus) do indexes[#indexes + 1] = g.index end
local inv = redis.call('HGET', K_NODES, lease.node)
if not inv then return {BUSY, 'the node left'} end
local present = inv_present(inv, indexes)
for _, idx in ipairs(indexes) do
  if not present[idx] then return {BUSY, 'a GPU of the lease left the inventory'} end
end

local _, ended_json = end_lease(lease, 'released', "handed to " .. to .. ", its owner's next request", user, raw, nil,
                                'handed')
local free = decode_list(redis.call('HGET', K_FREE, lease.node))
local mine, taken, rest = {}, {}, {}
for _, idx in ipairs(indexes) do mine[idx] = true end
for _, idx in ipairs(free) do
  if mine[idx] then taken[#taken + 1] = idx else rest[#rest + 1] = idx end
end
local _, lease_json = grant(w, lease.node, taken, rest, #free)
redis.call('ZREM', K_QUEUE, w.member)
redis.call('HDEL', K_WAITERS, w.id)
redis.call('ZREM', K_WAIT_DUE, w.id)
redis.call('HDEL', K_EVICT_MISS, w.pool .. '|~blocked')  -- (a waiter gone: see blocked_memo)
count_waiting(w.user, -1)
redis.call('PUBLISH', K_GRANTS, w.id)
dispatch(lease.pool)
return {OK, ended_json, lease_json}
