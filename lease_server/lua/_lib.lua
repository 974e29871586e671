-- _lib.lua: the shared prologue that lease_server/scripts.py prepends to every state-changing script.
-- It defines no entry point of its own; each script below it reads its own ARGV from ARGV[5] on.
--
-- KEYS (Keys.core() order, the same for every script):
--   KEYS[1] = nodes      hash node -> inventory JSON      KEYS[9]  = ended     hash id -> ended lease JSON
--   KEYS[2] = alive      zset node -> heartbeat deadline  KEYS[10] = ended_at  zset id -> end ms
--   KEYS[3] = free       hash node -> JSON free indexes   KEYS[11] = queue     lex zset pool|enq|id
--   KEYS[4] = fit        lex zset pool|free|node (up)     KEYS[12] = waiters   hash id -> request JSON
--   KEYS[5] = sizes      lex zset pool|total|node         KEYS[13] = usage     hash pool|user -> {v,t}
--   KEYS[6] = holders    hash node/index -> lease id      KEYS[14] = fence     fencing counter
--   KEYS[7] = leases     hash id -> live lease JSON       KEYS[15] = events    stream
--   KEYS[8] = deadlines  zset id -> expires_at ms         KEYS[16] = grants    pub/sub channel name
--                                                        KEYS[17] = queue_seq arrival-order counter
-- Common ARGV:
--   ARGV[1] = virtual "now" in ms, or "" to use Redis TIME (only the simulator passes a value)
--   ARGV[2] = approximate maximum length of the event stream
--   ARGV[3] = fair-share half-life in seconds
--   ARGV[4] = how long ended leases stay readable, ms
local K_NODES, K_ALIVE, K_FREE, K_FIT, K_SIZES, K_HOLDERS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local K_LEASES, K_DEADLINES, K_ENDED, K_ENDED_AT = KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local K_QUEUE, K_WAITERS, K_USAGE, K_FENCE, K_EVENTS, K_GRANTS = KEYS[11], KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16]
local K_QUEUE_SEQ = KEYS[17]

-- Return codes shared with lease_server/scripts.py (Code enum). Keep both in step.
local OK, QUEUED, BUSY, NO_SUCH, ENDED, NOT_OWNER, STALE, EXPIRED = 0, 1, 2, 3, 4, 5, 6, 7
local UNKNOWN_POOL, UNSATISFIABLE, DUPLICATE, UNKNOWN_NODE, REMOVED = 8, 9, 10, 11, 12
local LIMIT, NOT_DUE = 13, 14

local NOW
if ARGV[1] ~= '' then
  NOW = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local EVENT_MAX = ARGV[2]
local HALF_LIFE_MS = tonumber(ARGV[3]) * 1000
local RETENTION_MS = tonumber(ARGV[4])

local function emit(kind, body)
  body.ts = NOW
  redis.call('XADD', K_EVENTS, 'MAXLEN', '~', EVENT_MAX, '*', 'type', kind, 'data', cjson.encode(body))
end

-- cjson decodes [] and {} alike; free lists are always arrays of integers.
local function decode_list(raw)
  if not raw then return {} end
  local out = {}
  for _, v in ipairs(cjson.decode(raw)) do out[#out + 1] = v end
  return out
end

local function encode_list(list)
  if #list == 0 then return '[]' end
  return cjson.encode(list)
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
  if redis.call('ZSCORE', K_FIT, old_member) then
    redis.call('ZREM', K_FIT, old_member)
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

local function decayed_usage(pool, user)
  local raw = redis.call('HGET', K_USAGE, pool .. '|' .. user)
  if not raw then return 0 end
  local u = cjson.decode(raw)
  return u.v * math.pow(0.5, (NOW - u.t) / HALF_LIFE_MS)
end

-- Best fit: the up node of the pool with the fewest free GPUs that still has n, skipping `exclude`
-- (the node held back for a blocked head of the queue). O(log N): one ZRANGEBYLEX per candidate.
-- A node whose heartbeat ran out is marked down here, so a dead agent's GPUs are never granted
-- even between two sweeps.
local function allocate(pool, n, exclude)
  local lo = '[' .. pool .. '|' .. string.format('%05d', n) .. '|'
  local hi = '(' .. pool .. '|~'
  for _ = 1, 64 do
    local members = redis.call('ZRANGEBYLEX', K_FIT, lo, hi, 'LIMIT', 0, 2)
    local node
    for _, m in ipairs(members) do
      local cand = string.match(m, '^[^|]+|%d+|(.+)$')
      if cand ~= exclude then node = cand; break end
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

local function grant(w, node, taken, rest, old_count)
  local inv = cjson.decode(redis.call('HGET', K_NODES, node))
  local uuid_of = {}
  for _, g in ipairs(inv.gpus) do uuid_of[g.index] = g.uuid end
  -- Invariant guard, checked before any write: a free GPU never has a holder. If one does, the
  -- state is corrupt, and granting it would be a double grant: fail the script loudly instead.
  for _, idx in ipairs(taken) do
    if redis.call('HEXISTS', K_HOLDERS, node .. '/' .. idx) == 1 then
      error('invariant broken: free GPU ' .. node .. '/' .. idx .. ' has a holder')
    end
  end
  local gpus = {}
  for _, idx in ipairs(taken) do
    redis.call('HSET', K_HOLDERS, node .. '/' .. idx, w.id)
    gpus[#gpus + 1] = {index = idx, uuid = uuid_of[idx] or ''}
  end
  set_free(node, w.pool, rest, old_count)
  local lease = {
    id = w.id, token = redis.call('INCR', K_FENCE), user = w.user, pool = w.pool, node = node,
    gpus = gpus, ttl_ms = w.ttl_ms, label = w.label, session = w.session, state = 'active',
    created_at = NOW, renewed_at = NOW, expires_at = NOW + w.ttl_ms, renewals = 0,
    waited_ms = NOW - w.enqueued_at,
  }
  redis.call('HSET', K_LEASES, w.id, cjson.encode(lease))
  redis.call('ZADD', K_DEADLINES, lease.expires_at, w.id)
  emit('grant', {lease = w.id, user = w.user, pool = w.pool, node = node, gpus = taken,
                 token = lease.token, label = w.label, session = w.session, waited_ms = lease.waited_ms})
  return lease
end

-- Serve the pool's queue: fair share (least decayed GPU-time first), aged by waiting time x size
-- so large requests cannot starve; the first waiter that cannot be served reserves the node it is
-- closest to filling, and only smaller requests that fit elsewhere are backfilled around it.
local function dispatch(pool)
  local members = redis.call('ZRANGEBYLEX', K_QUEUE, '[' .. pool .. '|', '(' .. pool .. '|~', 'LIMIT', 0, 64)
  if #members == 0 then return 0 end
  local order = {}
  for _, m in ipairs(members) do
    local id = string.match(m, '|([^|]+)$')
    local raw = redis.call('HGET', K_WAITERS, id)
    if raw then
      local w = cjson.decode(raw)
      w.member = m
      w.key = decayed_usage(pool, w.user) - (NOW - w.enqueued_at) / 1000 * w.gpus
      order[#order + 1] = w
    else
      redis.call('ZREM', K_QUEUE, m)
    end
  end
  -- Equal keys (same user standing, same millisecond) go in arrival order: the older waiter first.
  table.sort(order, function(a, b)
    if a.key ~= b.key then return a.key < b.key end
    return a.seq < b.seq
  end)
  local reserved = nil
  local granted = 0
  for _, w in ipairs(order) do
    local node, taken, rest, old_count = allocate(pool, w.gpus, reserved)
    if node then
      grant(w, node, taken, rest, old_count)
      redis.call('ZREM', K_QUEUE, w.member)
      redis.call('HDEL', K_WAITERS, w.id)
      redis.call('PUBLISH', K_GRANTS, w.id)
      granted = granted + 1
    elseif reserved == nil then
      reserved = fullest_node(pool)
    end
  end
  return granted
end

-- End a live lease: give its GPUs back, record GPU-time for fair share, keep the record a while.
local function end_lease(lease, state, reason, by)
  local inv_raw = redis.call('HGET', K_NODES, lease.node)
  local free = decode_list(redis.call('HGET', K_FREE, lease.node))
  local present = {}
  if inv_raw then
    for _, g in ipairs(cjson.decode(inv_raw).gpus) do present[g.index] = true end
  end
  local returned, old_count = {}, #free
  for _, g in ipairs(lease.gpus) do
    local slot = lease.node .. '/' .. g.index
    if redis.call('HGET', K_HOLDERS, slot) == lease.id then
      redis.call('HDEL', K_HOLDERS, slot)
      if present[g.index] then free[#free + 1] = g.index end
      returned[#returned + 1] = g.index
    end
  end
  if inv_raw then set_free(lease.node, lease.pool, free, old_count) end
  redis.call('HDEL', K_LEASES, lease.id)
  redis.call('ZREM', K_DEADLINES, lease.id)
  local held_s = (NOW - lease.created_at) / 1000
  local gpu_s = held_s * #lease.gpus
  local ukey = lease.pool .. '|' .. lease.user
  redis.call('HSET', K_USAGE, ukey, cjson.encode({v = decayed_usage(lease.pool, lease.user) + gpu_s, t = NOW}))
  lease.state = state
  lease.ended_at = NOW
  lease.end_reason = reason
  lease.ended_by = by
  redis.call('HSET', K_ENDED, lease.id, cjson.encode(lease))
  redis.call('ZADD', K_ENDED_AT, NOW, lease.id)
  emit(state, {lease = lease.id, user = lease.user, pool = lease.pool, node = lease.node,
               gpus = returned, token = lease.token, held_s = held_s, reason = reason, by = by})
  return lease
end
