-- mem_peaks.lua: a node agent's measured peak memory of the live leases on its node, what their
-- own processes used (NVML per process, CUDA context included; on simulated GPUs their resident
-- memory: lease_server/node/memwatch.py). Kept with the lease's samples until it ends, when the
-- ledger line and the ended record carry it (mem_peak_mb): --gpu-mem auto sizes the next cell by it.
-- KEYS: leases lease_util
-- ARGV[6] = JSON {lease id: MB}
-- returns {OK, leases recorded}
local n = 0
for id, mb in pairs(cjson.decode(ARGV[6])) do
  if redis.call('HEXISTS', K_LEASES, id) == 1 then
    local field = id .. '|mpeak'
    if tonumber(mb) > tonumber(redis.call('HGET', K_LEASE_UTIL, field) or '-1') then
      redis.call('HSET', K_LEASE_UTIL, field, mb)
      n = n + 1
    end
  end
end
return {OK, n}
