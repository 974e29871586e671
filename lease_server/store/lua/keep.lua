-- keep.lua: "I'm still using it": the owner resets the idle clock of a lease, a limited number
-- of times. Atomic with reclaim.lua: whichever runs first wins.
-- KEYS: leases ended events
-- ARGV[6] = lease id   ARGV[7] = user   ARGV[8] = "1" if admin   ARGV[9] = most extensions allowed
-- ARGV[10] = "auto" when the reclaimer clears the warning because the GPUs got busy again (that
--           costs the owner no extension), else ""
-- returns {OK, lease JSON} | {NO_SUCH} | {ENDED, ended JSON} | {NOT_OWNER} | {LIMIT, extensions}
local id, user, admin, max_ext, auto = ARGV[6], ARGV[7], ARGV[8], tonumber(ARGV[9]), ARGV[10] == 'auto'

local lease, raw = owned_lease(id, nil, user, admin == '1' or auto)
if not lease then return raw end
if auto then
  if not lease.reclaim_at then return {OK, raw} end
  lease.warned_at = nil
  lease.reclaim_at = nil
  lease.kept_at = NOW
  redis.call('HSET', K_LEASES, id, cjson.encode(lease))
  emit('idle_cleared', {lease = id, user = lease.user, pool = lease.pool, reason = 'its GPUs are busy again'})
  return {OK, cjson.encode(lease)}
end
local used = lease.extensions or 0
if used >= max_ext then return {LIMIT, used} end
lease.extensions = used + 1
lease.kept_at = NOW
lease.warned_at = nil
lease.reclaim_at = nil
redis.call('HSET', K_LEASES, id, cjson.encode(lease))
emit('idle_kept', {lease = id, user = lease.user, pool = lease.pool, extensions = lease.extensions,
                   left = max_ext - lease.extensions})
return {OK, cjson.encode(lease)}
