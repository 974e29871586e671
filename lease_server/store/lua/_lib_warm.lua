-- _lib_warm.lua: warm leases: a finished cell's worker kept for the notebook's next cell, lent
-- out when someone waits. Part of the library: see _lib.lua.

-- A warm lease (warm.lua) runs nothing: its GPUs are lent to whoever would otherwise wait
-- (dispatch evicts it), and its time is charged as warm, not as use: fair share stops counting
-- its GPUs while it is warm, and the ledger records warm_gpu_s apart from gpu_s.
local function warm_lease(lease)
  local old = victim_member(lease)
  lease.warm_since = NOW
  lease.warm_until = NOW + sched_of(lease.pool).warm_max_ms
  lease.warned_at, lease.reclaim_at = nil, nil  -- lendable, not idle: the reclaimer leaves it alone
  lease.ends_by = nil  -- the cell that declared an end is over (the next declares its own)
  if lease.expires_at > lease.warm_until then
    lease.expires_at = lease.warm_until
    redis.call('ZADD', K_DEADLINES, lease.expires_at, lease.id)
  end
  touch_usage(lease.pool, lease.user, -gpu_share(lease), 0)
  -- its GPUs' samples are not its use while warm (samples.lua): its held-idle figure and its
  -- fair-share weight were counting the warm hours as idle held time
  redis.call('HSET', K_LEASE_UTIL, lease.id .. '|warm', 1)
  redis.call('HINCRBY', K_HELD_BY, lease.pool .. '|~warm', 1)
  if not lease.gpu_mem_mb then  -- (allocate's fit: a warm slice lends memory, not a whole GPU)
    redis.call('HINCRBY', K_HELD_BY, lease.pool .. '|~warm@' .. lease.node, #lease.gpus)
  end
  index_victim(old, lease)
end

-- Why a lease past its deadline expires: warm_max ran out for a warm lease, else its ttl.
local function expiry_reason(lease, late_ms)
  if lease.warm_until and lease.warm_until <= NOW then
    return 'kept warm for ' .. math.floor((NOW - lease.warm_since) / 60000 + 0.5) .. ' min with no cell (warm_max)'
  end
  if late_ms then return 'renewed ' .. late_ms .. ' ms after its deadline' end
  return 'not renewed within its ttl of ' .. lease.ttl_ms .. ' ms'
end

-- The cause code of an expiry: "warm_max" for a warm lease at its end, else "expired".
local function expiry_code(lease)
  if lease.warm_until and lease.warm_until <= NOW then return 'warm_max' end
  return 'expired'
end

-- A warm lease runs a cell again (or ends): its warm time is booked, fair share counts it again.
local function cool_lease(lease)
  if not lease.warm_since then return end
  local old = victim_member(lease)
  lease.warm_ms = (lease.warm_ms or 0) + (NOW - lease.warm_since) * gpu_share(lease)
  lease.warm_since, lease.warm_until = nil, nil
  redis.call('HDEL', K_LEASE_UTIL, lease.id .. '|warm')
  touch_usage(lease.pool, lease.user, gpu_share(lease), 0)
  local counts = {['|~warm'] = 1}
  if not lease.gpu_mem_mb then counts['|~warm@' .. lease.node] = #lease.gpus end
  for field, k in pairs(counts) do
    if redis.call('HINCRBY', K_HELD_BY, lease.pool .. field, -k) <= 0 then
      redis.call('HDEL', K_HELD_BY, lease.pool .. field)
    end
  end
  index_victim(old, lease)
end
