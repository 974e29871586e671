-- samples.lua: one node agent's sample of its GPUs (utilization, memory, processes).
-- Standalone (no _lib.lua prologue): it records evidence and flags unleased use, and never
-- changes who holds a GPU.
-- KEYS[1] = last       hash node/index -> "ts_ms,util,mem_mb"
-- KEYS[2] = busy_at    hash node/index -> ms of the newest sample at or above the threshold
-- KEYS[3] = holders    hash node/index -> lease id ("~" while draining)
-- KEYS[4] = unleased   hash node/index -> JSON {pids, since}
-- KEYS[5] = events     stream
-- KEYS[6] = covered_since hash node/index -> ms since when samples came without a gap
-- KEYS[7] = lease_util hash "<lease id>|n|busy|sum|peak" -> samples, samples at or above the
--           threshold, sum of utilization %, peak memory MB: what the usage ledger reports
-- KEYS[8] = draining  hash node/index -> JSON entry (one of state "unleased" is a free GPU held out
--           of the pool while a process no lease covers uses it: unleased_hold.lua)
-- KEYS[9] = sliced    hash node/index -> a sliced GPU's memory ledger (_lib_slice.lua): its
--           util_avg (%, the samples averaged with a time constant of 2 * ARGV[6]) and util_at
--           (ms of the newest), by which slice placement avoids busy GPUs, and unclaimed_mb (the
--           memory used beyond its slices' promises while a process none claimed is on it), by
--           which it takes no new slice
-- KEYS[10..] = samples:<node>/<index> list, one per GPU in the order of the GPU arguments
-- ARGV[1] = virtual now ms or "" (Redis TIME)   ARGV[2] = event log max length
-- ARGV[3] = samples kept per GPU                ARGV[4] = utilization threshold (%)
-- ARGV[5] = node                             ARGV[6] = longest gap (ms) between two samples that
--                                                        still counts as continuous sampling
-- ARGV[7..] = per GPU, 4 values each: index, util %, memory used MB, JSON list of the pids on it
--            that are not its holder's (reclaim.foreign_pids: all of them on a GPU no lease holds)
-- returns {GPUs recorded, GPUs with unleased use}
local NOW
if ARGV[1] ~= '' then
  NOW = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local keep, threshold, node, gap = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local recorded, unleased = 0, 0
-- The time constant of a sliced GPU's average utilisation: about the last six samples weigh (twice
-- the longest gap of continuous sampling, three sample intervals: 30 s at the default 5 s).
local util_tau = 2 * gap
local i = 7
local k = 10
while ARGV[i] do
  local index, util, mem, pids = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), ARGV[i + 3]
  local slot = node .. '/' .. index
  -- Coverage: an idle verdict needs samples for the whole idle timeout, without a gap (an agent
  -- that was away cannot vouch for what the GPU did meanwhile).
  local prev = redis.call('HGET', KEYS[1], slot)
  if not prev or NOW - tonumber(string.match(prev, '^(%d+),')) > gap then
    redis.call('HSET', KEYS[6], slot, NOW)
  end
  redis.call('RPUSH', KEYS[k], NOW .. ',' .. util .. ',' .. mem)
  redis.call('LTRIM', KEYS[k], -keep, -1)
  redis.call('HSET', KEYS[1], slot, NOW .. ',' .. util .. ',' .. mem)
  if util >= threshold then redis.call('HSET', KEYS[2], slot, NOW) end
  local has_procs = pids ~= '[]' and pids ~= ''
  local holder = redis.call('HGET', KEYS[3], slot)  -- "~": draining, held by no lease
  -- "~slices": shared by slices (lua/_lib_slice.lua): no one lease's samples (counted as a
  -- draining GPU is), but a process of none of its slices on it is unleased use (the caller
  -- passes only those: reclaim.foreign_pids)
  local shared = holder == '~slices'
  if shared then
    holder = '~'
    local raw = redis.call('HGET', KEYS[9], slot)
    if raw then  -- annotated only: the ledger's promises are _lib_slice.lua's
      local s = cjson.decode(raw)
      local avg, at = util, tonumber(s.util_at)
      if at and NOW > at then avg = s.util_avg + (1 - math.exp((at - NOW) / util_tau)) * (util - s.util_avg) end
      s.util_avg, s.util_at = math.floor(avg * 100 + 0.5) / 100, NOW
      -- Memory in use beyond what its slices are promised, with a process on it that none of them
      -- claimed: nobody is measured for it (a cell's daemon that outlived its lease, another
      -- user's process). The GPU takes no new slice (allocate_slice) until a sample shows it gone.
      if has_procs and mem > s.used_mb then s.unclaimed_mb = mem - s.used_mb else s.unclaimed_mb = nil end
      redis.call('HSET', KEYS[9], slot, cjson.encode(s))
    end
  end
  if holder == '~' then  -- held for unleased use: judged as the free GPU it is
    local d = redis.call('HGET', KEYS[8], slot)
    if d and string.find(d, '"state":"unleased"', 1, true) then holder = false end
  end
  -- (a warm lease's samples are not its use: its cell ended; its peak still counts)
  if holder and holder ~= '~' and redis.call('HEXISTS', KEYS[7], holder .. '|warm') == 0 then
    redis.call('HINCRBY', KEYS[7], holder .. '|n', 1)
    if util >= threshold then redis.call('HINCRBY', KEYS[7], holder .. '|busy', 1) end
    redis.call('HINCRBYFLOAT', KEYS[7], holder .. '|sum', util)
  end
  if holder and holder ~= '~' then
    if mem > tonumber(redis.call('HGET', KEYS[7], holder .. '|peak') or '-1') then
      redis.call('HSET', KEYS[7], holder .. '|peak', mem)
    end
  end
  if has_procs and (holder ~= '~' or shared) then
    unleased = unleased + 1
    if redis.call('HEXISTS', KEYS[4], slot) == 0 then
      redis.call('HSET', KEYS[4], slot, cjson.encode({pids = cjson.decode(pids), since = NOW}))
      redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[2], '*', 'type', 'unleased_use', 'data',
        cjson.encode({node = node, gpu = tonumber(index), pids = cjson.decode(pids), util = util, mem_mb = mem, ts = NOW,
                      lease = (holder and holder ~= '~') and holder or nil}))
    end
  elseif redis.call('HEXISTS', KEYS[4], slot) == 1 then
    redis.call('HDEL', KEYS[4], slot)
    redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[2], '*', 'type', 'unleased_use_ended', 'data',
      cjson.encode({node = node, gpu = tonumber(index), ts = NOW}))
  end
  recorded = recorded + 1
  i = i + 4
  k = k + 1
end
return {recorded, unleased}
