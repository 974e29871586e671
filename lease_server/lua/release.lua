-- release.lua: end a lease (owner release, or admin revoke). Idempotent: releasing an ended
-- lease answers with its ended record and changes nothing.
-- KEYS: Keys.core() (see _lib.lua)
-- ARGV[5] = lease id   ARGV[6] = token ("" = not given: ownership alone suffices)
-- ARGV[7] = user       ARGV[8] = "1" if admin
-- ARGV[9] = end state: "released", "revoked", or "auto" (revoked when an admin ends another
--           user's lease, released otherwise)
-- ARGV[10] = reason (for "auto", the reason used when it turns out to be a revoke is ARGV[11])
-- returns {OK, ended JSON} | {ENDED, ended JSON} | {NO_SUCH} | {NOT_OWNER} | {STALE}
local id, token, user, admin, state, reason = ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local raw = redis.call('HGET', K_LEASES, id)
if not raw then
  local ended = redis.call('HGET', K_ENDED, id)
  if ended then
    local e = cjson.decode(ended)
    if e.user ~= user and admin ~= '1' then return {NOT_OWNER} end
    if token ~= '' and tostring(e.token) ~= token then return {STALE} end
    return {ENDED, ended}
  end
  return {NO_SUCH}
end
local lease = cjson.decode(raw)
if lease.user ~= user and admin ~= '1' then return {NOT_OWNER} end
if token ~= '' and tostring(lease.token) ~= token then return {STALE} end
if state == 'auto' then
  if lease.user ~= user then state, reason = 'revoked', ARGV[11] else state = 'released' end
end
local ended = end_lease(lease, state, reason, user)
dispatch(lease.pool)
return {OK, cjson.encode(ended)}
