-- procs.lua: the holder of a live lease names the processes that use its GPUs (a worker per
-- rank), so that if the server ends the lease, its node agent knows what must be gone before the
-- GPUs are granted again. Replaces the lease's list for the nodes named.
-- KEYS: leases ended
-- ARGV[6] = lease id   ARGV[7] = token   ARGV[8] = user
-- ARGV[9] = JSON list [{node, pid, start, gpus: [index, ...]}]
-- returns {OK, lease JSON} | {NO_SUCH} | {ENDED, ended JSON} | {NOT_OWNER} | {STALE}
--       | {INVALID, node[, index]}: a node or GPU the lease does not hold
local id, token, user = ARGV[6], ARGV[7], ARGV[8]
local lease, raw = owned_lease(id, token, user)
if not lease then return raw end
local procs = cjson.decode(ARGV[9])
local held = {}
for _, g in ipairs(lease.gpus) do held[(g.node or lease.node) .. '/' .. g.index] = true end
for _, p in ipairs(procs) do
  local any = false
  for _, g in ipairs(lease.gpus) do if (g.node or lease.node) == p.node then any = true end end
  if not any then return {INVALID, p.node} end
  for _, idx in ipairs(p.gpus or {}) do
    if not held[p.node .. '/' .. idx] then return {INVALID, p.node, idx} end
  end
end
local named = {}
for _, p in ipairs(procs) do named[p.node] = true end
local kept = {}
for _, p in ipairs(lease.procs or {}) do
  if not named[p.node or lease.node] then kept[#kept + 1] = p end
end
for _, p in ipairs(procs) do kept[#kept + 1] = p end
lease.procs = kept
local out = cjson.encode(lease)
redis.call('HSET', K_LEASES, id, out)
return {OK, out}
