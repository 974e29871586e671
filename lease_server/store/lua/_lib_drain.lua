-- _lib_drain.lua: draining: a GPU the server took back is free only once its node is clean.
-- Part of the library: see _lib.lua.

-- Whether GPU idx of `node` (inventory `inv_raw`) must drain before it is free again when `lease`
-- ends there, and the pids the agent must see gone: {{pid, start}, ...}, or nil when the GPU is
-- free at once. `mode` "all" (the server ended it): always on a node whose agent sees processes
-- (NVML), on a simulated node when a process claimed the lease on that GPU (its node agent
-- recorded it: procs.lua); "named" (its owner ended it without having seen its processes gone:
-- the board's Release, a kernel shut down): only when one claimed it.
local function drain_pids(lease, node, idx, inv_raw, mode)
  if VIRTUAL or not mode or (mode == 'named' and not lease.procs) then return nil end
  local pids = {}
  for _, p in ipairs(lease.procs or {}) do
    if (p.node or lease.node) == node then
      local on = p.gpus == nil
      for _, g in ipairs(p.gpus or {}) do if g == idx then on = true end end
      if on then pids[#pids + 1] = {pid = p.pid, start = p.start or 0, uid = p.uid} end
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
                              since = NOW, pids = pids, ['until'] = lease.suspend_until})
  redis.call('HSET', K_DRAINING, slot, (string.gsub(entry, '"pids":{}', '"pids":[]')))
end
