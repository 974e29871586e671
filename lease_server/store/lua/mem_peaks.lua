-- mem_peaks.lua: a node agent's measure of the live leases on its node: the memory their own
-- processes use now and their peak (NVML per process, CUDA context included; on simulated GPUs
-- their resident memory: lease_server/node/memwatch.py). Kept with the lease's samples until it
-- ends: the board shows both, and the ledger line and the ended record carry the peak
-- (mem_peak_mb), by which --gpu-mem auto sizes the notebook's next cell.
-- KEYS: leases lease_util
-- ARGV[6] = JSON {lease id: [MB now, peak MB]}
-- returns {OK, leases recorded}
local n = 0
for id, m in pairs(cjson.decode(ARGV[6])) do
  if redis.call('HEXISTS', K_LEASES, id) == 1 then
    redis.call('HSET', K_LEASE_UTIL, id .. '|mused', m[1])
    local field = id .. '|mpeak'
    if tonumber(m[2]) > tonumber(redis.call('HGET', K_LEASE_UTIL, field) or '-1') then
      redis.call('HSET', K_LEASE_UTIL, field, m[2])
    end
    n = n + 1
  end
end
return {OK, n}
