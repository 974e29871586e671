-- procs.lua: a node agent records a process that claimed a live lease (lease_server/node/claims.py):
-- the kernel told the agent its pid and uid, the API token of the claim names the user, and this
-- script checks that the user holds the lease and the GPUs named there. If the server ends the
-- lease, its node agent ends these processes before the GPUs are granted again. No pid a user
-- sends reaches this script: only agents call it.
-- KEYS: leases ended
-- ARGV[6] = lease id   ARGV[7] = fencing token   ARGV[8] = user (whose API token the claim carried)
-- ARGV[9] = JSON list [{node, pid, start, uid, gpus: [index, ...]}]: replaces the entries of the
--           same node and pid; a lease keeps at most 256
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
for _, p in ipairs(procs) do named[p.node .. '/' .. p.pid] = true end
local kept = {}
for _, p in ipairs(lease.procs or {}) do
  if not named[(p.node or lease.node) .. '/' .. p.pid] then kept[#kept + 1] = p end
end
for _, p in ipairs(procs) do kept[#kept + 1] = p end
while #kept > 256 do table.remove(kept, 1) end
lease.procs = kept
local out = cjson.encode(lease)
redis.call('HSET', K_LEASES, id, out)
return {OK, out}
