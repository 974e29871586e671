-- procs.lua: a node agent records a process that claimed a live lease (lease_server/node/claims.py):
-- the kernel told the agent its pid and uid, the API token of the claim names the user, and this
-- script checks that the user holds the lease and the GPUs named there. If the server ends the
-- lease, its node agent ends these processes before the GPUs are granted again. No pid a user
-- sends reaches this script: only agents call it.
-- KEYS: leases ended
-- ARGV[6] = lease id   ARGV[7] = fencing token   ARGV[8] = user (whose API token the claim carried)
-- ARGV[9] = JSON list [{node, pid, start, uid, gpus: [index, ...]}]: replaces the entries of the
--           same node and pid (in their place), adds the others; a lease keeps at most 256: beyond,
--           the oldest go, never the first to claim it on a node (its worker: 256 more claims
--           pushed it out, and it was then neither measured against its slice nor drained)
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
local kept, at = {}, {}
for _, p in ipairs(lease.procs or {}) do
  kept[#kept + 1] = p
  at[(p.node or lease.node) .. '/' .. p.pid] = #kept
end
for _, p in ipairs(procs) do
  local key = p.node .. '/' .. p.pid
  if at[key] then
    kept[at[key]] = p
  else
    kept[#kept + 1] = p
    at[key] = #kept
  end
end
if #kept > 256 then
  local drop, firsts, left = #kept - 256, {}, {}
  for _, p in ipairs(kept) do
    local node = p.node or lease.node
    if not firsts[node] then
      firsts[node] = true
      left[#left + 1] = p
    elseif drop > 0 then
      drop = drop - 1
    else
      left[#left + 1] = p
    end
  end
  kept = left
end
lease.procs = kept
local out = cjson.encode(lease)
redis.call('HSET', K_LEASES, id, out)
return {OK, out}
