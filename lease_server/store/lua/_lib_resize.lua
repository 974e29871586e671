-- _lib_resize.lua: resizing an elastic lease. Part of the library: see _lib.lua.

-- GPU-time across sizes: before the size changes, the time held at the old size goes into gpu_ms
-- (end_lease charges gpu_ms plus the time since sized_at at the final size).
local function mark_resize(lease)
  lease.gpu_ms = (lease.gpu_ms or 0) + (NOW - (lease.sized_at or lease.created_at)) * #lease.gpus
  lease.sized_at = NOW
end

-- Give back the k highest-indexed GPUs of a live single-node lease (1 <= k < its size), with the
-- bookkeeping end_lease does for all of them: holders, free list and fit entry (only GPUs the
-- inventory still lists go back to the free list), booking, quota count, fair share. A request to
-- shrink is done with once the lease is down to its shrink_to. The token stays. The caller serves
-- the pool's queue (dispatch). Returns the lease and its JSON.
local function shrink_lease(lease, k, why, by)
  local drain = by == 'server' and 'all' or nil  -- the shrink notice ran out: the GPUs taken back drain
  mark_resize(lease)
  local desc = {}
  for _, g in ipairs(lease.gpus) do desc[#desc + 1] = g.index end
  table.sort(desc, function(x, y) return x > y end)
  local gone = {}
  for i = 1, k do gone[desc[i]] = true end
  local kept, freed = {}, {}
  for _, g in ipairs(lease.gpus) do
    if gone[g.index] then freed[#freed + 1] = g.index else kept[#kept + 1] = g end
  end
  table.sort(freed)
  local node = lease.node
  local inv_raw = redis.call('HGET', K_NODES, node)
  local free = decode_list(redis.call('HGET', K_FREE, node))
  local old_count = #free
  local present = inv_raw and inv_present(inv_raw, freed) or {}
  local draining = {}
  for _, idx in ipairs(freed) do
    local slot = node .. '/' .. idx
    if redis.call('HGET', K_HOLDERS, slot) == lease.id then
      local pids = present[idx] and drain_pids(lease, node, idx, inv_raw, drain)
      if pids then
        start_drain(lease, node, idx, pids, 'shrunk')
        draining[#draining + 1] = idx
      else
        redis.call('HDEL', K_HOLDERS, slot)
        if present[idx] then free[#free + 1] = idx end
      end
    end
  end
  if inv_raw then set_free(node, lease.pool, free, old_count) end
  lease.gpus = kept
  if lease.resv then
    local rraw = redis.call('HGET', K_BOOKINGS, lease.resv)
    if rraw then
      local r = cjson.decode(rraw)
      r.held = math.max(0, (r.held or 0) - k)
      save_booking(r)
    end
  end
  if not lease.preemptible and not lease.resv then count_held_k(lease, -k) end
  touch_usage(lease.pool, lease.user, -k, 0)
  if lease.shrink_to and #kept <= lease.shrink_to then
    lease.shrink_to, lease.shrink_by, lease.shrink_reason = nil, nil, nil
    redis.call('ZREM', K_SHRINK_DUE, lease.id)
  end
  local lease_json = cjson.encode(lease)
  redis.call('HSET', K_LEASES, lease.id, lease_json)
  emit('shrunk', {lease = lease.id, user = lease.user, pool = lease.pool, node = node, gpus = freed, size = #kept,
                  token = lease.token, reason = why, by = by, draining = #draining > 0 and draining or nil})
  return lease, lease_json
end

-- Add k GPUs to a live elastic lease on its own node, all or none: the k lowest free indexes. Only
-- when taking them delays no one and breaks no rule a grant keeps: nobody waits in the pool
-- (growing never jumps a waiter), no booking is in force there, the lease is neither a booking's,
-- borrowed, preemptible, recalled nor asked to shrink, its node is up and has k free GPUs, it stays
-- within the elastic maximum it asked for and its user within quota. Returns {OK, lease JSON}, or
-- {BUSY, why not} with nothing changed. The token stays: the same holder now has more.
local function grow_lease(lease, k)
  local n, pool, node = #lease.gpus, lease.pool, lease.node
  if not lease.elastic then
    return {BUSY, 'the lease is not elastic: only a lease acquired with gpus_min below gpus can grow'}
  end
  if lease.nodes then return {BUSY, 'a multi-node lease cannot grow'} end
  if n + k > lease.elastic.max then
    return {BUSY, 'it would hold ' .. (n + k) .. ' GPUs, above the ' .. lease.elastic.max .. ' it asked for at most'}
  end
  if lease.recall_at or redis.call('ZSCORE', K_RECALL, lease.id) then return {BUSY, 'the lease is being recalled'} end
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
    redis.call('HSET', K_HOLDERS, node .. '/' .. idx, lease.id)
    lease.gpus[#lease.gpus + 1] = {index = idx, uuid = uuid_of[idx] or ''}
  end
  set_free(node, pool, rest, #free)
  count_held_k(lease, k)
  touch_usage(pool, lease.user, k, 0)
  local lease_json = cjson.encode(lease)
  redis.call('HSET', K_LEASES, lease.id, lease_json)
  emit('grown', {lease = lease.id, user = lease.user, pool = pool, node = node, gpus = taken, size = #lease.gpus,
                 token = lease.token})
  return {OK, lease_json}
end
