-- resize.lua: the owner grows or shrinks a live lease by k GPUs, on its own node. k > 0 adds k,
-- all or none, to an elastic lease (grow_lease in _lib_resize.lua says when that is allowed: never
-- when it would delay anyone); k < 0 gives back its -k highest-indexed GPUs (at least one stays: to
-- give back all, release), freed at once and offered to the pool's queue. A request to shrink
-- (ask_to_shrink in _lib_schedule.lua) is done with once the lease is down to its shrink_to. The
-- fencing token stays. A multi-node lease cannot resize (its nodes hold equal shares). A lease past
-- its deadline but not yet swept is expired here (as renew.lua does), not resized.
-- KEYS: nodes alive free fit pool_free holders sliced slice_fit draining leases deadlines ended ended_at queue waiters wait_due waiting_by usage fence events grants bookings booking_occ booking_due recall lease_util ledger held_by sched elastic shrink_due victims evict_miss
-- ARGV[6] = lease id   ARGV[7] = its fencing token   ARGV[8] = user   ARGV[9] = GPUs to add (> 0) or give back (< 0)
-- ARGV[10] = the GPUs the caller saw the lease hold ("" = not given). Given, a resent resize is
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
if k > 0 then return grow_lease(lease, k) end
if lease.nodes then return {BUSY, 'a multi-node lease cannot shrink; release it instead'} end
if -k >= #lease.gpus then
  return {BUSY, 'the lease has ' .. #lease.gpus .. ' GPU(s), and one must stay: to give back all of them, release it'}
end
shrink_lease(lease, -k, 'given back by its owner', user)
-- The freed GPUs go to the queue now. (The record is read again: dispatch may ask it to shrink more.)
dispatch(lease.pool)
return {OK, redis.call('HGET', K_LEASES, id)}
