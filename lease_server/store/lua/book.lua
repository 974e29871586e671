-- book.lua: create, change or dry-run a booking, refusing it if at any instant of any of its
-- occurrences the pool (or, for an all-on-one-node booking, its node) would be over-booked.
-- Capacity is the pool's GPUs minus the on-demand floor kept for people without a booking.
-- KEYS: nodes alive free fit pool_free sizes holders sliced slice_fit leases deadlines queue waiters wait_due waiting_by usage fence events grants bookings booking_idx booking_due booking_occ booking_own recall held_by sched elastic shrink_due victims evict_miss
-- ARGV[6] = "create" | "edit" | "check"
-- ARGV[7] = the whole booking as JSON, validated by bookings.py: {id, owner, pool, gpus, start,
--           end, repeat, occurrences, colocate, note, created_by, created_at, notice_ms,
--           no_show_ms, keep_ms}; for "edit" the changed record, whose run-time fields (held,
--           used, released) are taken from the stored one
-- ARGV[8] = on-demand floor (GPUs of the pool that are never booked)
-- ARGV[9] = for "edit": the revision the change was made against (refused if it moved on)
-- ARGV[10] = the share of the bookable GPUs one person may have booked at any instant (1: no cap;
--           an admin's change passes 1)
-- ARGV[11] = JSON {person: [owners]}: the people whose share the booking counts against, each with
--           the owners whose bookings are theirs (themselves and their teams): for a user, that
--           user; for "team:NAME", each member (a team without members: the team itself)
-- ARGV[12] = the most bookings not yet over one owner may have (0: no cap; an admin's change passes 0)
-- returns {OK, booking JSON} | {CLASH, report JSON} | {UNKNOWN_POOL} |
--         {LIMIT, person's cap, booked, at, person} (booking_share) |
--         {LIMIT, "count", the cap, the owner's bookings not yet over} (booking_max_per_owner) |
--         {UNSATISFIABLE, bookable GPUs of the pool, largest node} | {DUPLICATE} | {NO_SUCH} |
--         {STALE} (changed meanwhile) | {ENDED} (cancelled)
local mode, rec, floor = ARGV[6], cjson.decode(ARGV[7]), tonumber(ARGV[8])

local old
if mode == 'edit' then
  local raw = redis.call('HGET', K_BOOKINGS, rec.id)
  if not raw then return {NO_SUCH} end
  old = cjson.decode(raw)
  if tostring(old.rev) ~= ARGV[9] then return {STALE} end
  if old.state ~= 'active' then return {ENDED} end
elseif mode == 'create' and redis.call('HEXISTS', K_BOOKINGS, rec.id) == 1 then
  return {DUPLICATE}
end

local pool = rec.pool
local nodes, total, largest = {}, 0, 0
for _, m in ipairs(redis.call('ZRANGEBYLEX', K_SIZES, '[' .. pool .. '|', '(' .. pool .. '|~')) do
  local size, node = string.match(m, '^[^|]+|(%d+)|(.+)$')
  size = tonumber(size)
  nodes[#nodes + 1] = {name = node, size = size}
  total = total + size
  largest = math.max(largest, size)
end
if #nodes == 0 then return {UNKNOWN_POOL} end
local cap = total - floor
if rec.gpus > cap or (rec.colocate and rec.gpus > largest) then return {UNSATISFIABLE, cap, largest} end

-- One owner has at most max_owned bookings not yet over (each is read by every clash check of its
-- pool, and each of its occurrences by the grants while it is in force). A change of a booking
-- already counted for this owner adds none.
local max_owned = tonumber(ARGV[12]) or 0
if max_owned > 0 and rec['end'] + (rec.occurrences - 1) * WEEK_MS > NOW then
  local counted = old and old.owner == rec.owner and old['end'] + (old.occurrences - 1) * WEEK_MS > NOW
    and redis.call('ZSCORE', K_BOOKING_OWN, own_member(old))
  if not counted then
    local owned = owned_bookings(rec.owner)
    if owned >= max_owned then return {LIMIT, 'count', max_owned, owned} end
  end
end

if old then
  rec.held, rec.used, rec.released, rec.created_by, rec.created_at = old.held, old.used, old.released,
    old.created_by, old.created_at
  if rec.start ~= old.start or rec['end'] ~= old['end'] or rec['repeat'] ~= old['repeat'] then
    rec.used, rec.released = {}, {}
  end
end
rec.held, rec.used, rec.released = rec.held or 0, rec.used or {}, rec.released or {}
rec.state = 'active'

local others = {}
for _, r in ipairs(bookings_of_pool(pool)) do
  if r.id ~= rec.id and r.state == 'active' then others[#others + 1] = r end
end

-- The most GPUs the bookings in `list` hold at once within [lo, hi), and the ones that overlap.
local function peak(list, lo, hi)
  local points, overlapping = {}, {}
  for _, r in ipairs(list) do
    for _, o in ipairs(occs_between(r, lo, hi)) do
      points[#points + 1] = {t = math.max(o.s, lo), d = r.gpus}
      points[#points + 1] = {t = math.min(o.e, hi), d = -r.gpus}
      overlapping[#overlapping + 1] = {id = r.id, owner = r.owner, gpus = r.gpus, start = o.s, ['end'] = o.e,
                                        note = r.note}
    end
  end
  -- ends before starts at the same instant: back-to-back bookings do not overlap
  table.sort(points, function(a, b)
    if a.t ~= b.t then return a.t < b.t end
    return a.d < b.d
  end)
  local cur, most = 0, 0
  for _, p in ipairs(points) do
    cur = cur + p.d
    if cur > most then most = cur end
  end
  return most, overlapping
end

-- Whether the booking shifted by `shift` ms fits: returns ok, the smallest room left over its
-- occurrences, and the clashing bookings of the first occurrence that does not fit.
local function fits(list, limit, shift)
  local room, clashes = limit, nil
  for k = 0, rec.occurrences - 1 do
    local s, e = occ_span(rec, k)
    s, e = math.max(s + shift, NOW), e + shift
    if s < e then
      local most, overlapping = peak(list, s, e)
      if limit - most < room then room = limit - most end
      if most + rec.gpus > limit and not clashes then clashes = overlapping end
    end
  end
  return clashes == nil, room, clashes
end

-- The other all-on-one-node bookings of node `name`.
local function colocated_on(name)
  local out = {}
  for _, r in ipairs(others) do
    if r.colocate and r.node == name then out[#out + 1] = r end
  end
  return out
end

-- One person's bookings hold at most their share of the bookable GPUs at any instant: what they
-- booked as themselves and what any team of theirs booked, together (a team booking counts against
-- each member's share, so a member cannot book the other half of a pool as the team; and one
-- colleague cannot book a whole pool for a month and leave the rest borrowed leases).
local share = tonumber(ARGV[10]) or 1
-- A change that takes no more than the booking held (its note, fewer GPUs) is never refused by it:
-- an owner over the cap (an admin booked for them, the cap was lowered since) may still shrink.
local grows = not (old and old.owner == rec.owner and old.pool == pool and rec.gpus <= old.gpus
  and rec.start == old.start
  and rec['end'] == old['end'] and rec['repeat'] == old['repeat'] and rec.occurrences <= old.occurrences)
if share < 1 and grows then
  local limit = math.max(1, math.floor(cap * share + 1e-9))
  local people = cjson.decode(ARGV[11] or '{}')
  local names = {}
  for person, _ in pairs(people) do names[#names + 1] = person end
  table.sort(names)
  if #names == 0 then names, people = {rec.owner}, {[rec.owner] = {rec.owner}} end
  for _, person in ipairs(names) do
    local theirs = {}
    for _, o in ipairs(people[person]) do theirs[o] = true end
    local own = {}
    for _, r in ipairs(others) do
      if theirs[r.owner] then own[#own + 1] = r end
    end
    for k = 0, rec.occurrences - 1 do
      local s, e = occ_span(rec, k)
      s = math.max(s, NOW)
      if s < e then
        local most = peak(own, s, e)
        if most + rec.gpus > limit then return {LIMIT, limit, most, s, person} end
      end
    end
  end
end

local ok, room, clashes = fits(others, cap, 0)
local node_size
if ok and rec.colocate then
  ok = false
  table.sort(nodes, function(a, b)
    if a.size ~= b.size then return a.size > b.size end
    return a.name < b.name
  end)
  local prefer = old and old.colocate and old.node or nil
  if prefer then
    for i, nd in ipairs(nodes) do
      if nd.name == prefer then table.remove(nodes, i); table.insert(nodes, 1, nd); break end
    end
  end
  room, clashes = 0, nil
  for _, nd in ipairs(nodes) do
    if nd.size >= rec.gpus then
      local nd_ok, nd_room, nd_clashes = fits(colocated_on(nd.name), nd.size, 0)
      if nd_ok then ok, rec.node, node_size = true, nd.name, nd.size; break end
      if nd_room > room then room = nd_room end
      clashes = clashes or nd_clashes
    end
  end
elseif not rec.colocate then
  rec.node = ''
end

if not ok then
  -- The nearest windows of the same length (and repetition) that fit: try starting where another
  -- booking ends, or ending where one starts, within a week either side, nearest first.
  local dur = rec['end'] - rec.start
  local cands, seen = {}, {}
  local lo, hi = rec.start - WEEK_MS, rec['end'] + (rec.occurrences - 1) * WEEK_MS + WEEK_MS
  for _, r in ipairs(others) do
    for _, o in ipairs(occs_between(r, lo, hi)) do
      for _, t in ipairs({o.e, o.s - dur}) do
        local shift = t - rec.start
        if rec['repeat'] == 'weekly' then
          shift = ((shift + WEEK_MS / 2) % WEEK_MS) - WEEK_MS / 2
        end
        if not seen[shift] and rec.start + shift >= NOW and shift ~= 0 then
          seen[shift] = true
          cands[#cands + 1] = shift
        end
      end
    end
  end
  table.sort(cands, function(a, b)
    if math.abs(a) ~= math.abs(b) then return math.abs(a) < math.abs(b) end
    return a > b
  end)
  -- Each try walks this booking's occurrences against every other's: the tries are bounded by that
  -- work too, so that a pool of many long weekly series cannot hold Redis for seconds (a clash
  -- check runs as the booking form is filled in): fewer suggestions then, at least three tries.
  local load = 0
  for _, r in ipairs(others) do load = load + (r.occurrences or 1) end
  local tries = math.min(#cands, 60, math.max(3, math.floor(2000000 / math.max(1, rec.occurrences * load))))
  local suggestions = {}
  for i = 1, tries do
    local shift = cands[i]
    local good = fits(others, cap, shift)
    if good and rec.colocate then
      good = false
      for _, nd in ipairs(nodes) do
        if nd.size >= rec.gpus and fits(colocated_on(nd.name), nd.size, shift) then good = true; break end
      end
    end
    if good then
      suggestions[#suggestions + 1] = {start = rec.start + shift, ['end'] = rec['end'] + shift}
      if #suggestions >= 3 then break end
    end
  end
  local report = {clashes = clashes or {}, capacity = cap, reserved = cap - room, max_gpus = math.max(0, room),
                  suggestions = suggestions, colocate = rec.colocate and true or false}
  if #report.clashes == 0 then report.clashes = nil end
  if #suggestions == 0 then report.suggestions = nil end
  return {CLASH, cjson.encode(report)}
end

if mode == 'check' then
  return {OK, cjson.encode({fits = true, node = rec.node, capacity = cap, max_gpus = room})}
end
if old then
  -- Its leases were served from what it was: another pool, owner or time, and they go on as
  -- ordinary leases (a lease of the old pool counted as held by the new booking, which its owner
  -- could then not use); otherwise the booking keeps serving them.
  if old.leases and (old.pool ~= pool or old.owner ~= rec.owner or rec.start ~= old.start
                     or rec['end'] ~= old['end'] or rec['repeat'] ~= old['repeat']) then
    leave_booking(old, true)
  end
  rec.held, rec.leases = old.held or 0, old.leases
end
rec.rev = old and (old.rev + 1) or 1
rec.base_at = NOW
rec.check_k = 0
schedule_booking(rec)
save_booking(rec)
if old then unindex_booking(old) end
index_booking(rec)
if old and old.pool ~= pool then redis.call('ZREM', K_BOOKING_IDX, old.pool .. '|' .. rec.id) end
redis.call('ZADD', K_BOOKING_IDX, 0, pool .. '|' .. rec.id)
emit(old and 'reservation_changed' or 'reservation_created',
     {id = rec.id, owner = rec.owner, pool = pool, gpus = rec.gpus, start = rec.start, ['end'] = rec['end'],
      ['repeat'] = rec['repeat'], occurrences = rec.occurrences, node = rec.node, by = rec.changed_by})
-- A booking that starts now may change who is served first (in the pool it left too).
dispatch(pool)
if old and old.pool ~= pool then dispatch(old.pool) end
return {OK, cjson.encode(rec)}
