-- unbook.lua: cancel a booking, or end its current occurrence early ("I'm done"), giving its
-- GPUs back to the pool at once. Only its owner (for a team booking: a member), the person who
-- made it, or an admin may.
-- KEYS: nodes alive free fit pool_free holders sliced slice_fit leases deadlines queue waiters wait_due waiting_by usage fence events grants bookings booking_idx booking_due booking_occ booking_own recall held_by sched elastic shrink_due victims evict_miss
-- ARGV[6] = booking id   ARGV[7] = "cancel" | "end"   ARGV[8] = user   ARGV[9] = "1" if admin
-- ARGV[10] = the user's teams, comma-separated
-- ARGV[11] = ms a cancelled booking stays readable
-- returns {OK, booking JSON} | {NO_SUCH} | {NOT_OWNER} | {ENDED} (already cancelled) |
--         {NOT_DUE} ("end" with no occurrence in force)
local id, mode, user, admin = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local raw = redis.call('HGET', K_BOOKINGS, id)
if not raw then return {NO_SUCH} end
local r = cjson.decode(raw)
if admin ~= '1' and r.created_by ~= user and not holds_booking(r, user, team_set(ARGV[10])) then
  return {NOT_OWNER}
end
if r.state ~= 'active' then return {ENDED, raw} end
r.rev = r.rev + 1
leave_booking(r, true)  -- its leases go on as ordinary ones, which the pool may take back
if mode == 'cancel' then
  r.state = 'cancelled'
  r.cancelled_at, r.cancelled_by = NOW, user
  redis.call('ZREM', K_BOOKING_IDX, r.pool .. '|' .. id)
  unindex_booking(r)
  redis.call('ZADD', K_BOOKING_DUE, NOW + tonumber(ARGV[11]), id)
  emit('reservation_cancelled', {id = id, owner = r.owner, pool = r.pool, gpus = r.gpus, by = user})
else
  local k = occ_at(r, NOW)
  if not k then return {NOT_DUE} end
  r.released = r.released or {}
  r.released[tostring(k)] = NOW
  unindex_occurrence(r, k)
  local s, e = occ_span(r, k)
  emit('reservation_ended', {id = id, owner = r.owner, pool = r.pool, gpus = r.gpus, k = k, start = s,
                             ['end'] = r['end'] + k * WEEK_MS, ended_at = NOW, by = user})
  schedule_booking(r)
end
save_booking(r)
dispatch(r.pool)
return {OK, cjson.encode(r)}
