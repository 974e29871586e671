-- drained.lua: a node agent reports GPUs of its node clean: no process of the lease the server
-- ended there remains on them. They become free, and the pool's queue is served in the same
-- script, so a waiter is granted the moment the GPUs are clean and never before. A slice's drain
-- (named by its lease) frees its memory on its GPU (_lib_slice.lua, slice_drained).
-- A suspend's drain (suspend.lua) names the worker the agent suspended (ARGV[10]): it is recorded
-- in suspended (the agent restores or ends it later: unsuspend.lua) and one `suspended` event
-- says how much GPU memory went to host and how long it took.
-- KEYS: nodes alive free fit pool_free holders sliced slice_fit draining leases deadlines queue waiters wait_due waiting_by usage fence events grants bookings booking_occ booking_due recall held_by sched elastic shrink_due suspended victims evict_miss
-- ARGV[6] = node   ARGV[7] = the lease whose end the GPUs drain from ("" = any)
-- ARGV[8] = JSON list of GPU indexes   ARGV[9] = processes the agent had to end (a count)
-- ARGV[10] = JSON {pid, start, uid, bytes, ms} of the worker the agent suspended ("" or absent: none)
-- returns {OK, GPUs freed} (a slice's memory freed counts no GPU)
local node, lease_id, killed = ARGV[6], ARGV[7], tonumber(ARGV[9]) or 0
local indexes = cjson.decode(ARGV[8])
local inv_raw = redis.call('HGET', K_NODES, node)
local free = decode_list(redis.call('HGET', K_FREE, node))
local old_count = #free
local present = inv_raw and inv_present(inv_raw, indexes) or {}
local by_lease, order = {}, {}
local slices = {}  -- slices drained: {lease, user, pool, state, since, gpu, mb}
for _, idx in ipairs(indexes) do
  local slot = node .. '/' .. idx
  local raw = redis.call('HGET', K_DRAINING, slot)
  local d = raw and cjson.decode(raw)
  -- A slice drains in its GPU's ledger (_lib_slice.lua), named by its lease: never by "any".
  local sd, whole = nil, false
  if not d and lease_id ~= '' then sd, whole = slice_drained(node, idx, lease_id) end
  if sd then
    if whole and present[idx] then free[#free + 1] = idx end
    slices[#slices + 1] = {d = sd, idx = idx}
  elseif d and (lease_id == '' or d.lease == lease_id) then
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
if #order == 0 and #slices == 0 then return {OK, 0} end
table.sort(free)
if inv_raw then set_free(node, cjson.decode(inv_raw).pool, free, old_count) end
local freed, pools = 0, {}
for _, e in ipairs(slices) do
  local pool = inv_raw and cjson.decode(inv_raw).pool
  if pool then pools[pool] = true end
  emit('drained', {lease = lease_id, user = e.d.user, pool = pool, node = node, gpus = {e.idx},
                   gpu_mem_mb = e.d.mb, took_ms = NOW - e.d.since, ended = e.d.state, killed = killed})
end
local sus = (ARGV[10] or '') ~= '' and cjson.decode(ARGV[10]) or nil
for _, id in ipairs(order) do
  local e = by_lease[id]
  freed = freed + #e.gpus
  pools[e.d.pool] = true
  if sus and e.d.state == 'suspend' then
    local raw = redis.call('HGET', K_SUSPENDED, node)
    local all = raw and cjson.decode(raw) or {}
    all[tostring(sus.pid)] = {pid = sus.pid, start = sus.start, uid = sus.uid, user = e.d.user, lease = id,
                              pool = e.d.pool, gpu = e.gpus[1], bytes = sus.bytes, since = NOW, ['until'] = e.d['until']}
    redis.call('HSET', K_SUSPENDED, node, cjson.encode(all))
    emit('suspended', {lease = id, user = e.d.user, pool = e.d.pool, node = node, gpus = e.gpus,
                       bytes = sus.bytes, ms = sus.ms, ['until'] = e.d['until']})
  end
  emit('drained', {lease = id, user = e.d.user, pool = e.d.pool, node = node, gpus = e.gpus,
                   took_ms = NOW - e.d.since, ended = e.d.state, killed = killed})
end
for pool, _ in pairs(pools) do dispatch(pool) end
return {OK, freed}
