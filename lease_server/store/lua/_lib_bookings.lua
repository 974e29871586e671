-- _lib_bookings.lua: bookings as the scripts see them: occurrences, who holds one, what a pool's
-- bookings in force still owe. Part of the library (lease_server/store/scripts.py): see _lib.lua.

-- A booking r: {id, owner ("alice" | "team:ml"), pool, gpus, start, end (ms, UTC), repeat
-- ("none" | "weekly": occurrence k is [start + k weeks, end + k weeks), exactly 168 h apart, so
-- no daylight-saving shift), occurrences, colocate, node, held (GPUs its holders hold now), used
-- {k: true}, released {k: ms} (no-show or ended early), notice_ms, no_show_ms, state}.

local function bookings_of_pool(pool)
  local out = {}
  for _, m in ipairs(redis.call('ZRANGEBYLEX', K_BOOKING_IDX, '[' .. pool .. '|', '(' .. pool .. '|~')) do
    local raw = redis.call('HGET', K_BOOKINGS, string.match(m, '^[^|]+|(.+)$'))
    if raw then out[#out + 1] = cjson.decode(raw) end
  end
  return out
end

-- Occurrence k of r as [s, e), e cut short where it was released (no-show or ended early).
local function occ_span(r, k)
  local s, e = r.start + k * WEEK_MS, r['end'] + k * WEEK_MS
  local rel = r.released and r.released[tostring(k)]
  if rel and rel < e then e = math.max(s, rel) end
  return s, e
end

-- r's entry for occurrence k in the occurrence index (booking_occ, keys.py): its nominal times.
local function occ_member(r, k)
  return string.format('%s|%015d|%015d|%s|%d', r.pool, r.start + k * WEEK_MS, r['end'] + k * WEEK_MS, r.id, k)
end

-- r's entry in its owner's index (booking_own, keys.py): the nominal end of its last occurrence.
local function own_member(r)
  return string.format('%s|%015d|%s', r.owner, r['end'] + (r.occurrences - 1) * WEEK_MS, r.id)
end

-- How many bookings of `owner` are not yet over (their last occurrence neither ended nor released).
local function owned_bookings(owner)
  return redis.call('ZLEXCOUNT', K_BOOKING_OWN, string.format('(%s|%015d|~', owner, NOW), '(' .. owner .. '|~')
end

-- Take r off both indexes (cancelled, changed, or gone).
local function unindex_booking(r)
  local members = {}
  for k = 0, (r.occurrences or 1) - 1 do members[#members + 1] = occ_member(r, k) end
  redis.call('ZREM', K_BOOKING_OCC, unpack(members))
  redis.call('ZREM', K_BOOKING_OWN, own_member(r))
end

-- Put r's occurrences that are neither over nor released on the occurrence index, and r on its
-- owner's unless its last occurrence was released.
local function index_booking(r)
  local add, released = {}, r.released or {}
  for k = 0, r.occurrences - 1 do
    if not released[tostring(k)] and r['end'] + k * WEEK_MS > NOW then
      add[#add + 1] = 0
      add[#add + 1] = occ_member(r, k)
    end
  end
  if #add > 0 then redis.call('ZADD', K_BOOKING_OCC, unpack(add)) end
  if not released[tostring(r.occurrences - 1)] then redis.call('ZADD', K_BOOKING_OWN, 0, own_member(r)) end
end

-- Occurrence k of r was released (a no-show, or ended early): off the occurrence index, and r off
-- its owner's when that was its last.
local function unindex_occurrence(r, k)
  redis.call('ZREM', K_BOOKING_OCC, occ_member(r, k))
  if k == r.occurrences - 1 then redis.call('ZREM', K_BOOKING_OWN, own_member(r)) end
end

-- The occurrences of r that overlap [lo, hi): a list of {k, s, e}.
local function occs_between(r, lo, hi)
  local out, first, last = {}, 0, 0
  if r['repeat'] == 'weekly' then
    first = math.max(0, math.floor((lo - r['end']) / WEEK_MS))
    last = math.min(r.occurrences - 1, math.floor((hi - r.start) / WEEK_MS))
  end
  for k = first, last do
    local s, e = occ_span(r, k)
    if s < hi and lo < e and s < e then out[#out + 1] = {k = k, s = s, e = e} end
  end
  return out
end

-- The occurrence of an active booking r in force at time t, or nil.
local function occ_at(r, t)
  if r.state ~= 'active' then return nil end
  local o = occs_between(r, t, t + 1)[1]
  return o and o.k
end

local function team_set(csv)
  local set = {}
  for t in string.gmatch(csv or '', '[^,]+') do set[t] = true end
  return set
end

local function holds_booking(r, user, teams)
  if r.owner == user then return true end
  local t = string.match(r.owner, '^team:(.+)$')
  return t ~= nil and teams[t] == true
end

local function save_booking(r)
  redis.call('HSET', K_BOOKINGS, r.id, cjson.encode(r))
end

-- Bookings of the pool in force now: {r, k, owed = GPUs booked that its holders do not hold}, by
-- id. Read from the occurrence index (booking_occ): the pool's occurrences that started by now,
-- which are those in force and those ended since a reader last came by (dropped here), however
-- many bookings the pool has ahead.
local function active_bookings(pool)
  local acts, owed, gone = {}, 0, {}
  local started = redis.call('ZRANGEBYLEX', K_BOOKING_OCC, '[' .. pool .. '|',
                             string.format('(%s|%015d', pool, NOW + 1))
  for _, m in ipairs(started) do
    local e, id = string.match(m, '^[^|]+|%d+|(%d+)|([^|]+)|%d+$')
    local raw = e and tonumber(e) > NOW and redis.call('HGET', K_BOOKINGS, id)
    local r = raw and cjson.decode(raw)
    local k = r and occ_at(r, NOW)
    if k then
      local o = math.max(0, r.gpus - (r.held or 0))
      acts[#acts + 1] = {r = r, k = k, owed = o}
      owed = owed + o
    elseif not (e and tonumber(e) > NOW) then
      gone[#gone + 1] = m
    end
  end
  for i = 1, #gone, 1000 do
    redis.call('ZREM', K_BOOKING_OCC, unpack(gone, i, math.min(i + 999, #gone)))
  end
  table.sort(acts, function(a, b) return a.r.id < b.r.id end)
  return acts, owed
end

-- The booking in force that a request of w.gpus by w.user is served from: the user's own before
-- a team's, and only one with that many GPUs still owed.
local function booking_for(acts, w)
  local teams, best = team_set(w.teams), nil
  for _, a in ipairs(acts) do
    if a.owed >= w.gpus and holds_booking(a.r, w.user, teams) then
      if a.r.owner == w.user then return a end
      best = best or a
    end
  end
  return best
end

local function pool_free(pool)
  return tonumber(redis.call('HGET', K_POOL_FREE, pool) or '0')
end

-- Put r's next no-show check on booking_due: the first occurrence not yet used or released whose
-- no-show deadline (its start, or when the booking was made or changed if later, + no_show_ms)
-- falls inside it. With none left, schedule its removal keep_ms after its last occurrence.
local function schedule_booking(r)
  local k = r.check_k or 0
  local used, released = r.used or {}, r.released or {}
  -- (and the end of an occurrence that still serves leases: they go on as ordinary leases then,
  -- leave_booking in _lib_end.lua)
  local served = nil
  for _, lk in pairs(r.leases or {}) do
    local _, e = occ_span(r, lk)
    if served == nil or e < served then served = e end
  end
  while k < r.occurrences do
    local s, e = occ_span(r, k)
    local deadline = math.max(s, r.base_at or s) + r.no_show_ms
    if deadline < e and not used[tostring(k)] and not released[tostring(k)] then
      r.check_k = k
      redis.call('ZADD', K_BOOKING_DUE, math.min(deadline, served or deadline), r.id)
      return
    end
    k = k + 1
  end
  r.check_k = k
  local gone = r['end'] + (r.occurrences - 1) * WEEK_MS + r.keep_ms
  redis.call('ZADD', K_BOOKING_DUE, math.min(gone, served or gone), r.id)
end
