-- drain_abandon.lua: a node agent gives up a process it cannot end on draining GPUs (the OS
-- refused the signal, it outlived its SIGKILL, or it is one the agent must never end: a kernel
-- thread, the agent or a service it started, or another user's process when it is not root). The GPUs stay out of service, flagged
-- for an admin (gpulease drain list / clear), instead of draining quietly forever; one
-- drain_abandoned event names the process. If the process ends later, the agent's drained still
-- frees them.
-- KEYS: draining events
-- ARGV[6] = node   ARGV[7] = lease   ARGV[8] = JSON list of GPU indexes   ARGV[9] = pid
-- ARGV[10] = why (one line)
-- returns {OK, GPUs flagged now (0 when they were flagged already or drained meanwhile)}
local node, lease_id, pid, why = ARGV[6], ARGV[7], tonumber(ARGV[9]), ARGV[10]
local flagged, entry = {}, nil
for _, idx in ipairs(cjson.decode(ARGV[8])) do
  local slot = node .. '/' .. idx
  local raw = redis.call('HGET', K_DRAINING, slot)
  local d = raw and cjson.decode(raw)
  if d and d.lease == lease_id and not d.abandoned then
    d.abandoned = {pid = pid, why = why, at = NOW}
    if type(d.pids) == 'table' and next(d.pids) == nil then d.pids = nil end
    redis.call('HSET', K_DRAINING, slot, cjson.encode(d))
    flagged[#flagged + 1] = idx
    entry = d
  end
end
if entry then
  emit('drain_abandoned', {lease = lease_id, user = entry.user, pool = entry.pool, node = node,
                           gpus = flagged, pid = pid, why = why})
end
return {OK, #flagged}
