-- unsuspend.lua: a node agent is done with a suspended worker (see suspend.lua): restored onto
-- the GPU of its notebook's new lease ("restored"), or ended (warm_max, the node's host-memory
-- budget for suspended workers, its process gone, or its owner's worker ended: "ended").
-- KEYS: suspended events
-- ARGV[6] = node   ARGV[7] = pid   ARGV[8] = "restored" | "ended"
-- ARGV[9] = restored: JSON {lease, gpus, ms} (the new lease); ended: the reason
-- returns {OK, the entry JSON} | {NO_SUCH}: no such suspended worker on that node
local node, pid, what = ARGV[6], ARGV[7], ARGV[8]
local raw = redis.call('HGET', K_SUSPENDED, node)
local all = raw and cjson.decode(raw) or {}
local e = all[pid]
if not e then return {NO_SUCH} end
all[pid] = nil
if next(all) == nil then redis.call('HDEL', K_SUSPENDED, node)
else redis.call('HSET', K_SUSPENDED, node, cjson.encode(all)) end
if what == 'restored' then
  local r = cjson.decode(ARGV[9])
  emit('restored', {lease = r.lease, suspended_lease = e.lease, user = e.user, pool = e.pool, node = node,
                    gpus = r.gpus, bytes = e.bytes, ms = r.ms, suspended_s = (NOW - e.since) / 1000})
else
  emit('suspend_ended', {lease = e.lease, user = e.user, pool = e.pool, node = node, bytes = e.bytes,
                         reason = ARGV[9], suspended_s = (NOW - e.since) / 1000})
end
return {OK, cjson.encode(e)}
