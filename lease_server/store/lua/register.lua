-- register.lua: a node agent's heartbeat, with its inventory when that is new or changed.
-- Registering never frees a GPU that a live lease holds: the free list is the inventory minus
-- the holders. A node that was down comes back up, and its pool's queue is served.
-- KEYS: nodes alive free fit pool_free sizes holders sliced slice_fit leases deadlines queue waiters wait_due waiting_by usage fence events grants bookings booking_occ booking_due recall held_by sched elastic shrink_due victims evict_miss
-- ARGV[6] = node   ARGV[7] = inventory JSON {pool, gpus:[{index, uuid, model, memory_mb}], ...}
--                  or "" for a heartbeat of an already registered node
-- ARGV[8] = ms until the node counts as down without another heartbeat
-- returns {OK, "up" | "registered" | "alive"} | {UNKNOWN_NODE}
local node, inv_json, alive_ms = ARGV[6], ARGV[7], tonumber(ARGV[8])
local old_raw = redis.call('HGET', K_NODES, node)
if inv_json == '' and not old_raw then return {UNKNOWN_NODE} end
local old = old_raw and cjson.decode(old_raw)
local deadline = tonumber(redis.call('ZSCORE', K_ALIVE, node) or '-1')
local was_up = deadline >= 0 and old ~= nil and
  redis.call('ZSCORE', K_FIT, fit_member(old.pool, node, #decode_list(redis.call('HGET', K_FREE, node)))) ~= false
local status = 'alive'
local inv = old

if inv_json ~= '' and inv_json ~= old_raw then
  inv = cjson.decode(inv_json)
  if old then
    local old_free = decode_list(redis.call('HGET', K_FREE, node))
    fit_drop(old.pool, node, #old_free)
    redis.call('ZREM', K_SIZES, fit_member(old.pool, node, #old.gpus))
  end
  redis.call('HSET', K_NODES, node, inv_json)
  redis.call('ZADD', K_SIZES, 0, fit_member(inv.pool, node, #inv.gpus))
  local free = {}
  for _, g in ipairs(inv.gpus) do
    if redis.call('HEXISTS', K_HOLDERS, node .. '/' .. g.index) == 0 then free[#free + 1] = g.index end
  end
  table.sort(free)
  redis.call('HSET', K_FREE, node, encode_list(free))
  emit('node_registered', {node = node, pool = inv.pool, gpus = #inv.gpus, source = inv.source})
  was_up = false
  status = 'registered'
end

redis.call('ZADD', K_ALIVE, NOW + alive_ms, node)
if not was_up then
  local free = decode_list(redis.call('HGET', K_FREE, node))
  fit_put(inv.pool, node, #free)
  redis.call('HDEL', K_EVICT_MISS, inv.pool, inv.pool .. '|~blocked')  -- a node up: an eviction, a waiter may fit now
  if status ~= 'registered' then
    status = 'up'
    emit('node_up', {node = node, pool = inv.pool})
  end
  dispatch(inv.pool)
end
return {OK, status}
