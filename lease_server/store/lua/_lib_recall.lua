-- _lib_recall.lua: taking leases back with notice, for a booking's holder, a request within
-- quota (preemption) or anyone who waits (warm leases). Part of the library: see _lib.lua.

-- Recall the leases `list` for waiter w, all on `node`, which is then held for w: each gets
-- recall_at (revoked then unless released), leaves its class of the recall index and is told
-- (event `kind`). Returns node.
local function recall_these(w, pool, node, list, notice_ms, kind, why, extra)
  local due = NOW + notice_ms
  for _, l in ipairs(list) do
    local old_member = victim_member(l)
    if kind == 'borrow_recalled' then l.borrowed = true end
    l.recall_at = due
    l.recall_code, l.recall_why = RECALL_CODE[kind], why
    l.recall_for, l.recalled_at = w.user, NOW  -- whom it goes to, and since when (the owner's notebook says so)
    if kind == 'evicting' then  -- a warm lease runs nothing: its kernel ends or suspends the worker
      l.recall_reason = why .. ' (a warm lease is lent out when someone waits)'
    else
      l.recall_reason = why .. '; save your work: the GPUs go back in ' .. math.floor(notice_ms / 1000) .. ' s'
    end
    redis.call('HSET', K_LEASES, l.id, cjson.encode(l))
    index_victim(old_member, l)
    redis.call('ZADD', K_RECALL, due, l.id)
    local ev = {lease = l.id, user = l.user, pool = pool, node = l.node, requested_by = w.user, recall_at = due,
                reason = l.recall_reason, cause = {code = l.recall_code, by = 'server', why = why}}
    for k, v in pairs(extra) do ev[k] = v end
    emit(kind, ev)
  end
  w.recall_node = node
  local raw = redis.call('HGET', K_WAITERS, w.id)
  if raw then
    local stored = cjson.decode(raw)
    stored.recall_node = node
    redis.call('HSET', K_WAITERS, w.id, cjson.encode(stored))
  end
  return node
end

-- Waiter w (wanting n GPUs) found none free: recall -- revoke after notice_ms -- leases that
-- rank(l) accepts (it returns a number, lower recalled first, or nil), fewest GPU-seconds of lost
-- work first, on the node where that frees n GPUs at the least cost (only `only_node` if given).
-- `classes`: the classes of the recall index that rank can accept. Leases already being recalled
-- count as coming free. Runs once per waiter; returns the node held for it, or nil when no
-- candidate node can be freed that way. A recall of warm leases (rank independent of the waiter)
-- that found nothing for n is not tried again for n or more in the same dispatch.
-- `no_slices`: the pool holds no slices (it does not share), which lets a warm eviction skip reading
-- the leases that are neither warm nor being recalled.
local function recall(w, pool, n, only_node, rank, notice_ms, kind, why, extra, classes, no_slices)
  if w.recall_node then return w.recall_node end
  if w.deadline <= NOW then return nil end
  -- (the dispatch's cache, as allocate's: nothing frees GPUs within one dispatch)
  local miss = (kind == 'evicting' and not only_node) and SCHED_CACHE['~miss|' .. pool] or nil
  if miss and miss.r and n >= miss.r then return nil end
  -- ... and across calls: a warm eviction that found no node for n GPUs is not tried again for n
  -- or more within EVICT_RETRY_MS while the pool's warm leases are the same (key evict_miss). Each
  -- try reads up to 33 nodes and their leases; under a queue every grant and release dispatched it
  -- again (10 ms a call at 10,000 GPUs). What a release frees meanwhile is seen a second later.
  local warm_now
  if miss then
    warm_now = redis.call('HGET', K_HELD_BY, pool .. '|~warm') or '0'
    local memo = redis.call('HGET', K_EVICT_MISS, pool)
    local mn, mat, mwarm = string.match(memo or '', '^(%d+)|(%d+)|(%d+)$')
    if mn and n >= tonumber(mn) and NOW - tonumber(mat) < EVICT_RETRY_MS and mwarm == warm_now then
      miss.r = math.min(n, miss.r or n)
      return nil
    end
  end
  local nodes, seen = {}, {}
  local function consider(node)
    if node and node ~= '' and not seen[node] then seen[node] = true; nodes[#nodes + 1] = node end
  end
  local entries, all_recalling = {}, false  -- the entries read; all of class r read?
  if only_node and only_node ~= '' then
    consider(only_node)
  else
    local cls = {'r'}
    for _, c in ipairs(classes) do cls[#cls + 1] = c end
    for _, c in ipairs(cls) do
      local lo, hi = '[' .. pool .. '|' .. c .. '|', '(' .. pool .. '|' .. c .. '|~'
      local members = redis.call('ZRANGEBYLEX', K_VICTIMS, lo, hi, 'LIMIT', 0, RECALL_READ)
      if c == 'r' then all_recalling = #members < RECALL_READ end
      for _, m in ipairs(members) do
        local r, node, id = string.match(m, '^[^|]+|%a|(%d+)|(.+)|([^|]+)$')
        consider(node)
        -- (a warm lease's entry starts with 999 - its GPUs: victim_member)
        entries[#entries + 1] = {c = c, node = node, id = id, size = c == 'w' and 999 - tonumber(string.sub(r, 1, 3))}
      end
    end
    consider(fullest_node(pool))
    if kind == 'borrow_recalled' then
      -- a booking also recalls slices (slice_victims): the nodes of the pool's sliced GPUs that
      -- have room left, as many as of each class above
      for _, m in ipairs(redis.call('ZRANGEBYLEX', K_SLICE_FIT, '[' .. pool .. '|', '(' .. pool .. '|~',
                                    'LIMIT', 0, RECALL_READ)) do
        consider(string.match(m, '^[^|]+|%d+|(.+)/%d+$'))
      end
    end
  end
  -- Each candidate node as it stands: its free GPUs and the leases on its GPUs that
  -- the recall weighs: those it may take (rank) and those already being recalled (their GPUs are
  -- coming free). Read for all candidates together, one HMGET of each kind, not a call per node or
  -- per lease: at 16 candidates that reading cost more than the choice.
  local per, decoded, ranks, slices, slice_seen = {}, {}, {}, {}, {}
  local function weigh(p, id, l, count)
    if l and l.pool == pool and not l.gpu_mem_mb then
      if l.recall_at then
        p.have = p.have + count
      elseif ranks[id] then
        -- a warm lease loses no work, only its warm state: each one evicted costs the same
        -- (and of equal cost the larger go first: fewer evicted). A multi-node gang frees its
        -- share on each of its nodes (and all its work is lost wherever it is recalled).
        local lost = l.warm_since and 1 or (NOW - l.created_at) * #l.gpus
        p.victims[#p.victims + 1] = {l = l, count = count, rank = ranks[id], lost = lost}
      end
    end
  end
  local function decode_all(ids, keep)
    local raws = #ids > 0 and redis.call('HMGET', K_LEASES, unpack(ids)) or {}
    for i, id in ipairs(ids) do
      local raw, l = raws[i], false
      if raw and (not keep or keep(raw)) then
        l = cjson.decode(raw)
        if not l.recall_at then ranks[id] = rank(l) end
      end
      decoded[id] = l
    end
  end
  -- (whether a node is up, that is has a fit entry, is asked only of the nodes that would be
  -- chosen, best first, below: one call, not one per candidate)
  local frees = #nodes > 0 and redis.call('HMGET', K_FREE, unpack(nodes)) or {}
  local known = {}  -- the candidates with a free list (registered nodes), up or not
  for i, node in ipairs(nodes) do
    if frees[i] then
      local free = list_count(frees[i])
      per[node] = {have = free, free = free, victims = {}}
      known[#known + 1] = node
    end
  end
  -- A warm eviction where every lease being recalled was read, in a pool without slices (no_slices:
  -- the pool does not share; a sliced GPU's slices count only when read whole), settles a node from
  -- the entries read alone when they are all the warm leases on it (the node's count of warm GPUs
  -- says so): the other leases on it are neither warm nor being recalled, and play no part. A warm
  -- lease's entry says all the choice needs (its node and size: it never spans nodes; each costs
  -- the same), so only the leases being recalled, and those chosen, are read. Any other node is
  -- read whole below.
  local whole = known
  if kind == 'evicting' and all_recalling and no_slices and #known > 0 then
    local recalling = {}
    for _, e in ipairs(entries) do
      if e.c == 'r' then recalling[#recalling + 1] = e.id end
    end
    decode_all(recalling)
    local fields = {}
    for i, node in ipairs(known) do fields[i] = pool .. '|~warm@' .. node end
    local warm_on = redis.call('HMGET', K_HELD_BY, unpack(fields))
    local coming, victims, warm_seen = {}, {}, {}
    for _, e in ipairs(entries) do
      if e.c == 'w' then
        victims[e.node] = victims[e.node] or {}
        table.insert(victims[e.node], {l = {id = e.id, unread = true}, count = e.size, rank = 0, lost = 1})
        warm_seen[e.node] = (warm_seen[e.node] or 0) + e.size
      elseif e.c == 'r' then
        local l = decoded[e.id]
        if l and l.pool == pool and not l.gpu_mem_mb then
          for _, g in ipairs(l.gpus) do
            local nd = g.node or l.node
            coming[nd] = (coming[nd] or 0) + 1
          end
          if l.warm_since then warm_seen[l.node] = (warm_seen[l.node] or 0) + #l.gpus end
        end
      end
    end
    whole = {}
    for i, node in ipairs(known) do
      if (warm_seen[node] or 0) == tonumber(warm_on[i] or '0') then
        per[node].have = per[node].have + (coming[node] or 0)
        per[node].victims = victims[node] or {}
      else
        whole[#whole + 1] = node
      end
    end
  end
  -- Nodes read whole: every GPU's holder, and each lease on them.
  local slots, ranges = {}, {}
  if #whole > 0 then
    local invs = redis.call('HMGET', K_NODES, unpack(whole))
    for i, node in ipairs(whole) do
      local first = #slots + 1
      for idx in string.gmatch(invs[i] or '', '"index":(%d+)') do slots[#slots + 1] = node .. '/' .. idx end
      ranges[i] = {first, #slots}
    end
  end
  local holders = #slots > 0 and redis.call('HMGET', K_HOLDERS, unpack(slots)) or {}
  local wanted, ids, on_node = {}, {}, {}
  for i, node in ipairs(whole) do
    local on, order = {}, {}
    for j = ranges[i][1], ranges[i][2] do
      local h = holders[j]
      -- "~": draining, "~slices": shared by slices; a slice alone frees no whole GPU (its GPU
      -- keeps its other slices): a booking recalls the slices of a GPU together, and a warm
      -- eviction a GPU whose slices are all warm (slice_victims; evict_for_slice lends a warm
      -- slice's memory to a slice request)
      if h == SLICED and (kind == 'borrow_recalled' or kind == 'evicting') then
        local raw = redis.call('HGET', K_SLICED, slots[j])
        for id in pairs(raw and cjson.decode(raw).leases or {}) do
          local sl = not slice_seen[id] and redis.call('HGET', K_LEASES, id)  -- (k slices: once)
          if sl then
            slice_seen[id] = true
            slices[#slices + 1] = cjson.decode(sl)
          end
        end
      elseif h and string.sub(h, 1, 1) ~= '~' then
        if not on[h] then on[h] = 0; order[#order + 1] = h end
        on[h] = on[h] + 1
        if decoded[h] == nil and not wanted[h] then wanted[h] = true; ids[#ids + 1] = h end
      end
    end
    on_node[i] = {on = on, order = order}
  end
  -- A warm eviction takes only warm leases, and counts those being recalled as coming free: a
  -- lease whose record has neither field plays no part, and is not decoded. (cjson writes a key
  -- as "name": with no space; a quote inside a string value is escaped, so never matches.)
  decode_all(ids, kind == 'evicting' and function(raw)
    return string.find(raw, '"warm_since":', 1, true) or string.find(raw, '"recall_at":', 1, true)
  end or nil)
  for i, node in ipairs(whole) do
    for _, id in ipairs(on_node[i].order) do weigh(per[node], id, decoded[id], on_node[i].on[id]) end
  end
  if kind == 'borrow_recalled' or kind == 'evicting' then slice_victims(per, slices, rank) end
  local able = {}
  local function first(x, y)
    if x.rank ~= y.rank then return x.rank < y.rank end
    if x.lost ~= y.lost then return x.lost < y.lost end
    if x.count ~= y.count then return x.count > y.count end
    return x.l.id < y.l.id
  end
  for node, p in pairs(per) do
    if #p.victims > 1 then table.sort(p.victims, first) end
    local have, cost, list, listed = p.have, 0, {}, {}
    for _, v in ipairs(p.victims) do
      if have >= n then break end
      -- a sliced GPU's other slices too; a lease of k slices once, however many of its GPUs count
      for _, l in ipairs({v.l, unpack(v.more or {})}) do
        if not listed[l.id] then listed[l.id] = true; list[#list + 1] = l end
      end
      have = have + v.count
      cost = cost + v.lost
    end
    if have >= n then able[#able + 1] = {node = node, cost = cost, over = have - n, list = list, free = p.free} end
  end
  -- the least lost, then best fit (the fewest GPUs left over on the node), then by name; the first
  -- that is up
  table.sort(able, function(x, y)
    if x.cost ~= y.cost then return x.cost < y.cost end
    if x.over ~= y.over then return x.over < y.over end
    return x.node < y.node
  end)
  local best, best_list
  for _, a in ipairs(able) do
    if redis.call('ZSCORE', K_FIT, fit_member(pool, a.node, a.free)) then
      best, best_list = a.node, a.list
      break
    end
  end
  if not best then
    if miss then
      miss.r = math.min(n, miss.r or n)
      redis.call('HSET', K_EVICT_MISS, pool, string.format('%d|%d|%s', n, NOW, warm_now))
    end
    return nil
  end
  for i, chosen in ipairs(best_list) do  -- the chosen leases known by their entries alone, read now
    if chosen.unread then
      local raw = redis.call('HGET', K_LEASES, chosen.id)
      if not raw then error('invariant broken: lease ' .. chosen.id .. ' in the recall index is gone') end
      best_list[i] = cjson.decode(raw)
    end
  end
  return recall_these(w, pool, best, best_list, notice_ms, kind, why, extra)
end

-- A warm lease (warm.lua) may be evicted for any waiter; nothing else is, by that rule.
local function warm_rank(l)
  if l.warm_since then return 0 end
  return nil
end

-- A slice request w (w.gpu_mem_mb MB) found no room: warm leases are lent to it as to anyone who
-- waits. First the newest RECALL_READ warm slices (class v of the recall index): on a sliced GPU
-- whose free memory, plus what its slices already being evicted give back, plus its warm slices'
-- would hold w, the fewest of those warm slices (largest first) that make room, on the GPU where
-- that evicts the fewest, then the least memory. Failing that, a whole GPU from warm leases
-- (recall with warm_rank), where the slice then takes a fresh GPU. A GPU whose slices a booking is
-- recalling is passed over (it is being emptied for its holder). Returns the node held for w, or
-- nil. Bounded: at most RECALL_READ leases and their GPUs' ledgers (max_sharers reads each).
local function evict_for_slice(w, pool, notice_ms)
  if w.recall_node then return w.recall_node end
  if w.deadline <= NOW then return nil end
  local miss = SCHED_CACHE['~miss|' .. pool]
  if miss and miss.v and w.gpu_mem_mb >= miss.v then return nil end
  local on, slots = {}, {}
  local lo, hi = '[' .. pool .. '|v|', '(' .. pool .. '|v|~'
  -- (k slices on k GPUs: the warm slices of one GPU make room for one slice only; a request for
  -- several takes whole GPUs from warm leases, below)
  local members = (w.gpus or 1) == 1 and redis.call('ZRANGEBYLEX', K_VICTIMS, lo, hi, 'LIMIT', 0, RECALL_READ) or {}
  for _, m in ipairs(members) do
    local node, id = string.match(m, '^[^|]+|v|%d+|(.+)|([^|]+)$')
    local raw = redis.call('HGET', K_LEASES, id)
    if raw and tonumber(redis.call('ZSCORE', K_ALIVE, node) or '-1') >= NOW then
      local l = cjson.decode(raw)
      for _, g in ipairs(l.gpus) do  -- a warm lease of k slices gives memory back on each of its GPUs
        local slot = node .. '/' .. g.index
        if not on[slot] then on[slot] = {node = node, ls = {}}; slots[#slots + 1] = slot end
        table.insert(on[slot].ls, l)
      end
    end
  end
  local best, best_list, best_n, best_mb
  for _, slot in ipairs(slots) do
    local u = on[slot]
    local sraw = redis.call('HGET', K_SLICED, slot)
    local s = sraw and cjson.decode(sraw)
    local room, ok = s and (s.total_mb - s.used_mb) or 0, s ~= nil and not s.unclaimed_mb  -- (_lib_slice.lua)
    for id, mb in pairs(s and s.leases or {}) do
      local lraw = redis.call('HGET', K_LEASES, id)
      if lraw and string.find(lraw, '"recall_at"', 1, true) then
        if string.find(lraw, '"recall_code":"evicted"', 1, true) then room = room + mb else ok = false end
      end
    end
    if ok then
      table.sort(u.ls, function(x, y)
        if x.gpu_mem_mb ~= y.gpu_mem_mb then return x.gpu_mem_mb > y.gpu_mem_mb end
        return x.id < y.id
      end)
      local list, mb = {}, 0
      for _, l in ipairs(u.ls) do
        if room >= w.gpu_mem_mb then break end
        list[#list + 1] = l
        room, mb = room + l.gpu_mem_mb, mb + l.gpu_mem_mb
      end
      if room >= w.gpu_mem_mb and #list > 0
          and (best == nil or #list < best_n or (#list == best_n and mb < best_mb)) then
        best, best_list, best_n, best_mb = u.node, list, #list, mb
      end
    end
  end
  if best then
    return recall_these(w, pool, best, best_list, notice_ms, 'evicting', 'evicted for ' .. w.user .. "'s request", {})
  end
  local hold = recall(w, pool, w.gpus or 1, nil, warm_rank, notice_ms, 'evicting',
                      'evicted for ' .. w.user .. "'s request", {}, {'w', 'v'})
  if not hold and miss then miss.v = math.min(w.gpu_mem_mb, miss.v or w.gpu_mem_mb) end
  return hold
end

-- A booking holder's request: recall leases not served from a booking, borrowed ones first.
local function recall_for_booking(w, a, pool)
  local r = a.r
  local function rank(l)
    if l.resv then return nil end
    if l.warm_since then return 0 end  -- lendable: its holder runs nothing now
    return l.borrowed and 1 or 2
  end
  local why = 'recalled for ' .. r.owner .. "'s booking " .. r.id .. ' (' .. r.gpus .. ' GPU(s) of ' .. pool .. ')'
  return recall(w, pool, w.gpus, r.colocate and r.node or nil, rank, r.notice_ms or 30000, 'borrow_recalled', why,
                {reservation = r.id, owner = r.owner}, {'w', 'v', 'b', 'o', 'p'})
end
