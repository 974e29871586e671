-- drained.lua: a node agent reports GPUs of its node clean: no process of the lease the server
-- ended there remains on them. They become free, and the pool's queue is served in the same
-- script, so a waiter is granted the moment the GPUs are clean and never before.
-- KEYS: nodes alive free fit holders draining leases deadlines queue waiters waiting_by usage fence events grants bookings booking_idx recall held_by sched elastic shrink_due
-- ARGV[6] = node   ARGV[7] = the lease whose end the GPUs drain from ("" = any)
-- ARGV[8] = JSON list of GPU indexes   ARGV[9] = processes the agent had to end (a count)
-- returns {OK, GPUs freed}
local node, lease_id, killed = ARGV[6], ARGV[7], tonumber(ARGV[9]) or 0
local indexes = cjson.decode(ARGV[8])
local inv_raw = redis.call('HGET', K_NODES, node)
local free = decode_list(redis.call('HGET', K_FREE, node))
local old_count = #free
local present = inv_raw and inv_present(inv_raw, indexes) or {}
local by_lease, order = {}, {}
for _, idx in ipairs(indexes) do
  local slot = node .. '/' .. idx
  local raw = redis.call('HGET', K_DRAINING, slot)
  local d = raw and cjson.decode(raw)
  if d and (lease_id == '' or d.lease == lease_id) then
    redis.call('HDEL', K_DRAINING, slot)
    if redis.call('HGET', K_HOLDERS, slot) == '~' then
      redis.call('HDEL', K_HOLDERS, slot)
      if present[idx] then free[#free + 1] = idx end
    end
    local e = by_lease[d.lease]
    if not e then
      e = {d = d, gpus = {}}
      by_lease[d.lease] = e
      order[#order + 1] = d.lease
    end
    e.gpus[#e.gpus + 1] = idx
  end
end
if #order == 0 then return {OK, 0} end
table.sort(free)
if inv_raw then set_free(node, cjson.decode(inv_raw).pool, free, old_count) end
local freed, pools = 0, {}
for _, id in ipairs(order) do
  local e = by_lease[id]
  freed = freed + #e.gpus
  pools[e.d.pool] = true
  emit('drained', {lease = id, user = e.d.user, pool = e.d.pool, node = node, gpus = e.gpus,
                   took_ms = NOW - e.d.since, ended = e.d.state, killed = killed})
end
for pool, _ in pairs(pools) do dispatch(pool) end
return {OK, freed}
