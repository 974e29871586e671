-- _lib_recall.lua: taking leases back with notice, for a booking's holder, a request within
-- quota (preemption) or anyone who waits (warm leases). Part of the library: see _lib.lua.

-- Waiter w (wanting n GPUs) found none free: recall -- revoke after notice_ms -- leases that
-- rank(l) accepts (it returns a number, lower recalled first, or nil), fewest GPU-seconds of lost
-- work first, on the node where that frees n GPUs at the least cost (only `only_node` if given).
-- Leases already being recalled count as coming free. Runs once per waiter; returns the node
-- held for it, or nil when no node can be freed that way.
local function recall(w, pool, n, only_node, rank, notice_ms, kind, why, extra)
  if w.recall_node then return w.recall_node end
  if w.deadline <= NOW then return nil end
  local per = {}
  for _, m in ipairs(redis.call('ZRANGEBYLEX', K_FIT, '[' .. pool .. '|', '(' .. pool .. '|~')) do
    local cnt, node = string.match(m, '^[^|]+|(%d+)|(.+)$')
    if not only_node or only_node == '' or only_node == node then
      per[node] = {have = tonumber(cnt), victims = {}}
    end
  end
  local flat = redis.call('HGETALL', K_LEASES)
  local slices = {}
  for i = 2, #flat, 2 do
    local l = cjson.decode(flat[i])
    -- a slice alone frees no whole GPU (its GPU keeps its other slices): a booking recalls the
    -- slices of a GPU together (slice_victims); nothing else recalls slices
    if l.pool == pool and l.gpu_mem_mb then
      slices[#slices + 1] = l
    elseif l.pool == pool then
      -- GPUs per node: a multi-node gang frees its share on each of its nodes (and all its work
      -- is lost wherever it is recalled).
      local on = {}
      for _, g in ipairs(l.gpus) do
        local node = g.node or l.node
        on[node] = (on[node] or 0) + 1
      end
      local r = (not l.recall_at) and rank(l) or nil
      for node, count in pairs(on) do
        local p = per[node]
        if p then
          if l.recall_at then
            p.have = p.have + count
          elseif r then
            -- a warm lease loses no work, only its warm state: each one evicted costs the same
            -- (and of equal cost the larger go first: fewer evicted)
            local lost = l.warm_since and 1 or (NOW - l.created_at) * #l.gpus
            p.victims[#p.victims + 1] = {l = l, count = count, rank = r, lost = lost}
          end
        end
      end
    end
  end
  if kind == 'borrow_recalled' then slice_victims(per, slices, rank) end
  local best, best_cost, best_list, best_over = nil, nil, nil, nil
  for node, p in pairs(per) do
    table.sort(p.victims, function(x, y)
      if x.rank ~= y.rank then return x.rank < y.rank end
      if x.lost ~= y.lost then return x.lost < y.lost end
      if x.count ~= y.count then return x.count > y.count end
      return x.l.id < y.l.id
    end)
    local have, cost, list = p.have, 0, {}
    for _, v in ipairs(p.victims) do
      if have >= n then break end
      list[#list + 1] = v.l
      for _, o in ipairs(v.more or {}) do list[#list + 1] = o end  -- a sliced GPU's other slices
      have = have + v.count
      cost = cost + v.lost
    end
    -- the least lost, then best fit (the fewest GPUs left over on the node), then by name
    local over = have - n
    if have >= n and (best_cost == nil or cost < best_cost
        or (cost == best_cost and (over < best_over or (over == best_over and node < best)))) then
      best, best_cost, best_list, best_over = node, cost, list, over
    end
  end
  if not best then return nil end
  local due = NOW + notice_ms
  for _, l in ipairs(best_list) do
    if kind == 'borrow_recalled' then l.borrowed = true end
    l.recall_at = due
    l.recall_code, l.recall_why = RECALL_CODE[kind], why
    if kind == 'evicting' then  -- a warm lease runs nothing: its kernel ends or suspends the worker
      l.recall_reason = why .. ' (a warm lease is lent out when someone waits)'
    else
      l.recall_reason = why .. '; save your work: the GPUs go back in ' .. math.floor(notice_ms / 1000) .. ' s'
    end
    redis.call('HSET', K_LEASES, l.id, cjson.encode(l))
    redis.call('ZADD', K_RECALL, due, l.id)
    local ev = {lease = l.id, user = l.user, pool = pool, node = l.node, requested_by = w.user, recall_at = due,
                reason = l.recall_reason, cause = {code = l.recall_code, by = 'server', why = why}}
    for k, v in pairs(extra) do ev[k] = v end
    emit(kind, ev)
  end
  w.recall_node = best
  local raw = redis.call('HGET', K_WAITERS, w.id)
  if raw then
    local stored = cjson.decode(raw)
    stored.recall_node = best
    redis.call('HSET', K_WAITERS, w.id, cjson.encode(stored))
  end
  return best
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
                {reservation = r.id, owner = r.owner})
end
