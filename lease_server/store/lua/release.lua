-- release.lua: end a lease (owner release, or admin revoke), or withdraw a request still queued.
-- Idempotent: releasing an ended lease answers with its ended record and changes nothing.
-- KEYS: nodes alive free fit pool_free holders sliced slice_fit draining leases deadlines ended ended_at queue waiters wait_due waiting_by usage fence events grants bookings booking_occ booking_due recall lease_util ledger held_by sched elastic shrink_due victims evict_miss
-- ARGV[6] = lease id   ARGV[7] = token ("" = not given: ownership alone suffices)
-- ARGV[8] = user       ARGV[9] = "1" if admin
-- ARGV[10] = end state: "released", "revoked", or "auto" (revoked when an admin ends another
--           user's lease, released otherwise)
-- ARGV[11] = reason (for "auto", the reason used when it turns out to be a revoke is ARGV[12])
-- ARGV[13] = reason of a withdrawal ("" or absent: "withdrawn by its owner" / "by admin USER")
-- ARGV[14] = "1" if the caller saw every process the lease named gone (the magic's verified
--            release): its GPUs are free at once; otherwise an owner's release drains the GPUs
--            on which the lease named a process (a revoke drains them all)
-- returns {OK, ended JSON} | {ENDED, ended JSON} | {REMOVED, position it had, waiter JSON}
--       | {NO_SUCH} | {NOT_OWNER} | {STALE}
local id, token, user, admin, state, reason = ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11]
local lease, raw = owned_lease(id, token, user, admin == '1', true)
if not lease and raw[1] == NO_SUCH then
  -- Still queued: withdraw it. Queue removal and the grant (dispatch) both run inside scripts, so
  -- either the grant came first (the lease branch below releases it) or it can never come: the
  -- waiter is gone from the queue before any later dispatch looks. A token cannot name a request
  -- that holds nothing yet, so it is not checked here.
  local wraw = redis.call('HGET', K_WAITERS, id)
  if not wraw then return {NO_SUCH} end
  local w = cjson.decode(wraw)
  if w.user ~= user and admin ~= '1' then return {NOT_OWNER} end
  local why = ARGV[13] or ''
  if why == '' then
    if w.user == user then why = 'withdrawn by its owner' else why = 'withdrawn by admin ' .. user end
  end
  local position = redis.call('ZLEXCOUNT', K_QUEUE, '[' .. w.pool .. '|', '[' .. w.member)
  redis.call('ZREM', K_QUEUE, w.member)
  redis.call('HDEL', K_WAITERS, id)
  redis.call('ZREM', K_WAIT_DUE, id)
  -- a waiter gone: the node held for it, if it was the head, may serve another (blocked_memo)
  redis.call('HDEL', K_EVICT_MISS, w.pool .. '|~blocked')
  count_waiting(w.user, -1)
  emit('wait_cancelled', {lease = id, user = w.user, pool = w.pool, gpus = w.gpus,
                          waited_ms = NOW - w.enqueued_at, reason = why, by = user})
  -- Wake the request blocked on this id (its server finds the waiter gone and says so).
  redis.call('PUBLISH', K_GRANTS, id)
  -- The waiter may have been the blocked head holding a node back: serve the others now.
  dispatch(w.pool)
  w.reason = why
  w.by = user
  return {REMOVED, position, cjson.encode(w)}
end
if not lease then return raw end
if state == 'auto' then
  if lease.user ~= user then state, reason = 'revoked', ARGV[12] else state = 'released' end
end
local drain = state ~= 'released' and 'all' or (ARGV[14] ~= '1' and 'named' or false)
local _, ended_json = end_lease(lease, state, reason, user, raw, drain, state, ARGV[13] or '')
dispatch(lease.pool)
return {OK, ended_json}
