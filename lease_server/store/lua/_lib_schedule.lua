-- _lib_schedule.lua: scheduling: a pool's policy, quotas, granting, and dispatch (serving the
-- queue). Part of the library: see _lib.lua.

-- A pool's scheduling, written by the server from its config: {scheduler = "fifo" | "fair_share"
-- | "priority", quota = {user = GPUs, ["*"] = per-user default, ["team:NAME"] = GPUs},
-- preempt_notice_ms, idle_weight (how much a held-but-idle GPU-second counts in fair share),
-- share (its GPUs may be sliced: _lib_slice.lua), slice_unit_mb (a slice's size is rounded up to
-- a multiple of it), max_sharers (the most slices, live or draining, on one GPU), slice_busy_pct
-- (a sliced GPU whose recent utilisation averages this much is busy: allocate_slice)}.
local function sched_of(pool)
  local c = SCHED_CACHE[pool]
  if c then return c end
  local raw = redis.call('HGET', K_SCHED, pool) or redis.call('HGET', K_SCHED, '*')
  c = raw and cjson.decode(raw) or {}
  c.scheduler = c.scheduler or 'fair_share'
  c.quota = c.quota or {}
  c.preempt_notice_ms = c.preempt_notice_ms or 30000
  c.warm_evict_notice_ms = c.warm_evict_notice_ms or 2000
  c.warm_max_ms = c.warm_max_ms or 1800000
  c.idle_weight = c.idle_weight or 1
  c.aging = c.aging or 0.1
  c.share = c.share == true
  c.slice_unit_mb = tonumber(c.slice_unit_mb) or 1024
  c.max_sharers = tonumber(c.max_sharers) or 4
  c.slice_busy_pct = tonumber(c.slice_busy_pct) or 50
  SCHED_CACHE[pool] = c
  return c
end

-- GPUs that `who` (a user or "team:NAME") holds in the pool against its quota: whole GPUs, plus
-- the slices as their fractions (counted in milli-GPUs in the field "pool|who|m").
local function held_of(pool, who)
  local h = redis.call('HMGET', K_HELD_BY, pool .. '|' .. who, pool .. '|' .. who .. '|m')
  return tonumber(h[1] or '0') + tonumber(h[2] or '0') / 1000
end

-- Whether k more GPUs (a fraction, for a slice) keep the request's user, and each of its teams,
-- within their quota of the pool. Preemptible leases do not count against a quota.
local function within_quota(w, pool, k)
  local q = sched_of(pool).quota
  local lim = q[w.user] or q['*']
  if lim and held_of(pool, w.user) + k > lim + 1e-9 then return false end
  for t in string.gmatch(w.teams or '', '[^,]+') do
    local tl = q['team:' .. t]
    if tl and held_of(pool, 'team:' .. t) + k > tl + 1e-9 then return false end
  end
  return true
end

-- k more (or, negative, fewer) GPUs held against the quotas of the lease's user and its teams;
-- `suffix` "|m": k milli-GPUs of slices.
local function count_held_k(lease, k, suffix)
  suffix = suffix or ''
  redis.call('HINCRBY', K_HELD_BY, lease.pool .. '|' .. lease.user .. suffix, k)
  for t in string.gmatch(lease.teams or '', '[^,]+') do
    redis.call('HINCRBY', K_HELD_BY, lease.pool .. '|team:' .. t .. suffix, k)
  end
end

local function count_held(lease, sign)
  if lease.gpu_mem_mb then
    count_held_k(lease, sign * slice_milli(lease), '|m')
  else
    count_held_k(lease, sign * #lease.gpus)
  end
end

-- The node the request prefers (w.prefer: the node of its notebook's worker suspended to host,
-- which can be restored only there), if it is up in the pool with enough GPUs free now: its free
-- GPUs, as allocate() answers; else nil, and best fit chooses as for anyone. Only free GPUs: a
-- preference evicts and waits for nothing.
local function allocate_preferred(w, pool, exclude)
  local node = w.prefer
  if not node or node == '' or node == exclude then return nil end
  local raw = redis.call('HGET', K_FREE, node)
  if not raw then return nil end
  local free = decode_list(raw)
  if #free < (w.gpus_min or w.gpus) or not redis.call('ZSCORE', K_FIT, fit_member(pool, node, #free)) then
    return nil  -- too few free, or down, or of another pool
  end
  if tonumber(redis.call('ZSCORE', K_ALIVE, node) or '-1') < NOW then return nil end
  local taken, rest = {}, {}
  for i, idx in ipairs(free) do
    if i <= w.gpus then taken[#taken + 1] = idx else rest[#rest + 1] = idx end
  end
  return node, taken, rest, #free
end

-- An elastic request (gpus_min < gpus) takes as many as one up node has free now, between its
-- minimum and maximum; any other request exactly its count. A preferred node first.
local function allocate_for(w, pool, exclude)
  local pnode, ptaken, prest, pcount = allocate_preferred(w, pool, exclude)
  if pnode then return pnode, ptaken, prest, pcount end
  local lo = w.gpus_min or w.gpus
  if lo >= w.gpus then return allocate(pool, w.gpus, exclude) end
  for _, m in ipairs(redis.call('ZREVRANGEBYLEX', K_FIT, '(' .. pool .. '|~', '[' .. pool .. '|', 'LIMIT', 0, 2)) do
    local cnt, node = string.match(m, '^[^|]+|(%d+)|(.+)$')
    cnt = tonumber(cnt)
    if node ~= exclude and cnt >= lo then
      return allocate(pool, math.min(cnt, w.gpus), exclude)
    end
  end
  return nil
end

-- The next fencing token: FENCE_EPOCH * 10^9 + the count of tokens issued in that epoch. It never
-- repeats and never goes backwards, across failovers too:
-- * On one primary, the hash {e, n} only grows: (e, n) rises on every call, and an epoch older than
--   the stored one (a server that has not yet seen a failover) does not lower it.
-- * Redis replication is asynchronous, so a replica promoted by Sentinel may miss the old primary's
--   last increments of n, and would hand out the same n again. But the server passes Sentinel's
--   config epoch of the primary it found, and Sentinel raises that epoch for every failover before
--   anyone can find the new primary: the first token on the new primary moves to an epoch no token
--   of the old one carries, whatever n the new primary starts from.
-- * A partitioned old primary that still takes writes has no replica to acknowledge them: with
--   replicas_ack >= 1 its grants (and their tokens) are never acknowledged to a client (503).
-- n stays below 10^9 per epoch (a billion grants between two failovers), and tokens below 2^53,
-- so they are exact in Lua numbers, cjson (14 digits up to epoch 99,999) and JavaScript.
local function next_token()
  local e = tonumber(redis.call('HGET', K_FENCE, 'e') or '0')
  if FENCE_EPOCH > e then
    redis.call('HSET', K_FENCE, 'e', FENCE_EPOCH, 'n', 0)
    e = FENCE_EPOCH
  end
  return e * 1000000000 + redis.call('HINCRBY', K_FENCE, 'n', 1)
end

-- Grant waiter w the GPUs of `parts`: {{node, taken, rest, old_count}, ...}, one part per node
-- (several for a multi-node gang, whose GPUs then name their node), or, for a slice request
-- (w.gpu_mem_mb), one part {node, slice = allocate_slice's answer}. Returns the lease and its JSON.
local function grant_parts(w, parts)
  local gpus, taken, nodes, part_gpus = {}, {}, {}, {}
  local total_mb
  for _, part in ipairs(parts) do
    local node = part.node
    if part.slices then  -- a slice on each of these GPUs (grant_slice: in order, a free one taken whole)
      part.taken = {}
      for _, p in ipairs(part.slices) do
        part.taken[#part.taken + 1] = p.index
        total_mb = grant_slice(w.id, w.pool, w.gpu_mem_mb, p)
      end
    end
    local uuid_of = inv_uuids(redis.call('HGET', K_NODES, node), part.taken)
    -- Invariant guard, checked before any write: a free GPU never has a holder. If one does, the
    -- state is corrupt, and granting it would be a double grant: fail the script loudly instead.
    for _, idx in ipairs(part.slices and {} or part.taken) do
      if redis.call('HEXISTS', K_HOLDERS, node .. '/' .. idx) == 1 then
        error('invariant broken: free GPU ' .. node .. '/' .. idx .. ' has a holder')
      end
    end
    for _, idx in ipairs(part.taken) do
      if not part.slices then redis.call('HSET', K_HOLDERS, node .. '/' .. idx, w.id) end
      local g = {index = idx, uuid = uuid_of[idx] or ''}
      if #parts > 1 then g.node = node end
      gpus[#gpus + 1] = g
      taken[#taken + 1] = idx
    end
    if not part.slices then set_free(node, w.pool, part.rest, part.old_count) end
    nodes[#nodes + 1] = node
    part_gpus[#part_gpus + 1] = {node = node, gpus = part.taken}
  end
  local node = parts[1].node
  local lease = {
    id = w.id, token = next_token(), user = w.user, pool = w.pool, node = node,
    gpus = gpus, ttl_ms = w.ttl_ms, label = w.label, session = w.session, state = 'active',
    created_at = NOW, renewed_at = NOW, expires_at = NOW + w.ttl_ms, renewals = 0,
    waited_ms = NOW - w.enqueued_at,
  }
  if #parts > 1 then lease.nodes = nodes end
  if w.notebook and w.notebook ~= '' then lease.notebook = w.notebook end
  if w.cell and w.cell ~= '' then lease.cell = w.cell end
  if w.ends_ms then lease.ends_by = NOW + w.ends_ms end  -- declared by its holder: an estimate counts on it
  if w.booking then
    local r = w.booking.r
    lease.resv = r.id  -- the booking it is served from (the stored record's field keeps its first name)
    r.held = (r.held or 0) + #taken
    r.used = r.used or {}
    r.used[tostring(w.booking.k)] = true
    r.leases = r.leases or {}
    r.leases[w.id] = w.booking.k  -- until that occurrence ends (leave_booking, from the sweep then)
    local _, occ_end = occ_span(r, w.booking.k)
    redis.call('ZADD', K_BOOKING_DUE, 'LT', occ_end, r.id)
    save_booking(r)
    w.booking.owed = w.booking.owed - #taken
  elseif w.borrowed then
    lease.borrowed = true
  end
  lease.teams, lease.priority = w.teams, w.priority or 1
  if (w.gpus_min or w.gpus) < w.gpus then lease.elastic = {min = w.gpus_min, max = w.gpus} end
  if total_mb then
    -- a slice: gpu_mem_mb of the GPU's gpu_total_mb (the size it got, rounded up to the pool's unit)
    lease.gpu_mem_mb, lease.gpu_total_mb = w.gpu_mem_mb, total_mb
  end
  touch_usage(w.pool, w.user, gpu_share(lease), 0)
  if w.booking then
    -- served from a booking: booked GPUs do not count against a quota
  elseif not within_quota(w, w.pool, gpu_share(lease)) then
    lease.preemptible = true
    redis.call('HINCRBY', K_HELD_BY, w.pool .. '|~preemptible', 1)
  else
    count_held(lease, 1)
  end
  local lease_json = cjson.encode(lease)
  redis.call('HSET', K_LEASES, w.id, lease_json)
  index_victim(nil, lease)
  redis.call('ZADD', K_DEADLINES, lease.expires_at, w.id)
  -- An elastic lease may be asked to shrink for a blocked request (ask_to_shrink): index it by pool.
  if lease.elastic then redis.call('ZADD', K_ELASTIC, 0, w.pool .. '|' .. w.id) end
  emit('grant', {lease = w.id, user = w.user, pool = w.pool, node = node, gpus = taken,
                 token = lease.token, label = w.label, session = w.session, waited_ms = lease.waited_ms,
                 reservation = lease.resv, borrowed = lease.borrowed, preemptible = lease.preemptible,
                 priority = lease.priority, nodes = lease.nodes, parts = #parts > 1 and part_gpus or nil,
                 gpu_mem_mb = lease.gpu_mem_mb, gpu_total_mb = lease.gpu_total_mb})
  return lease, lease_json
end

local function grant(w, node, taken, rest, old_count)
  return grant_parts(w, {{node = node, taken = taken, rest = rest, old_count = old_count}})
end

-- A multi-node gang: `per` GPUs on each of k distinct up nodes, all or nothing; the nodes with the
-- fewest free GPUs that still have `per` first (best fit), skipping `exclude`.
local function allocate_gang(pool, per, k, exclude)
  local chosen = {}
  -- read 64 entries of the fit index at a time, and only until k nodes are found
  local from, hi = '[' .. pool .. '|' .. string.format('%05d', per) .. '|', '(' .. pool .. '|~'
  while #chosen < k do
    local members = redis.call('ZRANGEBYLEX', K_FIT, from, hi, 'LIMIT', 0, 64)
    for _, m in ipairs(members) do
      local node = string.match(m, '^[^|]+|%d+|(.+)$')
      if node ~= exclude then
        if tonumber(redis.call('ZSCORE', K_ALIVE, node) or '-1') >= NOW then
          chosen[#chosen + 1] = node
          if #chosen == k then break end
        else
          mark_down(node, 'heartbeat missed')
        end
      end
    end
    if #members < 64 then break end
    from = '(' .. members[#members]
  end
  if #chosen < k then return nil end
  local parts = {}
  for _, node in ipairs(chosen) do
    local free = decode_list(redis.call('HGET', K_FREE, node))
    local taken, rest = {}, {}
    for i, idx in ipairs(free) do
      if i <= per then taken[#taken + 1] = idx else rest[#rest + 1] = idx end
    end
    parts[#parts + 1] = {node = node, taken = taken, rest = rest, old_count = #free}
  end
  return parts
end

-- Waiter w (wanting n GPUs on one node) found none free: ask elastic leases of other users, of no
-- higher priority, that hold more than their minimum to give GPUs back -- on the node where the
-- fewest have to be asked -- by shrink_by, NOW + notice_ms; after that the sweep takes them
-- (sweep.lua, shrink_lease). GPUs already asked for count as coming free, so the same shortfall
-- is never asked for twice, and a lease with a request pending is not asked again. Reads only the
-- pool's elastic leases (the elastic index, at most 256 of them). Returns the node the GPUs come
-- free on, or nil when no node can be freed that way.
local function ask_to_shrink(w, pool, n, notice_ms)
  if w.deadline <= NOW then return nil end  -- a request that does not wait asks nobody
  local members = redis.call('ZRANGEBYLEX', K_ELASTIC, '[' .. pool .. '|', '(' .. pool .. '|~', 'LIMIT', 0, 256)
  if #members == 0 then return nil end
  -- The candidate nodes: those of the pool's elastic leases, and the one with the most free GPUs
  -- (not the whole pool); each as it stands if it is up (has a fit entry), else false.
  local per = {}
  local function node_entry(node)
    if per[node] == nil then
      local cnt = #decode_list(redis.call('HGET', K_FREE, node))
      per[node] = redis.call('ZSCORE', K_FIT, fit_member(pool, node, cnt)) and {have = cnt, spare = 0, victims = {}}
                  or false
    end
    return per[node]
  end
  local top = fullest_node(pool)
  if top ~= '' then node_entry(top) end
  local mine = w.priority or 1
  for _, m in ipairs(members) do
    local raw = redis.call('HGET', K_LEASES, string.match(m, '^[^|]+|(.+)$'))
    local l = raw and cjson.decode(raw)
    local p = l and l.elastic and not l.nodes and node_entry(l.node)
    if p then
      local size = #l.gpus
      if l.shrink_to then
        p.have = p.have + math.max(0, size - l.shrink_to)
      elseif l.user ~= w.user and not l.recall_at and (l.priority or 1) <= mine and size > l.elastic.min then
        p.victims[#p.victims + 1] = {l = l, spare = size - l.elastic.min}
        p.spare = p.spare + size - l.elastic.min
      end
    end
  end
  local best, best_need = nil, nil
  for node, p in pairs(per) do
    local need = p and math.max(0, n - p.have)
    if p and p.spare >= need and (best_need == nil or need < best_need or (need == best_need and node < best)) then
      best, best_need = node, need
    end
  end
  if not best or best_need == 0 then return best end
  -- The fewest leases: those with the most to spare first.
  local victims = per[best].victims
  table.sort(victims, function(x, y)
    if x.spare ~= y.spare then return x.spare > y.spare end
    return x.l.id < y.l.id
  end)
  local need, due = best_need, NOW + notice_ms
  for _, v in ipairs(victims) do
    local l, ask = v.l, math.min(v.spare, need)
    l.shrink_to = #l.gpus - ask
    l.shrink_by = due
    l.shrink_reason = w.user .. "'s request for " .. n .. ' GPU(s) waits: give back ' .. ask .. ' GPU(s) (shrink to '
        .. l.shrink_to .. ') within ' .. string.format('%g', notice_ms / 1000)
        .. ' s, or the server takes back the highest-indexed ones'
    redis.call('HSET', K_LEASES, l.id, cjson.encode(l))
    redis.call('ZADD', K_SHRINK_DUE, due, l.id)
    emit('shrink_notice', {lease = l.id, user = l.user, pool = pool, node = l.node, size = #l.gpus,
                           shrink_to = l.shrink_to, shrink_by = due, ['for'] = w.user, reason = l.shrink_reason})
    need = need - ask
    if need <= 0 then break end
  end
  return best
end

-- The fewest GPUs on one node that the waiter `w` (or its raw JSON) could start with: its size, an
-- elastic request's minimum, a gang's share per node; 0 for a slice (memory, not whole GPUs).
local function least_need(w, raw)
  if w then
    if w.gpu_mem_mb then return 0 end
    if (w.nodes or 1) > 1 then return math.floor(w.gpus / w.nodes) end
    return w.gpus_min or w.gpus
  end
  if string.find(raw, '"gpu_mem_mb":', 1, true) then return 0 end
  local gpus = tonumber(string.match(raw, '"gpus":(%d+)')) or 0
  local nodes = tonumber(string.match(raw, '"nodes":(%d+)')) or 1
  if nodes > 1 then return math.floor(gpus / nodes) end
  return tonumber(string.match(raw, '"gpus_min":(%d+)')) or gpus
end

-- Dispatch, step 1: the waiters of the pool's queue (``members``, its first entries) in the order
-- they are served: booking holders first, then by the scheduler's key; a user's waiters beyond
-- 4 (fair share, no booking in force) after all the others, oldest first. Also returns the least
-- need (least_need) of all the waiters of the pool when it read every one of them, else nil.
local function queue_order(pool, members, acts, sched)
  local cap = sched.scheduler == 'fair_share' and #acts == 0
  local order, later, per_user, standing = {}, {}, {}, {}
  local least = math.huge
  local i = 0
  while i < #members and #order < 64 do
    i = i + 1
    local m = members[i]
    local id = string.match(m, '|([^|]+)$')
    local raw = redis.call('HGET', K_WAITERS, id)
    local user = cap and raw and string.match(raw, '"user":"([^"\\]*)"')
    if user and (per_user[user] or 0) >= 4 then
      later[#later + 1] = {member = m, later_raw = raw}
      least = math.min(least, least_need(nil, raw))
    elseif raw then
      if user then per_user[user] = (per_user[user] or 0) + 1 end
      local w = cjson.decode(raw)
      w.member = m
      least = math.min(least, least_need(w))
      if sched.scheduler == 'fifo' then
        w.key = 0
      else
        -- (a user's standing read once per dispatch, however many of their requests wait)
        standing[w.user] = standing[w.user] or decayed_usage(pool, w.user)
        w.key = standing[w.user] - sched.aging * (NOW - w.enqueued_at) / 1000 * w.gpus
        if sched.scheduler == 'priority' then w.key = w.key - (w.priority or 1) * 1e15 end
      end
      w.holder = #acts > 0 and not w.gpu_mem_mb and booking_for(acts, w) ~= nil
      if w.holder then w.key = -1e300 end
      order[#order + 1] = w
    else
      redis.call('ZREM', K_QUEUE, m)
      redis.call('ZREM', K_WAIT_DUE, id)
    end
    if cap and i == #members and #order < 64 and i < 256 and i % 64 == 0 then  -- read on, 64 at a time
      for _, more in ipairs(redis.call('ZRANGEBYLEX', K_QUEUE, '(' .. m, '(' .. pool .. '|~', 'LIMIT', 0, 64)) do
        members[#members + 1] = more
      end
    end
  end
  -- Equal keys (same user standing, same millisecond) go in arrival order: the older waiter first.
  table.sort(order, function(a, b)
    if a.key ~= b.key then return a.key < b.key end
    return a.seq < b.seq
  end)
  for _, l in ipairs(later) do order[#order + 1] = l end
  if i < #members or redis.call('ZLEXCOUNT', K_QUEUE, '[' .. pool .. '|', '(' .. pool .. '|~') ~= i then
    least = nil  -- (not every waiter was read)
  end
  return order, least
end

-- Where slice request w goes (allocate_slice), as grant_parts' parts, or nil. A slice never takes
-- a free GPU that the pool's bookings in force still owe (it is not served from a booking, and is
-- never borrowed: what a recall frees is counted in whole GPUs), but may share a sliced one.
local function slice_parts(w, pool, owed, sched, exclude)
  if (w.gpus or 1) > 1 then  -- k slices, one on each of k GPUs of one node (allocate_slices)
    local ps = allocate_slices(pool, w.gpu_mem_mb, w.gpus, sched.max_sharers, sched.slice_busy_pct, exclude)
    if not ps then return nil end
    local fresh = 0
    for _, p in ipairs(ps) do if p.fresh then fresh = fresh + 1 end end
    if fresh > 0 and owed > 0 and pool_free(pool) - fresh < owed then return nil end
    return {{node = ps[1].node, slices = ps}}
  end
  local p, busy = allocate_slice(pool, w.gpu_mem_mb, sched.max_sharers, sched.slice_busy_pct, exclude)
  if p and p.fresh and owed > 0 and pool_free(pool) - 1 < owed then p = busy end
  if not p then return nil end
  return {{node = p.node, slices = {p}}}
end

-- Dispatch, for a waiter that cannot be served now: recall what may be recalled for it
-- (a booking's borrowed GPUs, warm leases, preemptible leases within quota, elastic leases
-- above their minimum). Returns the node held for it while they come back, or nil.
local function make_room(w, a, pool, sched, reserved)
  local hold
  if w.gpu_mem_mb then
    -- a blocked slice evicts warm leases (warm slices for their memory, else a whole GPU) and
    -- recalls nothing else (what a booking or a preemption frees is counted in whole GPUs)
    if tonumber(redis.call('HGET', K_HELD_BY, pool .. '|~warm') or '0') == 0 then return nil end
    return evict_for_slice(w, pool, sched.warm_evict_notice_ms)
  elseif (w.nodes or 1) > 1 then
    hold = nil  -- a blocked gang recalls nothing (recalls free GPUs one node at a time)
  elseif a then
    hold = recall_for_booking(w, a, pool)
  elseif tonumber(redis.call('HGET', K_HELD_BY, pool .. '|~warm') or '0') > 0 then
    -- Warm leases are lendable: anyone who would otherwise wait evicts them, with a short notice
    -- in which the holder's kernel ends (or suspends) the worker and releases.
    hold = recall(w, pool, w.gpus_min or w.gpus, nil, warm_rank, sched.warm_evict_notice_ms, 'evicting',
                  'evicted for ' .. w.user .. "'s request", {}, {'w', 'v'}, not sched.share)
  end
  if not hold and not a and (w.nodes or 1) <= 1
      and tonumber(redis.call('HGET', K_HELD_BY, pool .. '|~preemptible') or '0') > 0
      and within_quota(w, pool, w.gpus_min or w.gpus) then
    local mine = w.priority or 1
    local function rank(l)
      if l.preemptible and (l.priority or 1) <= mine and l.user ~= w.user then return l.priority or 1 end
      return nil
    end
    hold = recall(w, pool, w.gpus_min or w.gpus, nil, rank, sched.preempt_notice_ms, 'preempt_notice',
                  'preempted for ' .. w.user .. "'s request within quota (this lease ran above quota)", {},
                  {'w', 'p'})
  end
  -- Nothing recalled for the first blocked request: elastic leases above their minimum may give
  -- some GPUs back for it (a request above its quota asks nobody, as for preemption).
  if not hold and reserved == nil and not a and (w.nodes or 1) <= 1
      and within_quota(w, pool, w.gpus_min or w.gpus) then
    hold = ask_to_shrink(w, pool, w.gpus_min or w.gpus, sched.preempt_notice_ms)
  end
  return hold
end

-- Dispatch, step 2: serve the waiters in ``order``; the first that cannot be served holds back a
-- node (make_room's, else the fullest), and only smaller requests are backfilled around it.
local function serve_in_order(pool, order, acts, owed, sched)
  local reserved = nil
  local granted = 0
  for _, w in ipairs(order) do
    local overflow = w.later_raw ~= nil  -- a user's waiter beyond the 4 ordered
    if overflow then
      local top = redis.call('ZREVRANGEBYLEX', K_FIT, '(' .. pool .. '|~', '[' .. pool .. '|', 'LIMIT', 0, 1)[1]
      if not top or tonumber(string.match(top, '^[^|]+|(%d+)|')) == 0 then break end
      local m = w.member
      w = cjson.decode(w.later_raw)
      w.member = m
    end
    -- (asked again: grants to holders before this one may have used up what the booking owes)
    local a = w.holder and booking_for(acts, w) or nil
    local parts, count = nil, 0
    if w.gpu_mem_mb then
      parts = slice_parts(w, pool, owed, sched, reserved)
    elseif (w.nodes or 1) > 1 then
      parts = allocate_gang(pool, w.gpus / w.nodes, w.nodes, reserved)
      count = w.gpus
    else
      local node, taken, rest, old_count
      if a then
        node, taken, rest, old_count = allocate(pool, w.gpus, reserved)
      else
        node, taken, rest, old_count = allocate_for(w, pool, reserved)
      end
      if node then
        parts, count = {{node = node, taken = taken, rest = rest, old_count = old_count}}, #taken
      end
    end
    if parts then
      if a then
        w.booking = a
        owed = owed - w.gpus
      elseif owed > 0 and not w.gpu_mem_mb and pool_free(pool) - count < owed then
        w.borrowed = true
      end
      grant_parts(w, parts)
      redis.call('ZREM', K_QUEUE, w.member)
      redis.call('HDEL', K_WAITERS, w.id)
      redis.call('ZREM', K_WAIT_DUE, w.id)
      count_waiting(w.user, -1)
      redis.call('PUBLISH', K_GRANTS, w.id)
      granted = granted + 1
    elseif overflow then
      break  -- the overflow is served oldest first while it fits, and recalls nothing
    else
      local hold = make_room(w, a, pool, sched, reserved)
      if reserved == nil then reserved = hold or fullest_node(pool) end
    end
  end
  return granted, reserved
end

-- Whether the pool's queue was found blocked (dispatch, below) and nothing has changed since that
-- could serve one of its waiters: (the least need of its waiters, the node held for its head), or
-- nil. Freed GPUs that reach that need on one node (set_free), a node up (register.lua), a waiter
-- joining or leaving (the head's held node may serve another) forget it; so does a change in the
-- pool's warm or preemptible leases (a recall may find them), and time.
local function blocked_memo(pool)
  local raw = redis.call('HGET', K_EVICT_MISS, pool .. '|~blocked')
  if not raw then return nil end
  local n, held, warm, pre, at = string.match(raw, '^(%d+)|([^|]*)|(%d+)|(%d+)|(%d+)$')
  if not n or NOW - tonumber(at) >= BLOCKED_MS then return nil end
  local h = redis.call('HMGET', K_HELD_BY, pool .. '|~warm', pool .. '|~preemptible')
  if tonumber(h[1] or '0') ~= tonumber(warm) or tonumber(h[2] or '0') ~= tonumber(pre) then return nil end
  return tonumber(n), held
end

-- Serve the pool's queue. Holders of a booking in force come first (up to what it still owes
-- them); then the pool's scheduler: "fair_share" (least decayed GPU-time first, aged by waiting
-- time x size so large requests cannot starve), "priority" (priority class first, fair share
-- within a class) or "fifo" (arrival order). The first waiter that cannot be served holds back
-- one node (the node where leases are being recalled for it, or the one it is closest to
-- filling), and only smaller requests that fit elsewhere are backfilled around it. Others may
-- take GPUs that bookings still owe only as *borrowed* leases, recalled on demand; a request
-- within its quota may recall *preemptible* leases (run above quota) of no higher priority.
-- Up to 64 waiters are ordered at once, oldest first. Under fair share with no booking in force,
-- at most 4 of them per user: the queue is read up to 256 deep, and a user's further waiters (a
-- sweep's trials) are tried after the ordered ones, oldest first, while they fit, so that they
-- cannot hide later requests of other users from the scheduler.
local function dispatch(pool)
  local members = redis.call('ZRANGEBYLEX', K_QUEUE, '[' .. pool .. '|', '(' .. pool .. '|~', 'LIMIT', 0, 64)
  if #members == 0 then return 0 end
  local acts, owed = active_bookings(pool)
  if #acts == 0 and blocked_memo(pool) then return 0 end  -- nothing changed that could serve a waiter
  local sched = sched_of(pool)
  -- What allocate and recall found impossible in this dispatch (nothing frees GPUs until it ends;
  -- a script may end leases between two dispatches, so each starts afresh).
  SCHED_CACHE['~miss|' .. pool] = {}
  local order, least = queue_order(pool, members, acts, sched)
  local granted, reserved = serve_in_order(pool, order, acts, owed, sched)
  SCHED_CACHE['~miss|' .. pool] = nil
  -- Every waiter read and none served: remember it (blocked_memo), with the least need of any
  -- waiter and the node held for the head, until GPUs that reach that need come free (set_free),
  -- a waiter joins or leaves, the pool's warm or preemptible leases change, or BLOCKED_MS.
  local h = redis.call('HMGET', K_HELD_BY, pool .. '|~warm', pool .. '|~preemptible')
  -- (not while a waiter might preempt or shrink a lease: who may is a matter of quotas, which any
  -- release changes)
  if granted == 0 and #acts == 0 and least and least > 0 and least < math.huge and tonumber(h[2] or '0') == 0
      and not redis.call('ZRANGEBYLEX', K_ELASTIC, '[' .. pool .. '|', '(' .. pool .. '|~', 'LIMIT', 0, 1)[1] then
    redis.call('HSET', K_EVICT_MISS, pool .. '|~blocked', string.format('%d|%s|%d|%d|%d', least, reserved or '',
               tonumber(h[1] or '0'), tonumber(h[2] or '0'), NOW))
  else
    redis.call('HDEL', K_EVICT_MISS, pool .. '|~blocked')
  end
  return granted
end
