-- unleased_hold.lua: free GPUs of a node on which a process runs that no lease covers (its agent's
-- sample, judged per GPU by reclaim.foreign_pids) are held out of the pool until a sample shows
-- them clean: nobody is granted a GPU someone else already uses. They are held as draining GPUs of
-- no lease (state "unleased"): nothing grants them, the board shows them, an admin can clear them
-- (gpulease drain clear); the agent's clean sample frees them through drained.lua, which serves
-- the queue. Ending the process is the pool's unleased_action, not the drain's.
-- KEYS: nodes free fit pool_free holders draining events evict_miss held_by
-- ARGV[6] = node   ARGV[7] = JSON list of GPU indexes seen in use by such processes
-- returns {OK, GPUs held now}
local node = ARGV[6]
local inv_raw = redis.call('HGET', K_NODES, node)
if not inv_raw then return {OK, 0} end
local pool = cjson.decode(inv_raw).pool
local free = decode_list(redis.call('HGET', K_FREE, node))
local old_count = #free
local want = {}
for _, idx in ipairs(cjson.decode(ARGV[7])) do want[tonumber(idx)] = true end
local kept, held = {}, {}
for _, idx in ipairs(free) do
  local slot = node .. '/' .. idx
  if want[idx] and not redis.call('HGET', K_HOLDERS, slot) then
    redis.call('HSET', K_HOLDERS, slot, '~')
    redis.call('HSET', K_DRAINING, slot, cjson.encode({lease = '', user = '', pool = pool, state = 'unleased',
                                                       since = NOW, pids = cjson.decode('[]')}))
    held[#held + 1] = idx
  else
    kept[#kept + 1] = idx
  end
end
if #held == 0 then return {OK, 0} end
set_free(node, pool, kept, old_count)
emit('unleased_held', {node = node, pool = pool, gpus = held})
return {OK, #held}
