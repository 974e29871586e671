-- _lib_slice.lua: GPU slices: several leases share one GPU, each promised part of its memory.
-- Part of the library: see _lib.lua.
--
-- A pool whose scheduling says share = true (sched_of) takes slice requests (gpu_mem_mb). A free
-- GPU becomes *sliced* when a slice request takes it from its node's free list: its holders entry
-- is then SLICED (held by no one lease, so it is never free, never registered free again and never
-- granted whole), and K_SLICED "node/idx" holds its memory ledger, JSON
--   {pool, total_mb, used_mb, max, leases = {id = MB}, draining = {id = {mb, user, state, since, pids}},
--    fit = its K_SLICE_FIT member or absent, util_avg = its utilisation (%) averaged over its node
--    agent's recent samples and util_at = the newest one's ms (written by samples.lua) or absent,
--    unclaimed_mb = the memory its newest sample used beyond used_mb while a process that no slice
--    claimed was on it (samples.lua), or absent}
-- A GPU with unclaimed_mb takes no new slice: memory nobody is held to is in use there (a cell's
-- daemon that outlived its lease, a process of no lease), so what the ledger calls free may not be.
-- used_mb is what the live and the draining slices are promised together: never above total_mb
-- (the invariant; tests/invariants.py checks it). A draining slice is one the server ended whose
-- processes the node agent has not yet seen gone: its memory stays promised until drained.lua.
-- K_SLICE_FIT lists the sliced GPUs that can take one more slice (fewer than `max` sharers, live
-- and draining, and free memory left) as "pool|FFFFFFFF|node/idx" (F = free MB, zero-padded):
-- ZRANGEBYLEX from "[pool|<MB asked>|" finds the best fit by memory in O(log N). When its last
-- slice (live or draining) is gone, the GPU goes back to its node's free list as a whole GPU.

local function slice_member(pool, free_mb, slot)
  return pool .. '|' .. string.format('%08d', free_mb) .. '|' .. slot
end

-- Memory of GPU idx of the inventory `raw`, in MB (0 when it does not list it). The canonical
-- layout (see inv_find) puts memory_mb right after index; any other layout is decoded.
local function inv_memory(raw, idx)
  local at = inv_find(raw, idx)
  local mb = at and string.match(raw, '^{"index":%d+,"memory_mb":(%d+)', at)
  if mb then return tonumber(mb) end
  for _, g in ipairs(cjson.decode(raw).gpus) do
    if g.index == idx then return tonumber(g.memory_mb) or 0 end
  end
  return 0
end

-- The most memory one GPU of `pool` has (MB; 0 for an unknown pool): read from its largest node,
-- one inventory, whatever the pool's size. A pool's GPUs are one model, so this is every GPU's.
local function pool_gpu_mb(pool)
  local m = redis.call('ZREVRANGEBYLEX', K_SIZES, '(' .. pool .. '|~', '[' .. pool .. '|', 'LIMIT', 0, 1)[1]
  if not m then return 0 end
  local raw = redis.call('HGET', K_NODES, string.match(m, '^[^|]+|%d+|(.+)$'))
  local best = 0
  if raw then
    for _, g in ipairs(cjson.decode(raw).gpus) do best = math.max(best, tonumber(g.memory_mb) or 0) end
  end
  return best
end

-- Write the ledger of sliced GPU `slot` and keep its fit entry in step. With no slice left on it
-- (live or draining), the ledger and its SLICED mark go: returns true, and the caller puts the GPU
-- back on its node's free list (it holds that list in hand, as end_lease and drained.lua do).
local function save_slices(slot, s)
  if s.fit then redis.call('ZREM', K_SLICE_FIT, s.fit) end
  s.fit = nil
  local sharers = 0
  for _ in pairs(s.leases) do sharers = sharers + 1 end
  for _ in pairs(s.draining) do sharers = sharers + 1 end
  if sharers == 0 then
    redis.call('HDEL', K_SLICED, slot)
    if redis.call('HGET', K_HOLDERS, slot) == SLICED then redis.call('HDEL', K_HOLDERS, slot) end
    return true
  end
  if sharers < s.max and s.used_mb < s.total_mb then
    s.fit = slice_member(s.pool, s.total_mb - s.used_mb, slot)
    redis.call('ZADD', K_SLICE_FIT, 0, s.fit)
  end
  -- cjson writes an empty table as {}: both maps stay objects
  redis.call('HSET', K_SLICED, slot, cjson.encode(s))
  return false
end

-- Whether a slice of sliced GPU `s` (its ledger) is being recalled: its GPU is being emptied for a
-- booking, so no new slice joins it. At most max_sharers reads.
local function slices_recalled(s)
  for id in pairs(s.leases) do
    local raw = redis.call('HGET', K_LEASES, id)
    if raw and string.find(raw, '"recall_at"', 1, true) then return true end
  end
  return false
end

-- How many of the best fits by memory allocate_slice looks at for one that is not busy: bounded
-- work, whatever the pool's size (each is one HGET of its ledger).
local SLICE_CANDIDATES = 16

-- Where a slice of `mb` MB of `pool` goes. First key, memory: the sliced GPUs of up nodes that
-- still have mb, least free memory first (best fit: slices pack, whole GPUs stay whole). Second,
-- utilisation: of the first SLICE_CANDIDATES of those (less any on `exclude`, the node held for a
-- blocked request, whose slices are being recalled), the best fit whose recent utilisation
-- (util_avg, the node agent's samples averaged by samples.lua) is under busy_pct; if every one is
-- busy, a free GPU taken whole from the best-fit node (allocate, skipping `exclude`, the node held
-- back for a blocked head of the queue, and GPUs with less than mb): nobody runs there; with none,
-- the best fit however busy. So two heavy cells meet on one GPU only when nothing else fits.
-- Returns {node, index, slot[, fresh, rest, old_count, total_mb]} or nil, and, when that is a free
-- GPU, the busy best fit it passed over (or nil: the caller's fallback when it may not take a free
-- GPU); changes nothing (grant_slice does).
local function allocate_slice(pool, mb, max_sharers, busy_pct, exclude)
  local lo = '[' .. pool .. '|' .. string.format('%08d', mb) .. '|'
  local members = redis.call('ZRANGEBYLEX', K_SLICE_FIT, lo, '(' .. pool .. '|~', 'LIMIT', 0, SLICE_CANDIDATES)
  local busy
  for _, m in ipairs(members) do
    local slot = string.match(m, '^[^|]+|%d+|(.+)$')
    local node, idx = string.match(slot, '^(.+)/(%d+)$')
    -- a down node's sliced GPUs keep their entries (their slices may come back with it): skipped
    if tonumber(redis.call('ZSCORE', K_ALIVE, node) or '-1') >= NOW then
      local s = cjson.decode(redis.call('HGET', K_SLICED, slot))
      local p = {node = node, index = tonumber(idx), slot = slot}
      -- the node held for a blocked request may be the one whose slices a booking recalls; a GPU
      -- using memory that no slice answers for is passed over while its samples show it
      if not s.unclaimed_mb and (node ~= exclude or not slices_recalled(s)) then
        if (tonumber(s.util_avg) or 0) < busy_pct then return p end
        busy = busy or p
      end
    end
  end
  local node, taken, rest, old_count = allocate(pool, 1, exclude)
  if node then
    local total = inv_memory(redis.call('HGET', K_NODES, node), taken[1])
    if total >= mb then
      return {node = node, index = taken[1], slot = node .. '/' .. taken[1], fresh = true, rest = rest,
              old_count = old_count, total_mb = total, max = max_sharers}, busy
    end
  end
  return busy
end

-- Where k slices of `mb` MB each go, one per GPU, all on one node (a multi-GPU cell that needs part
-- of each GPU, as a gang of slices): on the up node (not `exclude`) where k GPUs have room, taking
-- first sliced GPUs that are not busy (recent utilisation under busy_pct; least free memory first:
-- best fit), then free GPUs whole, and busy sliced GPUs last, as allocate_slice does for one: the
-- node that takes the fewest busy GPUs, then the fewest free ones, then leaves the least memory,
-- then by name. The candidates are the nodes of the first SLICE_CANDIDATES best fits by memory and
-- of the SLICE_CANDIDATES best-fit nodes with free GPUs: bounded work whatever the pool's size.
-- Returns k placements as allocate_slice's (a free GPU's rest and old_count follow one another, as
-- grant_slice takes them in order), or nil; changes nothing.
local function allocate_slices(pool, mb, k, max_sharers, busy_pct, exclude)
  local nodes, seen = {}, {}
  local function consider(node)
    if node and node ~= exclude and not seen[node] then seen[node] = true; nodes[#nodes + 1] = node end
  end
  local lo = '[' .. pool .. '|' .. string.format('%08d', mb) .. '|'
  for _, m in ipairs(redis.call('ZRANGEBYLEX', K_SLICE_FIT, lo, '(' .. pool .. '|~', 'LIMIT', 0, SLICE_CANDIDATES)) do
    consider(string.match(m, '^[^|]+|%d+|(.+)/%d+$'))
  end
  for _, m in ipairs(redis.call('ZRANGEBYLEX', K_FIT, '[' .. pool .. '|00001|', '(' .. pool .. '|~',
                                'LIMIT', 0, SLICE_CANDIDATES)) do
    consider(string.match(m, '^[^|]+|%d+|(.+)$'))
  end
  local best, best_key
  for _, node in ipairs(nodes) do
    local inv_raw = redis.call('HGET', K_NODES, node)
    if inv_raw and tonumber(redis.call('ZSCORE', K_ALIVE, node) or '-1') >= NOW then
      local free = decode_list(redis.call('HGET', K_FREE, node))
      local shared, fresh, busy = {}, {}, {}
      local slots = {}
      for idx in string.gmatch(inv_raw, '"index":(%d+)') do slots[#slots + 1] = node .. '/' .. idx end
      if #slots > 0 then
        for i, h in ipairs(redis.call('HMGET', K_HOLDERS, unpack(slots))) do
          if h == SLICED then
            local sl = cjson.decode(redis.call('HGET', K_SLICED, slots[i]))
            local sharers = 0
            for _ in pairs(sl.leases) do sharers = sharers + 1 end
            for _ in pairs(sl.draining) do sharers = sharers + 1 end
            if sl.total_mb - sl.used_mb >= mb and sharers < sl.max and not sl.unclaimed_mb
                and not slices_recalled(sl) then
              local into = (tonumber(sl.util_avg) or 0) < busy_pct and shared or busy
              into[#into + 1] = {slot = slots[i], room = sl.total_mb - sl.used_mb}
            end
          end
        end
      end
      local function by_room(a, b)
        if a.room ~= b.room then return a.room < b.room end
        return a.slot < b.slot
      end
      table.sort(shared, by_room)
      table.sort(busy, by_room)
      for _, idx in ipairs(free) do
        if inv_memory(inv_raw, idx) >= mb then fresh[#fresh + 1] = idx end
      end
      if #shared + #fresh + #busy >= k then
        local used_fresh = math.min(#fresh, math.max(0, k - #shared))
        local used_busy = math.max(0, k - #shared - used_fresh)
        local left = 0
        for i = 1, math.min(k, #shared) do left = left + shared[i].room - mb end
        for i = 1, used_busy do left = left + busy[i].room - mb end
        local key = {used_busy, used_fresh, left, node}
        local better = not best_key
        for j = 1, 4 do
          if better or key[j] ~= best_key[j] then
            better = better or key[j] < best_key[j]
            break
          end
        end
        if better then
          -- the sliced GPUs it takes, in order: not busy ones, then (after the free ones) busy ones
          local take = {}
          for i = 1, math.min(k, #shared) do take[#take + 1] = shared[i] end
          for i = 1, used_busy do take[#take + 1] = busy[i] end
          best, best_key = {node = node, inv_raw = inv_raw, free = free, shared = take, fresh = fresh,
                            n_fresh = used_fresh}, key
        end
      end
    end
  end
  if not best then return nil end
  local out = {}
  for _, sh in ipairs(best.shared) do
    out[#out + 1] = {node = best.node, index = tonumber(string.match(sh.slot, '/(%d+)$')), slot = sh.slot}
  end
  local taken, rest = {}, best.free
  for i = 1, best.n_fresh do
    local idx = best.fresh[i]
    taken[idx] = true
    local left = {}
    for _, f in ipairs(best.free) do if not taken[f] then left[#left + 1] = f end end
    out[#out + 1] = {node = best.node, index = idx, slot = best.node .. '/' .. idx, fresh = true, rest = left,
                     old_count = #rest, total_mb = inv_memory(best.inv_raw, idx), max = max_sharers}
    rest = left
  end
  return out
end

-- For a recall of whole GPUs (recall in _lib_recall.lua: a booking's holder, or a warm eviction with
-- rank warm_rank, which takes only a GPU whose slices are all warm): the GPUs that the
-- live slices `slices` of the pool share, each a victim that frees one whole GPU once every slice
-- on it is gone. per[node].victims gets {l = a slice, more = the GPU's other slices, count = 1,
-- rank = the highest of their ranks, lost = their lost work, each weighed by its fraction}; a GPU
-- whose live slices are all being recalled already counts as coming free (per[node].have), and
-- one with a slice that rank(l) refuses is no victim.
local function slice_victims(per, slices, rank)
  local gpus, order = {}, {}
  for _, l in ipairs(slices) do
    local p = per[l.node]
    for _, g in ipairs(p and l.gpus or {}) do  -- k slices of one lease: on each of its GPUs
      local slot = l.node .. '/' .. g.index
      local u = gpus[slot]
      if not u then
        u = {p = p, ls = {}, ok = true, lost = 0}
        gpus[slot] = u
        order[#order + 1] = slot
      end
      if not l.recall_at then
        local r = rank(l)
        if r == nil then
          u.ok = false
        else
          u.ls[#u.ls + 1] = l
          u.rank = math.max(u.rank or r, r)
          -- (a warm slice loses no work, only its warm state: each evicted costs 1, as a warm lease)
          u.lost = u.lost + (l.warm_since and 1 or (NOW - l.created_at) * l.gpu_mem_mb / l.gpu_total_mb)
        end
      end
    end
  end
  for _, slot in ipairs(order) do
    local u = gpus[slot]
    if u.ok and #u.ls == 0 then
      u.p.have = u.p.have + 1
    elseif u.ok then
      table.sort(u.ls, function(x, y) return x.id < y.id end)
      u.p.victims[#u.p.victims + 1] = {l = u.ls[1], more = {unpack(u.ls, 2)}, count = 1, rank = u.rank, lost = u.lost}
    end
  end
end

-- Promise lease `id` `mb` MB of the GPU `p` (allocate_slice's answer): a fresh GPU leaves its node's
-- free list and becomes sliced. Returns the GPU's total memory (MB).
local function grant_slice(id, pool, mb, p)
  local s
  if p.fresh then
    -- Invariant guard, as in grant_parts: a free GPU never has a holder.
    if redis.call('HEXISTS', K_HOLDERS, p.slot) == 1 or redis.call('HEXISTS', K_SLICED, p.slot) == 1 then
      error('invariant broken: free GPU ' .. p.slot .. ' has a holder')
    end
    redis.call('HSET', K_HOLDERS, p.slot, SLICED)
    set_free(p.node, pool, p.rest, p.old_count)
    s = {pool = pool, total_mb = p.total_mb, used_mb = 0, max = p.max, leases = {}, draining = {}}
  else
    s = cjson.decode(redis.call('HGET', K_SLICED, p.slot))
  end
  if s.used_mb + mb > s.total_mb or redis.call('HGET', K_HOLDERS, p.slot) ~= SLICED then
    error('invariant broken: GPU ' .. p.slot .. ' would be promised ' .. (s.used_mb + mb) .. ' of ' .. s.total_mb .. ' MB')
  end
  s.leases[id] = mb
  s.used_mb = s.used_mb + mb
  save_slices(p.slot, s)
  return s.total_mb
end

-- Lease `lease` (a slice) ends on GPU idx of `node`: its memory is free again at once, or, with
-- `pids` (drain_pids' answer), stays promised while its processes drain: the node agent sees the
-- slice's draining entry (node/drain.py reads the ledgers) and reports it clean (drained.lua,
-- slice_drained), ending only the processes the lease named, never a neighbour's. Returns
-- (whether the lease held a slice there, whether the GPU is now whole and goes back to the free list).
local function end_slice(lease, node, idx, pids, state)
  local slot = node .. '/' .. idx
  local raw = redis.call('HGET', K_SLICED, slot)
  local s = raw and cjson.decode(raw)
  local mb = s and s.leases[lease.id]
  if not mb then return false, false end
  s.leases[lease.id] = nil
  if pids then
    s.draining[lease.id] = {mb = mb, user = lease.user, state = state, since = NOW, pids = pids}
  else
    s.used_mb = s.used_mb - mb
  end
  return true, save_slices(slot, s)
end

-- The node agent saw the processes of slice `lease_id` gone from GPU idx of `node`: its memory is
-- free. Returns the ledger's entry for it (nil when it was not draining there) and whether the GPU
-- is now whole and goes back to the free list.
local function slice_drained(node, idx, lease_id)
  local slot = node .. '/' .. idx
  local raw = redis.call('HGET', K_SLICED, slot)
  local s = raw and cjson.decode(raw)
  local d = s and s.draining[lease_id]
  if not d then return nil, false end
  s.draining[lease_id] = nil
  s.used_mb = s.used_mb - d.mb
  return d, save_slices(slot, s)
end

-- A live lease's size in GPUs for fair share and quotas: a slice counts as its fraction of the GPU
-- (k slices on k GPUs: k times it).
local function gpu_share(lease)
  if lease.gpu_mem_mb then return lease.gpu_mem_mb / lease.gpu_total_mb * #lease.gpus end
  return #lease.gpus
end

-- A slice's fraction in milli-GPUs (at least 1 per GPU), the unit of its quota count (count_held).
local function slice_milli(lease)
  return math.max(1, math.floor(lease.gpu_mem_mb * 1000 / lease.gpu_total_mb + 0.5)) * #lease.gpus
end
