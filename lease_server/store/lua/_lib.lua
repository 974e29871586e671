-- _lib.lua: the helpers of the state-changing scripts, by subject: this file (the codes, the
-- call's common arguments, events, free lists and the best-fit index, fair-share usage, the
-- lease a caller owns), then _lib_bookings, _lib_recall, _lib_schedule, _lib_drain, _lib_warm,
-- _lib_end and _lib_resize, in that order (a Lua local is defined before its callers).
-- lease_server/store/scripts.py prepends to each script the helpers it calls, or loads them all once as
-- one Redis Functions library. They define no entry point of their own; each script reads its
-- own ARGV from ARGV[6] on.
--
-- KEYS: none of its own. Each script declares the keys it uses, its helpers' included, in its
-- header ("-- KEYS: leases deadlines ..."); lease_server/store/scripts.py binds them as K_<NAME> locals
-- (K_LEASES = KEYS[i]) and includes only the helpers below that the script calls, transitively.
-- What each key holds: lease_server/store/keys.py.
-- Common ARGV:
--   ARGV[1] = virtual "now" in ms, or "" to use Redis TIME (only the simulator passes a value)
--   ARGV[2] = approximate maximum length of the event stream
--   ARGV[3] = fair-share half-life in seconds
--   ARGV[4] = how long ended leases stay readable, ms
--   ARGV[5] = the fencing epoch: Sentinel's config epoch of the primary the server found (0 without
--             Sentinel); see next_token below
-- Return codes: lease_server/store/scripts.py's Code enum (tests/test_scripts.py checks the two agree).
local OK, QUEUED, BUSY, NO_SUCH, ENDED, NOT_OWNER, STALE, EXPIRED = 0, 1, 2, 3, 4, 5, 6, 7
local UNKNOWN_POOL, UNSATISFIABLE, DUPLICATE, UNKNOWN_NODE, REMOVED = 8, 9, 10, 11, 12
local LIMIT, NOT_DUE, CLASH, WARNED, INVALID = 13, 14, 15, 16, 17
local WEEK_MS = 7 * 24 * 3600 * 1000
-- The cause code (protocol.EndCause) of a lease that a recall of each kind ends.
local RECALL_CODE = {borrow_recalled = 'recalled', preempt_notice = 'preempted', evicting = 'evicted'}
-- The holders mark of a GPU shared by slices (_lib_slice.lua): held by no one lease, never free.
local SLICED = '~slices'

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

-- How many entries a free list has, without building it.
local function list_count(raw)
  if not raw or raw == '[]' then return 0 end
  return select(2, string.gsub(raw, ',', ',')) + 1
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

-- The recall index (victims): the live leases a recall may take back, by pool and class, newest
-- first, so that a recall reads a bounded number of candidates (_lib_recall.lua) instead of every
-- lease. Member "pool|C|R|node|id": C the class -- w warm, p preemptible, b borrowed, o any other
-- whole-GPU lease not served from a booking, r being recalled (its GPUs are coming free) -- and
-- R = 9999999999999 - created_at (ms), so that the newest, which lose the least work, come first
-- (for a warm lease, which loses no work, led by 999 - its GPUs: the largest first).
-- A slice is in it only while warm and not yet evicted, in class v (a warm slice: evicted for a
-- slice request that needs its memory, or with its GPU's other slices for a whole GPU); a booking's
-- lease that is not warm is never recalled and not in it. Every script that grants a lease, ends
-- one, turns one warm or cool or recalls one keeps it in step.
local function victim_member(l)
  local c
  if l.gpu_mem_mb then
    if not l.warm_since or l.recall_at then return nil end
    c = 'v'
  elseif l.recall_at then c = 'r'
  elseif l.warm_since then c = 'w'
  elseif l.resv then return nil
  elseif l.preemptible then c = 'p'
  elseif l.borrowed then c = 'b'
  else c = 'o' end
  local r = string.format('%013d', 9999999999999 - l.created_at)
  -- a warm lease loses no work when evicted: the largest first (the fewest evictions free a node)
  if c == 'w' then r = string.format('%03d', 999 - #l.gpus) .. r end
  return l.pool .. '|' .. c .. '|' .. r .. '|' .. l.node .. '|' .. l.id
end

-- How many entries of each class of the recall index (victims, above) a recall reads: the nodes
-- of those leases, the node with the most free GPUs and those where GPUs are coming free are the
-- candidates. So a recall's work is bounded, however many leases the pool holds; the price is that
-- with more candidates than that, it chooses among the newest of each class.
local RECALL_READ = 16  -- entries of each class a recall reads
local EVICT_RETRY_MS = 1000  -- a warm eviction that found no node waits this long before the next try
local BLOCKED_MS = 1000  -- how long a queue found blocked is known as blocked (dispatch, _lib_schedule.lua)
local SPLIT_HOURS = 336  -- the most hours a lease's usage rollups spread it over (_lib_end.lua; rollup.py)

-- Move lease l's entry of the recall index from `old` (its member before the change, or nil) to
-- what l is now (l nil: the lease ended).
local function index_victim(old, l)
  local new = l and victim_member(l) or nil
  if old == new then return end
  if old then redis.call('ZREM', K_VICTIMS, old) end
  if new then redis.call('ZADD', K_VICTIMS, 0, new) end
end

-- A node's fit entry out and in, with its pool's sum of them (pool_free: the free GPUs of the
-- pool's up nodes, one HGET where it was a walk of the pool's nodes). fit_drop answers whether
-- there was one (whether the node was up).
-- (Never an increment of 0: Lua's -0 reaches Redis as "-0", which HINCRBY refuses.)
local function fit_drop(pool, node, count)
  if redis.call('ZREM', K_FIT, fit_member(pool, node, count)) == 1 then
    if count > 0 then redis.call('HINCRBY', K_POOL_FREE, pool, 0 - count) end
    return true
  end
  return false
end

local function fit_put(pool, node, count)
  if redis.call('ZADD', K_FIT, 0, fit_member(pool, node, count)) == 1 and count > 0 then
    redis.call('HINCRBY', K_POOL_FREE, pool, count)
  end
end

-- Replace a node's free list, keeping its fit entry in step when the node is up. "Up" is exactly
-- "has a fit entry": mark_down removes it, a heartbeat after that adds it back.
local function set_free(node, pool, list, old_count)
  if old_count == nil then old_count = #decode_list(redis.call('HGET', K_FREE, node)) end
  table.sort(list)
  redis.call('HSET', K_FREE, node, encode_list(list))
  -- (fit_drop then fit_put, with the pool's sum moved once, by the difference: on every grant and release)
  if #list ~= old_count and redis.call('ZREM', K_FIT, fit_member(pool, node, old_count)) == 1 then
    redis.call('ZADD', K_FIT, 0, fit_member(pool, node, #list))
    redis.call('HINCRBY', K_POOL_FREE, pool, #list - old_count)
  end
  -- GPUs freed: a warm eviction that found no node for n GPUs a moment ago (evict_miss in
  -- _lib_recall.lua), or a queue found blocked whose smallest request needs n (pool|~blocked,
  -- dispatch), may be served on this node now if its free and warm GPUs reach n: forget the memo,
  -- so that the dispatch that follows tries, or the waiter would wait on for whatever comes next,
  -- perhaps only the warm lease's own expiry. Freed GPUs that reach no n change neither.
  if #list > old_count then
    local memo = redis.call('HMGET', K_EVICT_MISS, pool, pool .. '|~blocked')
    if memo[1] or memo[2] then
      local have = #list + tonumber(redis.call('HGET', K_HELD_BY, pool .. '|~warm@' .. node) or '0')
      for i, field in ipairs({pool, pool .. '|~blocked'}) do
        local n = memo[i] and tonumber(string.match(memo[i], '^(%d+)|'))
        if memo[i] and (not n or have >= n) then redis.call('HDEL', K_EVICT_MISS, field) end
      end
    end
  end
end

local function mark_down(node, why)
  local inv = cjson.decode(redis.call('HGET', K_NODES, node))
  local free = decode_list(redis.call('HGET', K_FREE, node))
  fit_drop(inv.pool, node, #free)
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
-- running by dr (a slice runs a fraction of one: r is kept to 1e-9, so fractions that were added
-- and taken away again leave exactly 0).
local function touch_usage(pool, user, dr, extra)
  local field = pool .. '|' .. user
  local v, r = decayed_of(redis.call('HGET', K_USAGE, field))
  r = math.max(0, math.floor((r + dr) * 1e9 + 0.5) / 1e9)
  redis.call('HSET', K_USAGE, field, string.format('{"v":%.17g,"t":%d,"r":%.10g}', v + extra, NOW, r))
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
  -- Within one dispatch nothing frees GPUs: a request that found no node for n is followed by no
  -- luckier one for n or more (dispatch() starts the cache afresh).
  local miss = SCHED_CACHE['~miss|' .. pool]
  local mk = 'a|' .. (exclude or '')
  if miss and miss[mk] and n >= miss[mk] then return nil end
  local lo = '[' .. pool .. '|' .. string.format('%05d', n) .. '|'
  local hi = '(' .. pool .. '|~'
  local warm = tonumber(redis.call('HGET', K_HELD_BY, pool .. '|~warm') or '0') > 0
  for _ = 1, 64 do
    local members = redis.call('ZRANGEBYLEX', K_FIT, lo, hi, 'LIMIT', 0, warm and 16 or 2)
    local node, best
    local cands, counts, fields = {}, {}, {}
    for _, m in ipairs(members) do
      local cnt, cand = string.match(m, '^[^|]+|(%d+)|(.+)$')
      if cand ~= exclude then
        if not warm then node = cand; break end
        cands[#cands + 1], counts[#counts + 1] = cand, tonumber(cnt)
        fields[#fields + 1] = pool .. '|~warm@' .. cand
      end
    end
    if #fields > 0 then  -- the candidates' warm GPUs in one read
      local held = redis.call('HMGET', K_HELD_BY, unpack(fields))
      for i, cand in ipairs(cands) do
        local k = counts[i] + tonumber(held[i] or '0')
        if not best or k < best then node, best = cand, k end
      end
    end
    if not node then
      if miss then miss[mk] = math.min(n, miss[mk] or n) end
      return nil
    end
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

-- The live lease `id` if `user` owns it and `token` is its fencing token: (lease, its JSON), or
-- (nil, the reply to give: {ENDED, ended JSON} | {NO_SUCH} | {NOT_OWNER} | {STALE}). `token` nil
-- or '': ownership alone suffices (the API always sends one). `admin`: anyone's lease. `guarded`:
-- an ended lease is told only to its owner (or an admin), holding its token, as a live one is.
local function owned_lease(id, token, user, admin, guarded)
  if token == '' then token = nil end
  local raw = redis.call('HGET', K_LEASES, id)
  local ended
  if not raw then
    ended = redis.call('HGET', K_ENDED, id)
    if not ended then return nil, {NO_SUCH} end
    if not guarded then return nil, {ENDED, ended} end
  end
  local lease = cjson.decode(raw or ended)
  if lease.user ~= user and not admin then return nil, {NOT_OWNER} end
  if token and tostring(lease.token) ~= token then return nil, {STALE} end
  if ended then return nil, {ENDED, ended}, lease end
  return lease, raw
end
