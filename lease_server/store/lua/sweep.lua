-- sweep.lua: the reaper. Expires leases past their deadline, marks nodes whose heartbeat ran out
-- as down, drops waiters whose server went away, trims old ended records, then serves the queues
-- of every pool it touched. Bounded work per call; the caller repeats while it returns work done.
-- KEYS: nodes alive free fit pool_free holders sliced slice_fit draining leases deadlines ended ended_at queue waiters wait_due waiting_by usage fence events grants bookings booking_idx booking_due booking_occ booking_own recall lease_util ledger rollup rollup_idx rollup_at held_by sched elastic shrink_due victims evict_miss
-- ARGV[6] = most items of each kind handled in this call
-- ARGV[7] = grace ms after a waiter's own deadline before the sweeper removes it
-- It also revokes borrowed leases whose recall notice ran out, releases bookings nobody used
-- within their first no_show_ms (the owner is told through the event log), and shrinks elastic
-- leases asked to give GPUs back for a waiting request (shrink_notice) that did not by shrink_by.
-- It first folds the ledger lines written since the last sweep into the hourly rollups
-- (fold_rollups, _lib_end.lua), and last, those of the leases it ended.
-- returns {OK, expired, nodes marked down, stale waiters removed, ended records trimmed,
--          borrowed leases revoked, booking checks done, elastic leases shrunk, ledger lines folded}
local limit, grace = tonumber(ARGV[6]), tonumber(ARGV[7])
local pools, expired, down, stale, trimmed, recalled, checked, shrunk = {}, 0, 0, 0, 0, 0, 0, 0
local folded = fold_rollups(limit)

for _, id in ipairs(redis.call('ZRANGEBYSCORE', K_RECALL, '-inf', NOW, 'LIMIT', 0, limit)) do
  local raw = redis.call('HGET', K_LEASES, id)
  if raw then
    local lease = cjson.decode(raw)
    end_lease(lease, 'revoked', lease.recall_reason or 'recalled for a booking', 'server', raw, nil,
              lease.recall_code or 'recalled', lease.recall_why)
    pools[lease.pool] = true
  else
    redis.call('ZREM', K_RECALL, id)
  end
  recalled = recalled + 1
end

for _, id in ipairs(redis.call('ZRANGEBYSCORE', K_BOOKING_DUE, '-inf', NOW, 'LIMIT', 0, limit)) do
  local raw = redis.call('HGET', K_BOOKINGS, id)
  local r = raw and cjson.decode(raw)
  if r and r.leases and leave_booking(r, false) then
    -- an occurrence that served leases ended: they go on as ordinary leases (its other checks,
    -- due as well, come at the next sweep)
    schedule_booking(r)
    save_booking(r)
    pools[r.pool] = true
  elseif r and r.state == 'active' and (r.check_k or 0) < r.occurrences then
    local k = r.check_k or 0
    local s, e = occ_span(r, k)
    local deadline = math.max(s, r.base_at or s) + r.no_show_ms
    if deadline <= NOW then
      r.used, r.released = r.used or {}, r.released or {}
      if deadline < e and not r.used[tostring(k)] and (r.held or 0) == 0 then
        r.released[tostring(k)] = NOW
        unindex_occurrence(r, k)
        emit('reservation_no_show', {id = r.id, owner = r.owner, pool = r.pool, gpus = r.gpus, k = k,
                                     start = s, ['end'] = e, no_show_ms = r.no_show_ms})
        pools[r.pool] = true
      end
      r.check_k = k + 1
    end
    schedule_booking(r)
    save_booking(r)
  else
    redis.call('ZREM', K_BOOKING_DUE, id)
    if r then
      redis.call('HDEL', K_BOOKINGS, id)
      redis.call('ZREM', K_BOOKING_IDX, r.pool .. '|' .. id)
      unindex_booking(r)
    end
  end
  checked = checked + 1
end

for _, id in ipairs(redis.call('ZRANGEBYSCORE', K_DEADLINES, '-inf', NOW - 1, 'LIMIT', 0, limit)) do
  local raw = redis.call('HGET', K_LEASES, id)
  if raw then
    local lease = cjson.decode(raw)
    end_lease(lease, 'expired', expiry_reason(lease), 'server', raw, nil, expiry_code(lease))
    pools[lease.pool] = true
  else
    redis.call('ZREM', K_DEADLINES, id)
  end
  expired = expired + 1
end

-- After the expiries: a lease that ended needs no shrinking (end_lease took it off shrink_due).
for _, id in ipairs(redis.call('ZRANGEBYSCORE', K_SHRINK_DUE, '-inf', NOW, 'LIMIT', 0, limit)) do
  local raw = redis.call('HGET', K_LEASES, id)
  local lease = raw and cjson.decode(raw)
  if lease and lease.shrink_to and #lease.gpus > lease.shrink_to then
    shrink_lease(lease, #lease.gpus - lease.shrink_to, 'shrink notice ran out', 'server')
    pools[lease.pool] = true
  else
    redis.call('ZREM', K_SHRINK_DUE, id)
  end
  shrunk = shrunk + 1
end

for _, node in ipairs(redis.call('ZRANGEBYSCORE', K_ALIVE, 0, NOW - 1, 'LIMIT', 0, limit)) do
  mark_down(node, 'no heartbeat')
  down = down + 1
end

-- Waiters whose server went away: their own deadline passed by more than the grace, and nothing
-- took them out of the queue (their server would have, when the wait ran out). Read by deadline
-- (wait_due), not by reading the queue: a sweep's work does not grow with the queue.
for _, id in ipairs(redis.call('ZRANGEBYSCORE', K_WAIT_DUE, '-inf', NOW - grace - 1, 'LIMIT', 0, limit)) do
  redis.call('ZREM', K_WAIT_DUE, id)
  local raw = redis.call('HGET', K_WAITERS, id)
  if raw then
    local w = cjson.decode(raw)
    redis.call('ZREM', K_QUEUE, w.member)
    redis.call('HDEL', K_WAITERS, id)
    count_waiting(w.user, -1)
    redis.call('HDEL', K_EVICT_MISS, w.pool .. '|~blocked')  -- (a waiter gone: see blocked_memo)
    emit('wait_abandoned', {lease = id, user = w.user, pool = w.pool, gpus = w.gpus})
    pools[w.pool] = true
  end
  stale = stale + 1
end

for _, id in ipairs(redis.call('ZRANGEBYSCORE', K_ENDED_AT, '-inf', NOW - RETENTION_MS, 'LIMIT', 0, limit)) do
  redis.call('HDEL', K_ENDED, id)
  redis.call('ZREM', K_ENDED_AT, id)
  trimmed = trimmed + 1
end

for pool, _ in pairs(pools) do dispatch(pool) end
if folded < limit then folded = folded + fold_rollups(limit - folded) end
return {OK, expired, down, stale, trimmed, recalled, checked, shrunk, folded}
