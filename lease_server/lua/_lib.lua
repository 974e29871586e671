-- _lib.lua: the helpers of the state-changing scripts; lease_server/scripts.py prepends to each
-- script the ones it calls.
-- It defines no entry point of its own; each script below it reads its own ARGV from ARGV[6] on.
--
-- KEYS: none of its own. Each script declares the keys it uses, its helpers' included, in its
-- header ("-- KEYS: leases deadlines ..."); lease_server/scripts.py binds them as K_<NAME> locals
-- (K_LEASES = KEYS[i]) and includes only the helpers below that the script calls, transitively.
-- What each key holds: lease_server/keys.py.
-- Common ARGV:
--   ARGV[1] = virtual "now" in ms, or "" to use Redis TIME (only the simulator passes a value)
--   ARGV[2] = approximate maximum length of the event stream
--   ARGV[3] = fair-share half-life in seconds
--   ARGV[4] = how long ended leases stay readable, ms
--   ARGV[5] = the fencing epoch: Sentinel's config epoch of the primary the server found (0 without
--             Sentinel); see next_token below
-- Return codes: lease_server/scripts.py's Code enum (tests/test_scripts.py checks the two agree).
local OK, QUEUED, BUSY, NO_SUCH, ENDED, NOT_OWNER, STALE, EXPIRED = 0, 1, 2, 3, 4, 5, 6, 7
local UNKNOWN_POOL, UNSATISFIABLE, DUPLICATE, UNKNOWN_NODE, REMOVED = 8, 9, 10, 11, 12
local LIMIT, NOT_DUE, CLASH, WARNED, INVALID = 13, 14, 15, 16, 17
local WEEK_MS = 7 * 24 * 3600 * 1000

-- A call's own state, set by begin() before the script's body runs. Scripts sent with EVAL run
-- begin() once; in the Functions library (scripts.py library()) these locals outlive a call, so
-- begin() sets every one of them afresh (SCHED_CACHE included) and nothing leaks between calls.
local NOW, EVENT_MAX, HALF_LIFE_MS, RETENTION_MS, FENCE_EPOCH
-- The simulator's virtual clock runs no processes: its forced ends have nothing to drain.
local VIRTUAL
local SCHED_CACHE
local function begin()
  if ARGV[1] ~= '' then
    NOW = tonumber(ARGV[1])
  else
    local t = redis.call('TIME')
    NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  EVENT_MAX = ARGV[2]
  HALF_LIFE_MS = tonumber(ARGV[3]) * 1000
  RETENTION_MS = tonumber(ARGV[4])
  FENCE_EPOCH = tonumber(ARGV[5]) or 0
  VIRTUAL = ARGV[1] ~= ''
  SCHED_CACHE = {}
end

local function emit(kind, body)
  body.ts = NOW
  redis.call('XADD', K_EVENTS, 'MAXLEN', '~', EVENT_MAX, '*', 'type', kind, 'data', cjson.encode(body))
end

-- Free lists are JSON arrays of integers ("[0,3,5]"), read and written without cjson (they are
-- on every grant and release path).
local function decode_list(raw)
  local out = {}
  if raw then
    for v in string.gmatch(raw, '%-?%d+') do out[#out + 1] = tonumber(v) end
  end
  return out
end

local function encode_list(list)
  return '[' .. table.concat(list, ',') .. ']'
end

-- A node's inventory JSON is canonical (inventory.py writes it with sorted keys and no spaces), so
-- one GPU's entry, {"index":I,"memory_mb":M,"model":"...","uuid":"U"}, is found by a plain search
-- instead of decoding the whole inventory on every grant and release. Any other layout (spaces,
-- escapes in the uuid, other keys) is not found that way, and the callers then decode it.
local function inv_find(raw, idx)
  return string.find(raw, '{"index":' .. idx .. ',', 1, true)
end

-- {index = uuid} for `indexes` of the inventory `raw` (a GPU it does not list: "").
local function inv_uuids(raw, indexes)
  local out = {}
  for _, idx in ipairs(indexes) do
    local at = inv_find(raw, idx)
    local uuid = at and string.match(raw, '^{"index":%d+,[^{}]-"uuid":"([^"\\]*)"}', at)
    if not uuid then
      local uuid_of = {}
      for _, g in ipairs(cjson.decode(raw).gpus) do uuid_of[g.index] = g.uuid end
      for _, i in ipairs(indexes) do out[i] = uuid_of[i] or '' end
      return out
    end
    out[idx] = uuid
  end
  return out
end

-- {index = true} for those of `indexes` that the inventory `raw` lists.
local function inv_present(raw, indexes)
  local out = {}
  for _, idx in ipairs(indexes) do
    if not inv_find(raw, idx) then
      for _, g in ipairs(cjson.decode(raw).gpus) do out[g.index] = true end
      return out
    end
    out[idx] = true
  end
  return out
end

local function fit_member(pool, node, count)
  return pool .. '|' .. string.format('%05d', count) .. '|' .. node
end

-- Replace a node's free list, keeping its fit entry in step when the node is up. "Up" is exactly
-- "has a fit entry": mark_down removes it, a heartbeat after that adds it back.
local function set_free(node, pool, list, old_count)
  if old_count == nil then old_count = #decode_list(redis.call('HGET', K_FREE, node)) end
  local old_member = fit_member(pool, node, old_count)
  table.sort(list)
  redis.call('HSET', K_FREE, node, encode_list(list))
  if redis.call('ZREM', K_FIT, old_member) == 1 then
    redis.call('ZADD', K_FIT, 0, fit_member(pool, node, #list))
  end
end

local function mark_down(node, why)
  local inv = cjson.decode(redis.call('HGET', K_NODES, node))
  local free = decode_list(redis.call('HGET', K_FREE, node))
  redis.call('ZREM', K_FIT, fit_member(inv.pool, node, #free))
  -- -1: known to be down, so the sweeper's range (0, now] does not find it again.
  redis.call('ZADD', K_ALIVE, -1, node)
  emit('node_down', {node = node, pool = inv.pool, reason = why})
end

-- A user's standing in fair share: GPU-seconds used in the pool, decayed with the half-life,
-- plus those of the leases running now (u.r GPUs since u.t), so a user who holds many GPUs
-- right now is behind one who holds none, before any of those leases ends.
-- A usage record is JSON {"v":..,"t":..,"r":..}, written by touch_usage in that one layout; it is
-- read with patterns, and decoded only if written otherwise (r is optional).
local function usage_of(raw)
  local v = tonumber(string.match(raw, '"v":%s*([^,}%s]+)'))
  local t = tonumber(string.match(raw, '"t":%s*([^,}%s]+)'))
  if not v or not t then
    local u = cjson.decode(raw)
    return u.v, u.t, u.r or 0
  end
  return v, t, tonumber(string.match(raw, '"r":%s*([^,}%s]+)') or '0') or 0
end

local function decayed_of(raw)
  if not raw then return 0, 0 end
  local v, t, r = usage_of(raw)
  return v * math.pow(0.5, (NOW - t) / HALF_LIFE_MS) + r * (NOW - t) / 1000, r
end

-- The standing dispatch orders by also counts each GPU held now as the GPU-time it would add if
-- held on (half-life / ln 2): a user stands behind one who holds nothing from the grant on, not
-- only once their lease has run a while.
local function decayed_usage(pool, user)
  local v, r = decayed_of(redis.call('HGET', K_USAGE, pool .. '|' .. user))
  return v + r * HALF_LIFE_MS / 1000 / math.log(2)
end

-- Fold the time since the last change into the usage, add `extra` GPU-seconds, change the GPUs
-- running by dr.
local function touch_usage(pool, user, dr, extra)
  local field = pool .. '|' .. user
  local v, r = decayed_of(redis.call('HGET', K_USAGE, field))
  redis.call('HSET', K_USAGE, field,
             string.format('{"v":%.17g,"t":%d,"r":%d}', v + extra, NOW, math.max(0, r + dr)))
end

-- The user's count of requests in the queue now (acquire.lua caps it): +1 as a request joins the
-- queue, -1 whenever one leaves it (granted, withdrawn, timed out, abandoned).
local function count_waiting(user, d)
  if redis.call('HINCRBY', K_WAITING_BY, user, d) <= 0 then redis.call('HDEL', K_WAITING_BY, user) end
end

-- Best fit: the up node of the pool with the fewest free GPUs that still has n, skipping `exclude`
-- (the node held back for a blocked head of the queue). O(log N): one ZRANGEBYLEX per candidate.
-- While the pool has warm leases, their GPUs count as free for the fit (they are lendable: a hole
-- a large request can have), among the 16 best candidates: small requests then do not settle
-- beside warm leases and leave no node whole for a large one.
-- A node whose heartbeat ran out is marked down here, so a dead agent's GPUs are never granted
-- even between two sweeps.
local function allocate(pool, n, exclude)
  local lo = '[' .. pool .. '|' .. string.format('%05d', n) .. '|'
  local hi = '(' .. pool .. '|~'
  local warm = tonumber(redis.call('HGET', K_HELD_BY, pool .. '|~warm') or '0') > 0
  for _ = 1, 64 do
    local members = redis.call('ZRANGEBYLEX', K_FIT, lo, hi, 'LIMIT', 0, warm and 16 or 2)
    local node, best
    for _, m in ipairs(members) do
      local cnt, cand = string.match(m, '^[^|]+|(%d+)|(.+)$')
      if cand ~= exclude then
        if not warm then node = cand; break end
        local k = tonumber(cnt) + tonumber(redis.call('HGET', K_HELD_BY, pool .. '|~warm@' .. cand) or '0')
        if not best or k < best then node, best = cand, k end
      end
    end
    if not node then return nil end
    local deadline = tonumber(redis.call('ZSCORE', K_ALIVE, node) or '-1')
    if deadline >= NOW then
      local free = decode_list(redis.call('HGET', K_FREE, node))
      local taken, rest = {}, {}
      for i, idx in ipairs(free) do
        if i <= n then taken[#taken + 1] = idx else rest[#rest + 1] = idx end
      end
      return node, taken, rest, #free
    end
    mark_down(node, 'heartbeat missed')
  end
  return nil
end

-- The node a blocked head of the queue is closest to filling: the up node with the most free GPUs.
local function fullest_node(pool)
  local m = redis.call('ZREVRANGEBYLEX', K_FIT, '(' .. pool .. '|~', '[' .. pool .. '|', 'LIMIT', 0, 1)[1]
  if not m then return '' end
  return string.match(m, '^[^|]+|%d+|(.+)$')
end

-- ---- reservations -------------------------------------------------------------------------
-- A booking r: {id, owner ("alice" | "team:ml"), pool, gpus, start, end (ms, UTC), repeat
-- ("none" | "weekly": occurrence k is [start + k weeks, end + k weeks), exactly 168 h apart, so
-- no daylight-saving shift), occurrences, colocate, node, held (GPUs its holders hold now), used
-- {k: true}, released {k: ms} (no-show or ended early), notice_ms, no_show_ms, state}.

local function resv_of_pool(pool)
  local out = {}
  for _, m in ipairs(redis.call('ZRANGEBYLEX', K_RESV_IDX, '[' .. pool .. '|', '(' .. pool .. '|~')) do
    local raw = redis.call('HGET', K_RESV, string.match(m, '^[^|]+|(.+)$'))
    if raw then out[#out + 1] = cjson.decode(raw) end
  end
  return out
end

-- Occurrence k of r as [s, e), e cut short where it was released (no-show or ended early).
local function occ_span(r, k)
  local s, e = r.start + k * WEEK_MS, r['end'] + k * WEEK_MS
  local rel = r.released and r.released[tostring(k)]
  if rel and rel < e then e = math.max(s, rel) end
  return s, e
end

-- The occurrences of r that overlap [lo, hi): a list of {k, s, e}.
local function occs_between(r, lo, hi)
  local out, first, last = {}, 0, 0
  if r['repeat'] == 'weekly' then
    first = math.max(0, math.floor((lo - r['end']) / WEEK_MS))
    last = math.min(r.occurrences - 1, math.floor((hi - r.start) / WEEK_MS))
  end
  for k = first, last do
    local s, e = occ_span(r, k)
    if s < hi and lo < e and s < e then out[#out + 1] = {k = k, s = s, e = e} end
  end
  return out
end

-- The occurrence of an active booking r in force at time t, or nil.
local function occ_at(r, t)
  if r.state ~= 'active' then return nil end
  local o = occs_between(r, t, t + 1)[1]
  return o and o.k
end

local function team_set(csv)
  local set = {}
  for t in string.gmatch(csv or '', '[^,]+') do set[t] = true end
  return set
end

local function holds_booking(r, user, teams)
  if r.owner == user then return true end
  local t = string.match(r.owner, '^team:(.+)$')
  return t ~= nil and teams[t] == true
end

local function save_booking(r)
  redis.call('HSET', K_RESV, r.id, cjson.encode(r))
end

-- Bookings of the pool in force now: {r, k, owed = GPUs booked that its holders do not hold}.
local function active_bookings(pool)
  local acts, owed = {}, 0
  for _, r in ipairs(resv_of_pool(pool)) do
    local k = occ_at(r, NOW)
    if k then
      local o = math.max(0, r.gpus - (r.held or 0))
      acts[#acts + 1] = {r = r, k = k, owed = o}
      owed = owed + o
    end
  end
  return acts, owed
end

-- The booking in force that a request of w.gpus by w.user is served from: the user's own before
-- a team's, and only one with that many GPUs still owed.
local function booking_for(acts, w)
  local teams, best = team_set(w.teams), nil
  for _, a in ipairs(acts) do
    if a.owed >= w.gpus and holds_booking(a.r, w.user, teams) then
      if a.r.owner == w.user then return a end
      best = best or a
    end
  end
  return best
end

local function pool_free(pool)
  local total = 0
  for _, m in ipairs(redis.call('ZRANGEBYLEX', K_FIT, '[' .. pool .. '|', '(' .. pool .. '|~')) do
    total = total + tonumber(string.match(m, '^[^|]+|(%d+)|'))
  end
  return total
end

-- Put r's next no-show check on resv_due: the first occurrence not yet used or released whose
-- no-show deadline (its start, or when the booking was made or changed if later, + no_show_ms)
-- falls inside it. With none left, schedule its removal keep_ms after its last occurrence.
local function schedule_booking(r)
  local k = r.check_k or 0
  local used, released = r.used or {}, r.released or {}
  while k < r.occurrences do
    local s, e = occ_span(r, k)
    local deadline = math.max(s, r.base_at or s) + r.no_show_ms
    if deadline < e and not used[tostring(k)] and not released[tostring(k)] then
      r.check_k = k
      redis.call('ZADD', K_RESV_DUE, deadline, r.id)
      return
    end
    k = k + 1
  end
  r.check_k = k
  redis.call('ZADD', K_RESV_DUE, r['end'] + (r.occurrences - 1) * WEEK_MS + r.keep_ms, r.id)
end

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
  for i = 2, #flat, 2 do
    local l = cjson.decode(flat[i])
    if l.pool == pool then
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
    l.recall_reason = why
    if kind ~= 'evicting' then  -- a warm lease runs nothing: its kernel ends or suspends the worker
      l.recall_reason = why .. '; save your work: the GPUs go back in ' .. math.floor(notice_ms / 1000) .. ' s'
    end
    redis.call('HSET', K_LEASES, l.id, cjson.encode(l))
    redis.call('ZADD', K_RECALL, due, l.id)
    local ev = {lease = l.id, user = l.user, pool = pool, node = l.node, requested_by = w.user, recall_at = due,
                reason = l.recall_reason}
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

-- ---- scheduling ---------------------------------------------------------------------------
-- A pool's scheduling, written by the server from its config: {scheduler = "fifo" | "fair_share"
-- | "priority", quota = {user = GPUs, ["*"] = per-user default, ["team:NAME"] = GPUs},
-- preempt_notice_ms, idle_weight (how much a held-but-idle GPU-second counts in fair share)}.
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
  SCHED_CACHE[pool] = c
  return c
end

-- Whether k more GPUs keep the request's user, and each of its teams, within their quota of the
-- pool. Preemptible leases do not count against a quota.
local function within_quota(w, pool, k)
  local q = sched_of(pool).quota
  local lim = q[w.user] or q['*']
  if lim and tonumber(redis.call('HGET', K_HELD_BY, pool .. '|' .. w.user) or '0') + k > lim then return false end
  for t in string.gmatch(w.teams or '', '[^,]+') do
    local tl = q['team:' .. t]
    if tl and tonumber(redis.call('HGET', K_HELD_BY, pool .. '|team:' .. t) or '0') + k > tl then return false end
  end
  return true
end

-- k more (or, negative, fewer) GPUs held against the quotas of the lease's user and its teams.
local function count_held_k(lease, k)
  redis.call('HINCRBY', K_HELD_BY, lease.pool .. '|' .. lease.user, k)
  for t in string.gmatch(lease.teams or '', '[^,]+') do
    redis.call('HINCRBY', K_HELD_BY, lease.pool .. '|team:' .. t, k)
  end
end

local function count_held(lease, sign)
  count_held_k(lease, sign * #lease.gpus)
end

-- An elastic request (gpus_min < gpus) takes as many as one up node has free now, between its
-- minimum and maximum; any other request exactly its count.
local function allocate_for(w, pool, exclude)
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
-- (several for a multi-node gang, whose GPUs then name their node). Returns the lease and its JSON.
local function grant_parts(w, parts)
  local gpus, taken, nodes, part_gpus = {}, {}, {}, {}
  for _, part in ipairs(parts) do
    local node = part.node
    local uuid_of = inv_uuids(redis.call('HGET', K_NODES, node), part.taken)
    -- Invariant guard, checked before any write: a free GPU never has a holder. If one does, the
    -- state is corrupt, and granting it would be a double grant: fail the script loudly instead.
    for _, idx in ipairs(part.taken) do
      if redis.call('HEXISTS', K_HOLDERS, node .. '/' .. idx) == 1 then
        error('invariant broken: free GPU ' .. node .. '/' .. idx .. ' has a holder')
      end
    end
    for _, idx in ipairs(part.taken) do
      redis.call('HSET', K_HOLDERS, node .. '/' .. idx, w.id)
      local g = {index = idx, uuid = uuid_of[idx] or ''}
      if #parts > 1 then g.node = node end
      gpus[#gpus + 1] = g
      taken[#taken + 1] = idx
    end
    set_free(node, w.pool, part.rest, part.old_count)
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
  if w.booking then
    local r = w.booking.r
    lease.resv = r.id
    r.held = (r.held or 0) + #taken
    r.used = r.used or {}
    r.used[tostring(w.booking.k)] = true
    save_booking(r)
    w.booking.owed = w.booking.owed - #taken
  elseif w.borrowed then
    lease.borrowed = true
  end
  lease.teams, lease.priority = w.teams, w.priority or 1
  if (w.gpus_min or w.gpus) < w.gpus then lease.elastic = {min = w.gpus_min, max = w.gpus} end
  touch_usage(w.pool, w.user, #taken, 0)
  if w.booking then
    -- served from a booking: booked GPUs do not count against a quota
  elseif not within_quota(w, w.pool, #taken) then
    lease.preemptible = true
    redis.call('HINCRBY', K_HELD_BY, w.pool .. '|~preemptible', 1)
  else
    count_held(lease, 1)
  end
  local lease_json = cjson.encode(lease)
  redis.call('HSET', K_LEASES, w.id, lease_json)
  redis.call('ZADD', K_DEADLINES, lease.expires_at, w.id)
  -- An elastic lease may be asked to shrink for a blocked request (ask_to_shrink): index it by pool.
  if lease.elastic then redis.call('ZADD', K_ELASTIC, 0, w.pool .. '|' .. w.id) end
  emit('grant', {lease = w.id, user = w.user, pool = w.pool, node = node, gpus = taken,
                 token = lease.token, label = w.label, session = w.session, waited_ms = lease.waited_ms,
                 reservation = lease.resv, borrowed = lease.borrowed, preemptible = lease.preemptible,
                 priority = lease.priority, nodes = lease.nodes, parts = #parts > 1 and part_gpus or nil})
  return lease, lease_json
end

local function grant(w, node, taken, rest, old_count)
  return grant_parts(w, {{node = node, taken = taken, rest = rest, old_count = old_count}})
end

-- A multi-node gang: `per` GPUs on each of k distinct up nodes, all or nothing; the nodes with the
-- fewest free GPUs that still have `per` first (best fit), skipping `exclude`.
local function allocate_gang(pool, per, k, exclude)
  local chosen = {}
  local members = redis.call('ZRANGEBYLEX', K_FIT, '[' .. pool .. '|' .. string.format('%05d', per) .. '|',
                             '(' .. pool .. '|~')
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
  local per = {}
  for _, m in ipairs(redis.call('ZRANGEBYLEX', K_FIT, '[' .. pool .. '|', '(' .. pool .. '|~')) do
    local cnt, node = string.match(m, '^[^|]+|(%d+)|(.+)$')
    per[node] = {have = tonumber(cnt), spare = 0, victims = {}}
  end
  local mine = w.priority or 1
  for _, m in ipairs(members) do
    local raw = redis.call('HGET', K_LEASES, string.match(m, '^[^|]+|(.+)$'))
    local l = raw and cjson.decode(raw)
    local p = l and l.elastic and not l.nodes and per[l.node]
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
    local need = math.max(0, n - p.have)
    if p.spare >= need and (best_need == nil or need < best_need or (need == best_need and node < best)) then
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

-- The live lease `id` if `user` owns it and `token` is its fencing token: (lease, its JSON), or
-- (nil, the reply to give: {ENDED, ended JSON} | {NO_SUCH} | {NOT_OWNER} | {STALE}). `token` nil:
-- ownership alone suffices (as release.lua's "" token; the API always sends one).
local function owned_lease(id, token, user)
  local raw = redis.call('HGET', K_LEASES, id)
  if not raw then
    local ended = redis.call('HGET', K_ENDED, id)
    if ended then return nil, {ENDED, ended} end
    return nil, {NO_SUCH}
  end
  local lease = cjson.decode(raw)
  if lease.user ~= user then return nil, {NOT_OWNER} end
  if token and tostring(lease.token) ~= token then return nil, {STALE} end
  return lease, raw
end

-- A warm lease (warm.lua) may be evicted for any waiter; nothing else is, by that rule.
local function warm_rank(l)
  if l.warm_since then return 0 end
  return nil
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
  local sched = sched_of(pool)
  local cap = sched.scheduler == 'fair_share' and #acts == 0
  local order, later, per_user = {}, {}, {}
  local i = 0
  while i < #members and #order < 64 do
    i = i + 1
    local m = members[i]
    local id = string.match(m, '|([^|]+)$')
    local raw = redis.call('HGET', K_WAITERS, id)
    local user = cap and raw and string.match(raw, '"user":"([^"\\]*)"')
    if user and (per_user[user] or 0) >= 4 then
      later[#later + 1] = {member = m, later_raw = raw}
    elseif raw then
      if user then per_user[user] = (per_user[user] or 0) + 1 end
      local w = cjson.decode(raw)
      w.member = m
      if sched.scheduler == 'fifo' then
        w.key = 0
      else
        w.key = decayed_usage(pool, w.user) - sched.aging * (NOW - w.enqueued_at) / 1000 * w.gpus
        if sched.scheduler == 'priority' then w.key = w.key - (w.priority or 1) * 1e15 end
      end
      w.holder = #acts > 0 and booking_for(acts, w) ~= nil
      if w.holder then w.key = -1e300 end
      order[#order + 1] = w
    else
      redis.call('ZREM', K_QUEUE, m)
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
    if (w.nodes or 1) > 1 then
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
      elseif owed > 0 and pool_free(pool) - count < owed then
        w.borrowed = true
      end
      grant_parts(w, parts)
      redis.call('ZREM', K_QUEUE, w.member)
      redis.call('HDEL', K_WAITERS, w.id)
      count_waiting(w.user, -1)
      redis.call('PUBLISH', K_GRANTS, w.id)
      granted = granted + 1
    elseif overflow then
      break  -- the overflow is served oldest first while it fits, and recalls nothing
    else
      local hold
      if (w.nodes or 1) > 1 then
        hold = nil  -- a blocked gang recalls nothing (recalls free GPUs one node at a time)
      elseif a then
        hold = recall_for_booking(w, a, pool)
      elseif tonumber(redis.call('HGET', K_HELD_BY, pool .. '|~warm') or '0') > 0 then
        -- Warm leases are lendable: anyone who would otherwise wait evicts them, with a short notice
        -- in which the holder's kernel ends (or suspends) the worker and releases.
        hold = recall(w, pool, w.gpus_min or w.gpus, nil, warm_rank, sched.warm_evict_notice_ms, 'evicting',
                      'evicted for ' .. w.user .. "'s request (a warm lease is lent out when someone waits)", {})
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
                      'preempted for ' .. w.user .. "'s request within quota (this lease ran above quota)", {})
      end
      -- Nothing recalled for the first blocked request: elastic leases above their minimum may give
      -- some GPUs back for it (a request above its quota asks nobody, as for preemption).
      if not hold and reserved == nil and not a and (w.nodes or 1) <= 1
          and within_quota(w, pool, w.gpus_min or w.gpus) then
        hold = ask_to_shrink(w, pool, w.gpus_min or w.gpus, sched.preempt_notice_ms)
      end
      if reserved == nil then reserved = hold or fullest_node(pool) end
    end
  end
  return granted
end

-- ---- draining: a GPU the server took back is free only once its node is clean --------------
-- Whether GPU idx of `node` (inventory `inv_raw`) must drain before it is free again when `lease`
-- ends there, and the pids the agent must see gone: {{pid, start}, ...}, or nil when the GPU is
-- free at once. `mode` "all" (the server ended it): always on a node whose agent sees processes
-- (NVML), on a simulated node when the lease named a process on that GPU (POST
-- /leases/{id}/procs); "named" (its owner ended it without having seen its processes gone: the
-- board's Release, a kernel shut down): only when it named one.
local function drain_pids(lease, node, idx, inv_raw, mode)
  if VIRTUAL or not mode then return nil end
  local pids = {}
  for _, p in ipairs(lease.procs or {}) do
    if (p.node or lease.node) == node then
      local on = p.gpus == nil
      for _, g in ipairs(p.gpus or {}) do if g == idx then on = true end end
      if on then pids[#pids + 1] = {pid = p.pid, start = p.start or 0} end
    end
  end
  local simulated = inv_raw ~= nil and string.find(inv_raw, '"source":"simulated"', 1, true) ~= nil
  if (simulated or mode == 'named') and #pids == 0 then return nil end
  return pids
end

-- Put GPU idx of `node`, which `lease` held, into draining: held by no lease ("~" in holders,
-- so nothing grants it, registers it free or counts its samples), listed in draining for the
-- node agent, which ends what remains and reports it clean (drained.lua).
local function start_drain(lease, node, idx, pids, state)
  local slot = node .. '/' .. idx
  redis.call('HSET', K_HOLDERS, slot, '~')
  local entry = cjson.encode({lease = lease.id, user = lease.user, pool = lease.pool, state = state,
                              since = NOW, pids = pids})
  redis.call('HSET', K_DRAINING, slot, (string.gsub(entry, '"pids":{}', '"pids":[]')))
end

-- ---- warm leases: a finished cell's worker kept for the notebook's next cell -----------------
-- A warm lease (warm.lua) runs nothing: its GPUs are lent to whoever would otherwise wait
-- (dispatch evicts it), and its time is charged as warm, not as use: fair share stops counting
-- its GPUs while it is warm, and the ledger records warm_gpu_s apart from gpu_s.
local function warm_lease(lease)
  lease.warm_since = NOW
  lease.warm_until = NOW + sched_of(lease.pool).warm_max_ms
  lease.warned_at, lease.reclaim_at = nil, nil  -- lendable, not idle: the reclaimer leaves it alone
  if lease.expires_at > lease.warm_until then
    lease.expires_at = lease.warm_until
    redis.call('ZADD', K_DEADLINES, lease.expires_at, lease.id)
  end
  touch_usage(lease.pool, lease.user, -#lease.gpus, 0)
  redis.call('HINCRBY', K_HELD_BY, lease.pool .. '|~warm', 1)
  redis.call('HINCRBY', K_HELD_BY, lease.pool .. '|~warm@' .. lease.node, #lease.gpus)  -- (allocate's fit)
end

-- Why a lease past its deadline expires: warm_max ran out for a warm lease, else its ttl.
local function expiry_reason(lease, late_ms)
  if lease.warm_until and lease.warm_until <= NOW then
    return 'kept warm for ' .. math.floor((NOW - lease.warm_since) / 60000 + 0.5) .. ' min with no cell (warm_max)'
  end
  if late_ms then return 'renewed ' .. late_ms .. ' ms after its deadline' end
  return 'not renewed within its ttl of ' .. lease.ttl_ms .. ' ms'
end

-- A warm lease runs a cell again (or ends): its warm time is booked, fair share counts it again.
local function cool_lease(lease)
  if not lease.warm_since then return end
  lease.warm_ms = (lease.warm_ms or 0) + (NOW - lease.warm_since) * #lease.gpus
  lease.warm_since, lease.warm_until = nil, nil
  touch_usage(lease.pool, lease.user, #lease.gpus, 0)
  for field, k in pairs({['|~warm'] = 1, ['|~warm@' .. lease.node] = #lease.gpus}) do
    if redis.call('HINCRBY', K_HELD_BY, lease.pool .. field, -k) <= 0 then
      redis.call('HDEL', K_HELD_BY, lease.pool .. field)
    end
  end
end

-- End a live lease: give its GPUs back, record GPU-time for fair share, keep the record a while.
-- Returns the ended record and its JSON. `raw`, if given, is the stored JSON that `lease` was
-- decoded from, unchanged since: the ended record is then that text with the end's fields put in,
-- instead of the whole record encoded again.
local function end_lease(lease, state, reason, by, raw, drain)
  -- the server (or an admin) ended it: its GPUs drain ("all"); see drain_pids for "named"
  if drain == nil and state ~= 'released' then drain = 'all' end
  local was_warm = lease.warm_since ~= nil
  if was_warm then
    cool_lease(lease)
    raw = nil  -- changed: encoded again below
  end
  local by_node, order = {}, {}
  for _, g in ipairs(lease.gpus) do
    local node = g.node or lease.node
    if not by_node[node] then by_node[node] = {}; order[#order + 1] = node end
    table.insert(by_node[node], g)
  end
  local returned, returned_parts, draining = {}, {}, {}
  for _, node in ipairs(order) do
    local part = {node = node, gpus = {}}
    returned_parts[#returned_parts + 1] = part
    local inv_raw = redis.call('HGET', K_NODES, node)
    local free = decode_list(redis.call('HGET', K_FREE, node))
    local present = {}
    if inv_raw then
      local idx = {}
      for _, g in ipairs(by_node[node]) do idx[#idx + 1] = g.index end
      present = inv_present(inv_raw, idx)
    end
    local old_count = #free
    for _, g in ipairs(by_node[node]) do
      local slot = node .. '/' .. g.index
      if redis.call('HGET', K_HOLDERS, slot) == lease.id then
        local pids = present[g.index] and drain_pids(lease, node, g.index, inv_raw, drain)
        if pids then
          start_drain(lease, node, g.index, pids, state)
          draining[#draining + 1] = g.index
          part.draining = part.draining or {}
          part.draining[#part.draining + 1] = g.index
        else
          redis.call('HDEL', K_HOLDERS, slot)
          if present[g.index] then free[#free + 1] = g.index end
        end
        returned[#returned + 1] = g.index
        part.gpus[#part.gpus + 1] = g.index
      end
    end
    if inv_raw then set_free(node, lease.pool, free, old_count) end
  end
  redis.call('HDEL', K_LEASES, lease.id)
  redis.call('ZREM', K_DEADLINES, lease.id)
  redis.call('ZREM', K_RECALL, lease.id)
  if lease.elastic then
    redis.call('ZREM', K_ELASTIC, lease.pool .. '|' .. lease.id)
    redis.call('ZREM', K_SHRINK_DUE, lease.id)
  end
  if lease.resv then
    local rraw = redis.call('HGET', K_RESV, lease.resv)
    if rraw then
      local r = cjson.decode(rraw)
      r.held = math.max(0, (r.held or 0) - #lease.gpus)
      save_booking(r)
    end
  end
  if lease.preemptible then
    redis.call('HINCRBY', K_HELD_BY, lease.pool .. '|~preemptible', -1)
  elseif not lease.resv then
    count_held(lease, -1)
  end
  local held_s = (NOW - lease.created_at) / 1000
  -- GPU-seconds at each size it had (grown or shrunk: gpu_ms holds the time before sized_at)
  -- (time kept warm is not use: it is charged apart, as warm_gpu_s)
  local warm_s = (lease.warm_ms or 0) / 1000
  local gpu_s = ((lease.gpu_ms or 0) + (NOW - (lease.sized_at or lease.created_at)) * #lease.gpus) / 1000 - warm_s
  -- Fair share counts GPU-seconds held, busy ones once and idle ones (per the agent's samples)
  -- idle_weight times: holding a GPU while looking at plots costs more than training on it.
  local u = redis.call('HMGET', K_LEASE_UTIL, lease.id .. '|n', lease.id .. '|busy', lease.id .. '|sum',
                       lease.id .. '|peak')
  redis.call('HDEL', K_LEASE_UTIL, lease.id .. '|n', lease.id .. '|busy', lease.id .. '|sum', lease.id .. '|peak')
  local samples = tonumber(u[1] or '0')
  local charged, busy_frac, util_mean = gpu_s, nil, nil
  if samples > 0 then
    busy_frac = tonumber(u[2] or '0') / samples
    util_mean = tonumber(u[3] or '0') / samples
    charged = gpu_s * (busy_frac + sched_of(lease.pool).idle_weight * (1 - busy_frac))
  end
  -- the held time itself was counted while the lease ran; add the idle surcharge
  touch_usage(lease.pool, lease.user, -#lease.gpus, charged - gpu_s)
  redis.call('XADD', K_LEDGER, 'MAXLEN', '~', EVENT_MAX, '*', 'data', cjson.encode({
    lease = lease.id, user = lease.user, teams = lease.teams or '', session = lease.session, label = lease.label,
    notebook = lease.notebook or '', cell = lease.cell or '',
    pool = lease.pool, node = lease.node, gpus = #lease.gpus, start = lease.created_at, ['end'] = NOW,
    held_s = held_s, waited_s = (lease.waited_ms or 0) / 1000, state = state, util_mean = util_mean,
    busy_frac = busy_frac, mem_peak_mb = samples > 0 and tonumber(u[4]) or nil, gpu_s = gpu_s,
    charged_gpu_s = charged, warm_gpu_s = warm_s > 0 and warm_s or nil, preemptible = lease.preemptible, borrowed = lease.borrowed, reservation = lease.resv,
    priority = lease.priority}))
  lease.state = state
  lease.ended_at = NOW
  lease.end_reason = reason
  lease.ended_by = by
  local ended_json
  local at = raw and string.find(raw, '"state":"active"', 1, true)
  if at and string.sub(raw, -1) == '}' then
    local tail = ',"ended_at":' .. string.format('%d', NOW)
    if reason ~= nil then tail = tail .. ',"end_reason":' .. cjson.encode(reason) end
    if by ~= nil then tail = tail .. ',"ended_by":' .. cjson.encode(by) end
    ended_json = string.sub(raw, 1, at + 7) .. cjson.encode(state) .. string.sub(raw, at + 16, -2) .. tail .. '}'
  else
    ended_json = cjson.encode(lease)
  end
  redis.call('HSET', K_ENDED, lease.id, ended_json)
  redis.call('ZADD', K_ENDED_AT, NOW, lease.id)
  emit(state, {lease = lease.id, user = lease.user, pool = lease.pool, node = lease.node,
               gpus = returned, token = lease.token, held_s = held_s, reason = reason, by = by,
               parts = #order > 1 and returned_parts or nil, draining = #draining > 0 and draining or nil,
               warm = was_warm or nil})
  return lease, ended_json
end

-- ---- resizing an elastic lease ------------------------------------------------------------
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
    local rraw = redis.call('HGET', K_RESV, lease.resv)
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
