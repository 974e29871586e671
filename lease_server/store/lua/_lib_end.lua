-- _lib_end.lua: the end of a lease, whoever ends it. Part of the library: see _lib.lua.

-- Add the ledger line `e` of a lease that ended at e['end'] to the hourly rollups (keys.py rollup
-- and rollup_idx; lease_server/store/rollup.py reads them, and folds old ledger lines the same way
-- for gpulease migrate). A row (hour, pool, user) sums what its leases did in that hour: the
-- GPU-seconds held, busy by samples, sampled and warm, and those of leases taken back (reclaimed:
-- idle reclaim, booking recall, preemption; evicted: a warm lease lent out), each lease's spread
-- evenly over the hours it was held (a lease held over midnight counts on both days); and, in the
-- hour it was granted, the lease itself, its wait (sum, and a sketch: bucket "0" for no wait,
-- bucket k >= 1 for waits in (G^(k-2), G^(k-1)] ms, G = 1.02, so a percentile read from it is
-- within 1 %) and the cells that started warm on it. A lease held longer than SPLIT_HOURS puts its
-- earlier share in the first of them (one line writes at most SPLIT_HOURS rows). Beside the rows,
-- each pool's running totals of every lease ended (field "~total|<pool>", not in the index).
-- Bounded: at most 5000 rows an hour (a new user past that is summed as "~other" of its pool), and
-- rows older than 400 days go, a few for each row written, so the old ones never pile up.
-- (SPLIT_HOURS: _lib.lua)
--
-- The rows are not written by the script that ends a lease (that is on every release's path):
-- fold_rollups adds the ledger lines written since the last fold, in batches, from each sweep and
-- from a reader of the rows before it reads (fold.lua), so a reader never sees them behind.

local function empty_rollup()
  return {n = 0, held = 0, sampled = 0, used = 0, warm = 0, wait_ms = 0, wh = {}, reclaimed = 0, evicted = 0,
          warm_cells = 0}
end

-- Add `share` of ledger line `e`'s time to row `r`; `first`: the lease itself, its wait, its warm cells.
local function add_figures(r, e, share, first, taken)
  local held, warm = e.gpu_s * share, (e.warm_gpu_s or 0) * share
  r.held = r.held + held
  if e.busy_frac then
    r.sampled = r.sampled + held
    r.used = r.used + held * e.busy_frac
  end
  r.warm = r.warm + warm
  if taken == 'reclaimed' then r.reclaimed = r.reclaimed + held + warm end
  if taken == 'evicted' then r.evicted = r.evicted + held + warm end
  if first then
    r.n = r.n + 1
    local ms = e.waited_s * 1000
    r.wait_ms = r.wait_ms + ms
    local b = '0'
    if ms >= 1 then b = tostring(math.ceil(math.log(ms) / math.log(1.02) - 1e-9) + 1) end
    r.wh[b] = (r.wh[b] or 0) + 1
    r.warm_cells = r.warm_cells + (e.warm_cells or 0)
  end
end

local function add_rollup_row(hour, e, share, first, taken)
  local name = string.format('%07d', hour)
  local field = name .. '|' .. e.pool .. '|' .. e.user
  local raw = redis.call('HGET', K_ROLLUP, field)
  if not raw and redis.call('ZLEXCOUNT', K_ROLLUP_IDX, '[' .. name .. '|', '(' .. name .. '|~') >= 5000 then
    field = name .. '|' .. e.pool .. '|~other'
    raw = redis.call('HGET', K_ROLLUP, field)
  end
  local r = raw and cjson.decode(raw) or empty_rollup()
  add_figures(r, e, share, first, taken)
  r.teams = e.teams
  if not raw then redis.call('ZADD', K_ROLLUP_IDX, 0, field) end
  redis.call('HSET', K_ROLLUP, field, cjson.encode(r))
end

local function add_rollup(e, taken)
  local ended = e['end']
  local last = math.floor(ended / 3600000)
  local begin = math.min(e.start, ended)
  local first = math.max(math.floor(begin / 3600000), last - SPLIT_HOURS + 1)
  local span = ended - begin
  for hour = first, last do
    local share = 1  -- (a lease of no time: one hour, this one)
    if span > 0 then
      local lo = hour == first and begin or hour * 3600000
      local hi = hour == last and ended or (hour + 1) * 3600000
      share = (hi - lo) / span
    end
    add_rollup_row(hour, e, share, hour == first, taken)
  end
  -- The pool's running totals (every lease ended, whole, when it ends): what /metrics' counters
  -- read, one field per pool, never in the index (rollup rows' readers do not see it).
  local total = '~total|' .. e.pool
  local traw = redis.call('HGET', K_ROLLUP, total)
  local t = traw and cjson.decode(traw) or empty_rollup()
  add_figures(t, e, 1, true, taken)
  redis.call('HSET', K_ROLLUP, total, cjson.encode(t))
  local cutoff = string.format('%07d', last - 400 * 24)
  local old = redis.call('ZRANGEBYLEX', K_ROLLUP_IDX, '-', '(' .. cutoff .. '|', 'LIMIT', 0, 4)
  if #old > 0 then
    redis.call('HDEL', K_ROLLUP, unpack(old))
    redis.call('ZREM', K_ROLLUP_IDX, unpack(old))
  end
end

-- What a lease's end counts as in the rollups: taken back by the server (the recall it was under
-- when it ended, else its own end's cause), or nil (rollup.py TAKEN: the same).
local TAKEN = {evicted = 'evicted', suspended = 'evicted', reclaimed = 'reclaimed', recalled = 'reclaimed',
               preempted = 'reclaimed'}

-- Add up to `limit` ledger lines written since the last fold (keys.py rollup_at) to the rollups.
-- Only lines marked `fold` (written by end_lease since the rollups are folded in batches) are
-- added: a line from before, or from a server of an older release on the same Redis during a
-- rolling upgrade, was rolled up by the script that wrote it. Returns the lines read (all of
-- `limit`: call again).
local function fold_rollups(limit)
  local after = redis.call('GET', K_ROLLUP_AT) or '0-0'
  local rows = redis.call('XRANGE', K_LEDGER, '(' .. after, '+', 'COUNT', limit)
  for _, entry in ipairs(rows) do
    local fields = entry[2]
    for i = 1, #fields, 2 do
      if fields[i] == 'data' and string.find(fields[i + 1], '"fold":1', 1, true) then
        local e = cjson.decode(fields[i + 1])
        add_rollup(e, TAKEN[e['recall'] or e.cause])
      end
    end
  end
  if #rows > 0 then redis.call('SET', K_ROLLUP_AT, rows[#rows][1]) end
  return #rows
end

-- End a live lease: give its GPUs back, record GPU-time for fair share, keep the record a while.
-- Returns the ended record and its JSON. `raw`, if given, is the stored JSON that `lease` was
-- decoded from, unchanged since: the ended record is then that text with the end's fields put in,
-- instead of the whole record encoded again. `code` is the end's cause (protocol.EndCause: who
-- and why in a form a client reads without parsing `reason`, the sentence people read), and `why`
-- the plain reason in it (default `reason`), without advice such as a notice's "save your work".
local function end_lease(lease, state, reason, by, raw, drain, code, why)
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
      if lease.gpu_mem_mb then
        -- a slice: its memory goes back to the GPU's ledger (or drains there); the GPU itself is
        -- free once no slice is left on it
        local pids = present[g.index] and drain_pids(lease, node, g.index, inv_raw, drain)
        local held, whole = end_slice(lease, node, g.index, pids or nil, state)
        if held then
          if whole and present[g.index] then free[#free + 1] = g.index end
          if pids then part.slice_draining = true end
          returned[#returned + 1] = g.index
          part.gpus[#part.gpus + 1] = g.index
        end
      elseif redis.call('HGET', K_HOLDERS, slot) == lease.id then
        local pids = present[g.index] and drain_pids(lease, node, g.index, inv_raw, drain)
        if pids then
          -- (a suspend's drain: the agent suspends the worker off the GPU instead of ending it)
          start_drain(lease, node, g.index, pids, code == 'suspended' and 'suspend' or state)
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
  index_victim(victim_member(lease), nil)
  redis.call('ZREM', K_DEADLINES, lease.id)
  -- a lease is in recall exactly while its record has recall_at (_lib_recall.lua sets both)
  if lease.recall_at then redis.call('ZREM', K_RECALL, lease.id) end
  if lease.elastic then
    redis.call('ZREM', K_ELASTIC, lease.pool .. '|' .. lease.id)
    redis.call('ZREM', K_SHRINK_DUE, lease.id)
  end
  if lease.resv then
    local rraw = redis.call('HGET', K_BOOKINGS, lease.resv)
    if rraw then
      local r = cjson.decode(rraw)
      r.held = math.max(0, (r.held or 0) - #lease.gpus)
      if r.leases then
        r.leases[lease.id] = nil
        if next(r.leases) == nil then r.leases = nil end
      end
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
  -- (time kept warm is not use: it is charged apart, as warm_gpu_s; a slice counts its fraction)
  local warm_s = (lease.warm_ms or 0) / 1000
  local size = gpu_share(lease)
  local gpu_s = ((lease.gpu_ms or 0) + (NOW - (lease.sized_at or lease.created_at)) * size) / 1000 - warm_s
  -- Fair share counts GPU-seconds held, busy ones once and idle ones (per the agent's samples)
  -- idle_weight times: holding a GPU while looking at plots costs more than training on it.
  -- |mpeak: the peak its own processes used, as its node agent measured them (mem_peaks.lua)
  local util_fields = {lease.id .. '|n', lease.id .. '|busy', lease.id .. '|sum', lease.id .. '|peak',
                       lease.id .. '|mpeak', lease.id .. '|mused'}
  local u = redis.call('HMGET', K_LEASE_UTIL, unpack(util_fields))
  if u[1] or u[2] or u[3] or u[4] or u[5] or u[6] then redis.call('HDEL', K_LEASE_UTIL, unpack(util_fields)) end
  local samples = tonumber(u[1] or '0')
  -- A whole GPU's samples measure the GPU (all of it is the lease's); a slice's GPU is shared, so
  -- only what its own processes used counts. The larger of the two readings it has, if any.
  local mem_peak = samples > 0 and not lease.gpu_mem_mb and tonumber(u[4]) or nil
  if u[5] and (mem_peak == nil or tonumber(u[5]) > mem_peak) then mem_peak = tonumber(u[5]) end
  if mem_peak then lease.mem_peak_mb = mem_peak end
  local charged, busy_frac, util_mean = gpu_s, nil, nil
  if samples > 0 then
    busy_frac = tonumber(u[2] or '0') / samples
    util_mean = tonumber(u[3] or '0') / samples
    charged = gpu_s * (busy_frac + sched_of(lease.pool).idle_weight * (1 - busy_frac))
  end
  -- the held time itself was counted while the lease ran; add the idle surcharge
  touch_usage(lease.pool, lease.user, -size, charged - gpu_s)
  local cause = code or state
  local line = {
    lease = lease.id, user = lease.user, teams = lease.teams or '', session = lease.session, label = lease.label,
    notebook = lease.notebook or '', cell = lease.cell or '',
    pool = lease.pool, node = lease.node, gpus = #lease.gpus, start = lease.created_at, ['end'] = NOW,
    held_s = held_s, waited_s = (lease.waited_ms or 0) / 1000, state = state, util_mean = util_mean,
    busy_frac = busy_frac, mem_peak_mb = mem_peak, gpu_s = gpu_s,
    charged_gpu_s = charged, warm_gpu_s = warm_s > 0 and warm_s or nil, preemptible = lease.preemptible, borrowed = lease.borrowed, reservation = lease.resv,
    priority = lease.priority, gpu_mem_mb = lease.gpu_mem_mb, gpu_total_mb = lease.gpu_total_mb,
    suspended = code == 'suspended' or nil, cause = cause, recall = lease.recall_code,
    warm_cells = lease.warm_cells, fold = 1}
  -- (added to the hourly rollups by the next fold: fold_rollups above)
  redis.call('XADD', K_LEDGER, 'MAXLEN', '~', EVENT_MAX, '*', 'data', cjson.encode(line))
  lease.state = state
  lease.ended_at = NOW
  lease.end_reason = reason
  lease.ended_by = by
  lease.cause = {code = code or state, by = by or '', why = why or reason or ''}
  local ended_json
  local at = raw and string.find(raw, '"state":"active"', 1, true)
  if at and string.sub(raw, -1) == '}' then
    local tail = ',"ended_at":' .. string.format('%d', NOW)
    if reason ~= nil then tail = tail .. ',"end_reason":' .. cjson.encode(reason) end
    if by ~= nil then tail = tail .. ',"ended_by":' .. cjson.encode(by) end
    tail = tail .. ',"cause":' .. cjson.encode(lease.cause)
    if mem_peak then tail = tail .. ',"mem_peak_mb":' .. string.format('%d', mem_peak) end
    ended_json = string.sub(raw, 1, at + 7) .. cjson.encode(state) .. string.sub(raw, at + 16, -2) .. tail .. '}'
  else
    ended_json = cjson.encode(lease)
  end
  redis.call('HSET', K_ENDED, lease.id, ended_json)
  redis.call('ZADD', K_ENDED_AT, NOW, lease.id)
  emit(state, {lease = lease.id, user = lease.user, pool = lease.pool, node = lease.node,
               gpus = returned, token = lease.token, held_s = held_s, reason = reason, by = by,
               parts = #order > 1 and returned_parts or nil, draining = #draining > 0 and draining or nil,
               warm = was_warm or nil, cause = lease.cause, gpu_mem_mb = lease.gpu_mem_mb,
               slice_draining = returned_parts[1] and returned_parts[1].slice_draining or nil})
  return lease, ended_json
end

-- A lease past its deadline that the sweep has not reached yet is expired by the first script that
-- touches it: its GPUs were free to take from the deadline on. The EXPIRED reply, or nil if the
-- lease is in time. `late`: the reason says how late (a renew came after the deadline).
local function expire_if_due(lease, raw, late)
  if lease.expires_at >= NOW then return nil end
  local why = expiry_reason(lease, late and NOW - lease.expires_at or nil)
  local _, ended_json = end_lease(lease, 'expired', why, 'server', raw, nil, expiry_code(lease))
  dispatch(lease.pool)
  return {EXPIRED, ended_json}
end

-- The leases booking r serves whose occurrence has ended (`all`: every one of them, for a booking
-- cancelled or whose occurrence its owner ended) go on as ordinary leases: counted against the
-- quota again (preemptible above it) and in the recall index, so that the next booking's owner,
-- or anyone the pool owes GPUs to, takes them back with notice as any lease. A booking's lease was
-- never recalled, so without this it kept its GPUs past its booking, from the next booking's
-- owner too. Whether it let any go (r is changed; the caller saves it).
local function leave_booking(r, all)
  local let_go = false
  for id, k in pairs(r.leases or {}) do
    local _, e = occ_span(r, k)
    if all or e <= NOW then
      r.leases[id] = nil
      let_go = true
      local raw = redis.call('HGET', K_LEASES, id)
      local l = raw and cjson.decode(raw)
      if l and l.resv == r.id then
        local old = victim_member(l)
        l.resv = nil
        r.held = math.max(0, (r.held or 0) - #l.gpus)
        if within_quota(l, l.pool, gpu_share(l)) then
          count_held(l, 1)
        else
          l.preemptible = true
          redis.call('HINCRBY', K_HELD_BY, l.pool .. '|~preemptible', 1)
        end
        redis.call('HSET', K_LEASES, id, cjson.encode(l))
        index_victim(old, l)
        emit('booking_lease_freed', {lease = id, user = l.user, pool = l.pool, gpus = #l.gpus, reservation = r.id,
                                     preemptible = l.preemptible})
      end
    end
  end
  if r.leases and next(r.leases) == nil then r.leases = nil end
  return let_go
end
