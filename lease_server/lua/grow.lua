-- grow.lua: add k GPUs to the owner's live elastic lease, all or none, on its own node: the k lowest
-- free indexes. Only when taking them delays no one and breaks no rule a grant keeps: nobody waits
-- in the pool (growing never jumps a waiter), no booking is in force there, the lease is neither a
-- booking's, borrowed, preemptible, recalled nor asked to shrink, its node is up and has k free
-- GPUs, it stays within the elastic maximum it asked for and its user within quota. Otherwise
-- nothing changes and the reason is returned. The fencing token stays: the same holder now has more.
-- A lease past its deadline but not yet swept is expired here (as renew.lua does), not grown.
-- KEYS: nodes alive free fit holders draining leases deadlines ended ended_at queue waiters waiting_by usage fence events grants resv resv_idx recall lease_util ledger held_by sched elastic shrink_due
-- ARGV[6] = lease id   ARGV[7] = its fencing token   ARGV[8] = user   ARGV[9] = GPUs to add (int >= 1)
-- ARGV[10] = the GPUs the caller saw the lease hold ("" = not given). Given, a resent grow is
--            harmless: a lease already at that size + k answers as done, any other size is refused
-- returns {OK, lease JSON} | {BUSY, why not} | {NO_SUCH} | {ENDED, ended JSON} | {EXPIRED, ended JSON}
--       | {NOT_OWNER} | {STALE}
local id, token, user, k = ARGV[6], ARGV[7], ARGV[8], tonumber(ARGV[9])
local seen = tonumber(ARGV[10] or '')
local lease, raw = owned_lease(id, token, user)
if not lease then return raw end
local expired = expire_if_due(lease, raw)
if expired then return expired end
if seen and #lease.gpus == seen + k then return {OK, raw} end  -- done already (a resend)
if seen and #lease.gpus ~= seen then
  return {BUSY, 'the lease holds ' .. #lease.gpus .. ' GPU(s), not the ' .. seen .. ' the request saw'}
end
local n, pool, node = #lease.gpus, lease.pool, lease.node
if not lease.elastic then
  return {BUSY, 'the lease is not elastic: only a lease acquired with gpus_min below gpus can grow'}
end
if lease.nodes then return {BUSY, 'a multi-node lease cannot grow'} end
if n + k > lease.elastic.max then
  return {BUSY, 'it would hold ' .. (n + k) .. ' GPUs, above the ' .. lease.elastic.max .. ' it asked for at most'}
end
if lease.recall_at or redis.call('ZSCORE', K_RECALL, id) then return {BUSY, 'the lease is being recalled'} end
if lease.shrink_to then
  return {BUSY, 'the lease was asked to shrink to ' .. lease.shrink_to .. ' GPU(s) for a waiting request'}
end
if lease.resv or lease.borrowed or lease.preemptible then
  return {BUSY, 'the lease is a booking\'s, borrowed or preemptible'}
end
if tonumber(redis.call('ZSCORE', K_ALIVE, node) or '-1') < NOW then return {BUSY, 'the node is down'} end
if redis.call('ZRANGEBYLEX', K_QUEUE, '[' .. pool .. '|', '(' .. pool .. '|~', 'LIMIT', 0, 1)[1] then
  return {BUSY, 'a request waits in the pool, and growing would take GPUs before it'}
end
if #active_bookings(pool) > 0 then return {BUSY, 'a booking is in force in the pool'} end
local inv = redis.call('HGET', K_NODES, node)
if not inv then return {BUSY, 'the node left'} end
local free = decode_list(redis.call('HGET', K_FREE, node))
if #free < k then return {BUSY, 'its node ' .. node .. ' has ' .. #free .. ' free GPU(s)'} end
if not within_quota(lease, pool, k) then return {BUSY, 'it would take you above your quota of the pool'} end

table.sort(free)
local taken, rest = {}, {}
for i, idx in ipairs(free) do
  if i <= k then taken[#taken + 1] = idx else rest[#rest + 1] = idx end
end
-- Invariant guard, as in grant_parts: a free GPU never has a holder.
for _, idx in ipairs(taken) do
  if redis.call('HEXISTS', K_HOLDERS, node .. '/' .. idx) == 1 then
    error('invariant broken: free GPU ' .. node .. '/' .. idx .. ' has a holder')
  end
end
local uuid_of = inv_uuids(inv, taken)
mark_resize(lease)
for _, idx in ipairs(taken) do
  redis.call('HSET', K_HOLDERS, node .. '/' .. idx, id)
  lease.gpus[#lease.gpus + 1] = {index = idx, uuid = uuid_of[idx] or ''}
end
set_free(node, pool, rest, #free)
count_held_k(lease, k)
touch_usage(pool, user, k, 0)
local lease_json = cjson.encode(lease)
redis.call('HSET', K_LEASES, id, lease_json)
emit('grown', {lease = id, user = user, pool = pool, node = node, gpus = taken, size = #lease.gpus,
               token = lease.token})
return {OK, lease_json}
