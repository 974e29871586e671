-- acquire.lua: ask for GPUs; granted at once, queued, or refused.
-- KEYS: nodes alive free fit pool_free sizes holders sliced slice_fit leases deadlines ended queue waiters wait_due waiting_by usage fence events grants queue_seq bookings booking_occ booking_due recall held_by sched elastic shrink_due victims evict_miss
-- ARGV[6] = lease id (chosen by the caller; it is also the waiter id while queued)
-- ARGV[7] = user      ARGV[8] = pool      ARGV[9] = gpus (int >= 1)     ARGV[10] = ttl ms
-- ARGV[11] = wait ms (0: do not queue)   ARGV[12] = label    ARGV[13] = session
-- ARGV[14] = the user's teams, comma-separated (a "team:NAME" booking serves its members)
-- ARGV[15] = priority class (integer, higher first under the "priority" scheduler; 1 = normal)
-- ARGV[16] = the fewest GPUs the request accepts (= gpus unless elastic: granted min..gpus)
-- ARGV[17] = nodes: 1, or k > 1 for a gang of gpus / k GPUs on each of k nodes, all or nothing
-- ARGV[18] = the notebook the request comes from ("" if unknown)   ARGV[19] = the cell: its number, or a hash ("")
-- ARGV[20] = the most requests one user may have in the queue at once (a request that waits
--            beyond it is refused: {LIMIT, requests the user has queued})
-- ARGV[21] = a slice: MB of one GPU's memory (0 or "": whole GPUs). Only in a pool that shares
--            (sched_of(pool).share), with gpus = 1; rounded up to the pool's slice_unit_mb
-- ARGV[22] = a node to take the GPUs on if it has them free (allocate_preferred; "": none). Only for
--            whole GPUs on one node
-- ARGV[23] = ms after the grant by which the holder means to end the lease (a cell's --timeout;
--            0 or "": none declared). Not enforced: others' wait estimates count on it (lease.ends_by)
-- returns {OK, lease JSON} | {QUEUED, position} |
--         {BUSY, most free GPUs on one node, 1 if a booking of the user's is lent out else 0} |
--         {UNKNOWN_POOL} | {DUPLICATE} | {LIMIT, queued} |
--         {UNSATISFIABLE, largest node size, nodes that could hold a gang's share (0 unless a gang)[, the
--          pool's nodes (not a gang)]}
--         when no node (or too few nodes, for a gang) could ever serve the request |
--         {INVALID, "share"} for a slice in a pool that does not share |
--         {INVALID, "memory", MB of one GPU of the pool} for a slice larger than that
local id, user, pool = ARGV[6], ARGV[7], ARGV[8]
local n, ttl_ms, wait_ms = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local priority, n_min = tonumber(ARGV[15] or '1') or 1, tonumber(ARGV[16] or '') or tonumber(ARGV[9])
local n_nodes = tonumber(ARGV[17] or '1') or 1
local max_queued = tonumber(ARGV[20] or '') or 256

if redis.call('HEXISTS', K_LEASES, id) == 1 or redis.call('HEXISTS', K_WAITERS, id) == 1
    or redis.call('HEXISTS', K_ENDED, id) == 1 then
  return {DUPLICATE}
end
local w = {id = id, user = user, pool = pool, gpus = n, ttl_ms = ttl_ms, label = ARGV[12],
           session = ARGV[13], teams = ARGV[14] or '', enqueued_at = NOW, deadline = NOW + wait_ms,
           notebook = ARGV[18] or '', cell = ARGV[19] or '',
           priority = priority, gpus_min = n_min, nodes = n_nodes}
if (ARGV[22] or '') ~= '' then w.prefer = ARGV[22] end
if (tonumber(ARGV[23] or '') or 0) > 0 then w.ends_ms = tonumber(ARGV[23]) end

-- A slice: refused (changing nothing) unless the pool shares and one of its GPUs has that much
-- memory; its size is rounded up to the pool's unit (at most the whole GPU's memory).
local mem = tonumber(ARGV[21] or '') or 0
local sched = sched_of(pool)
if mem > 0 then
  local gpu_mb = pool_gpu_mb(pool)
  if gpu_mb == 0 then return {UNKNOWN_POOL} end
  if not sched.share then return {INVALID, 'share'} end
  if mem > gpu_mb then return {INVALID, 'memory', gpu_mb} end
  local unit = math.max(1, sched.slice_unit_mb)
  w.gpu_mem_mb = math.min(gpu_mb, math.ceil(mem / unit) * unit)
end

-- Fast path: nobody is waiting in this pool, so taking free GPUs delays no one. With a booking
-- in force the request is served from it (its holder), or takes GPUs the bookings do not need, or
-- else borrows them -- the same decision dispatch makes, without a trip through the queue.
local queue_empty = not redis.call('ZRANGEBYLEX', K_QUEUE, '[' .. pool .. '|', '(' .. pool .. '|~', 'LIMIT', 0, 1)[1]
-- Backfill without the queue: the pool's queue is known blocked (blocked_memo: every waiter read,
-- none could be served, nothing since that could serve one), and this request needs fewer GPUs
-- than any waiter. Where it fits outside the node held for the head, dispatch would grant it there
-- after finding the others blocked again: grant it at once, without ordering the queue. Only a
-- plain request of one node, no booking in force, from a user with nothing queued (whose requests
-- would be ordered after their first four).
if not queue_empty and not w.gpu_mem_mb and n_nodes == 1 and n_min == n
    and not redis.call('HGET', K_WAITING_BY, user) and #active_bookings(pool) == 0 then
  local least, held = blocked_memo(pool)
  if least and n < least then
    local node, taken, rest, old_count = allocate(pool, n, held ~= '' and held or nil)
    if node then return {OK, select(2, grant(w, node, taken, rest, old_count))} end
  end
end
if queue_empty then
  if w.gpu_mem_mb then
    local _, owed = active_bookings(pool)
    local parts = slice_parts(w, pool, owed, sched, nil)
    if parts then return {OK, select(2, grant_parts(w, parts))} end
  elseif n_nodes > 1 then
    if #active_bookings(pool) == 0 then
      local parts = allocate_gang(pool, n / n_nodes, n_nodes, nil)
      if parts then return {OK, select(2, grant_parts(w, parts))} end
    end
  else
    local acts, owed = active_bookings(pool)
    local a = #acts > 0 and booking_for(acts, w) or nil
    local node, taken, rest, old_count
    if a then
      node, taken, rest, old_count = allocate(pool, n, nil)
    else
      node, taken, rest, old_count = allocate_for(w, pool, nil)
    end
    if node then
      if a then
        w.booking = a
      elseif owed > 0 and pool_free(pool) - #taken < owed then
        w.borrowed = true
      end
      return {OK, select(2, grant(w, node, taken, rest, old_count))}
    end
  end
end

local largest = redis.call('ZREVRANGEBYLEX', K_SIZES, '(' .. pool .. '|~', '[' .. pool .. '|', 'LIMIT', 0, 1)[1]
if not largest then return {UNKNOWN_POOL} end
local size = tonumber(string.match(largest, '^[^|]+|(%d+)|'))
if n_nodes > 1 then
  local per = n / n_nodes
  local able = redis.call('ZLEXCOUNT', K_SIZES, '[' .. pool .. '|' .. string.format('%05d', per) .. '|',
                          '(' .. pool .. '|~')
  if able < n_nodes then return {UNSATISFIABLE, size, able} end
elseif n_min > size then  -- (and how many nodes the pool has: a gang's advice only where it has several)
  return {UNSATISFIABLE, size, 0, redis.call('ZLEXCOUNT', K_SIZES, '[' .. pool .. '|', '(' .. pool .. '|~')}
elseif n > size then
  w.gpus, n = size, size  -- elastic: no node could give more than its size
end

-- Every request goes through the queue, so a newcomer never jumps waiters it would delay:
-- dispatch grants it now only if it is first in fair-share order or fits beside the blocked head.
-- The next arrival number; it is only taken (stored) if the request stays in the queue, so a
-- request refused at once leaves Redis exactly as it found it.
local seq = tonumber(redis.call('GET', K_QUEUE_SEQ) or '0') + 1
local member = pool .. '|' .. string.format('%015d', seq) .. '|' .. id
w.member, w.seq = member, seq
if wait_ms > 0 then  -- a request that would stay in the queue: within the user's cap
  local waiting = tonumber(redis.call('HGET', K_WAITING_BY, user) or '0')
  if waiting >= max_queued then return {LIMIT, waiting} end
end
redis.call('ZADD', K_QUEUE, 0, member)
redis.call('HSET', K_WAITERS, id, cjson.encode(w))
-- a new waiter: the queue is read again (blocked_memo), and the memo as it was is put back if this
-- request leaves at once having changed nothing (wait 0, nothing granted)
local blocked_was = redis.call('HGET', K_EVICT_MISS, pool .. '|~blocked')
redis.call('HDEL', K_EVICT_MISS, pool .. '|~blocked')
count_waiting(user, 1)
local served = dispatch(pool)

local lease = redis.call('HGET', K_LEASES, id)
if lease then return {OK, lease} end
if wait_ms <= 0 then
  redis.call('ZREM', K_QUEUE, member)
  redis.call('HDEL', K_WAITERS, id)
  count_waiting(user, -1)
  if served == 0 then  -- refused, and nothing else changed: the store as this request found it
    if blocked_was then
      redis.call('HSET', K_EVICT_MISS, pool .. '|~blocked', blocked_was)
    else
      redis.call('HDEL', K_EVICT_MISS, pool .. '|~blocked')
    end
  end
  -- The most free GPUs on one up node of the pool: one lookup, however large the pool.
  local best = redis.call('ZREVRANGEBYLEX', K_FIT, '(' .. pool .. '|~', '[' .. pool .. '|', 'LIMIT', 0, 1)[1]
  local acts = active_bookings(pool)
  local lent = (#acts > 0 and booking_for(acts, w)) and 1 or 0
  return {BUSY, best and tonumber(string.match(best, '^[^|]+|(%d+)|')) or 0, lent}
end
redis.call('SET', K_QUEUE_SEQ, seq)
redis.call('ZADD', K_WAIT_DUE, w.deadline, id)  -- (for the sweep, should its server go away)
local position = redis.call('ZLEXCOUNT', K_QUEUE, '[' .. pool .. '|', '[' .. member)
emit('queued', {lease = id, user = user, pool = pool, gpus = n, position = position, label = ARGV[12],
                gpu_mem_mb = w.gpu_mem_mb})
return {QUEUED, position}
