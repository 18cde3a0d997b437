-- One request's windows (or the part of it in one hash slot), decided together.
-- Mirrors sidecar/algorithms/decide.py and the algorithm modules beside it, operation for
-- operation, so that Redis and memory agree to the last bit: keep them in step. The usual request
-- (mode 0, every hit adding to a plain window's own counter) runs count.lua instead, whose
-- answers must stay this script's.
--
-- KEYS[2i-1]  hit i's counter, bucket, or grouped hash   KEYS[2i]  its previous window's counter
--             (or KEYS[2i-1]); a concurrency window's sorted set of starts in flight (score the
--             start's end, Unix ms; member "<end>:<n>", or "=<id>" for a start that named its
--             request, "!<id>" once disputed) and its refused starts ("<count> <until ms>")
-- KEYS[2n+1], KEYS[2n+2]  mode 3 only: the hashes of impression ids recorded in the current and
--             in the previous horizon bucket
-- ARGV[1]     mode: 0 apply (each window counts as its algorithm says); 1 all or nothing (apply
--             nothing when the request is OVER_LIMIT); 2 read only (judge, write nothing);
--             4 refused (a request found OVER_LIMIT in other slots, sidecar/storage/cluster.py:
--             apply nothing, as 1 would, but start the blocks of the penalties it trips);
--             3 record: each impression id found in neither id hash is added to the current one
--             and every hit of its group is applied whatever the limits say (an impression is a
--             fact); the hits of an id seen before change nothing
-- ARGV[2]     now, Unix milliseconds (the sidecar's clock)
-- ARGV[3]     n, the number of hits
-- ARGV[4]     grace, milliseconds a grouped field is kept past its keep-until
-- ARGV[5 + 11(i-1) ...] for hit i, eleven values:
--   algorithm  0 plain fixed window, 1 borrowing fixed window, 2 sliding window, 3 token bucket,
--              4 a window anchored on events (sidecar/algorithms/anchored.py), 5 a concurrency
--              window (sidecar/algorithms/concurrency.py), 6 a penalty
--              (sidecar/algorithms/penalty.py): the last hit of its descriptor, its state
--              "<until ms>:<strikes>" at KEYS[2i-1]
--   cost       hits to add; 0 = a check (would one more hit be admitted?); below 0 a refund: -cost
--              hits given back (sidecar/algorithms/refunds.py), never over (an anchored window
--              gives nothing back: a refund on one is answered as a check)
--   group      the descriptor: a descriptor is over when any of its windows is (mode 3: the
--              impression, numbered from 0)
--   role       0 blocking, 1 shadow (never blocks), 2 quota (blocks when every quota one is over);
--              3 a usage count and 4 a unique count (sidecar/core/usage.py): never judged, never
--              written in modes 2 and 3. A usage count adds cost to field `field` of the hash
--              KEYS[2i-1] when the request is admitted, to field `previous` when it is refused;
--              a unique count adds the member `field` to the HyperLogLog KEYS[2i-1]; either
--              makes its key expire at p1 (Unix ms) when it changes it. Answered 0 0 0 applied 0.
--   p1..p4     windows: limit, the window's place in a packed field, from 1 (0, 0: a field or key
--              of its own) or the window's end, Unix ms (1), borrow (1) or the window's start,
--              Unix ms (2), the next window's ms (1) or the window's ms (2)
--              buckets: rate, period ms, capacity, borrow
--              anchored: limit, interval ms (0: none), ends, Unix ms (0: none), 1 when each hit
--              restarts the interval (a cooldown)
--              concurrency: limit, lease ms, 0, 0
--              penalty: block ms, escalate, max ms, forget_after ms
--   ttl        seconds a new counter key (or the hash, for a new field) must live
--   field      '' for a counter stored at its own key; else its field in the hash KEYS[2i-1],
--              named `...|<code><keep until>` (see sidecar/core/keys.py): the keep-until in
--              five base-36 digits of minutes since 2020, or `.` and base-36 Unix seconds;
--              a bucket's field ends in `_` instead, an anchored window's in `^`
--   previous   the previous window's field in that hash (or the field itself); for a window in a
--              packed field (sidecar/algorithms/packing.py), "spread cap now start_1 ... start_n";
--              for a concurrency window, the id of the request its start or refund (of one
--              place) names, or '' 
-- ARGV[5 + 11n]      mode 3 only: milliseconds the current id hash must live
-- ARGV[6 + 11n + g]  mode 3 only: the id of impression g
--
-- Returns, in modes 0 to 2, 5 integers per hit: over (0/1), remaining, reset ms (buckets and
-- concurrency windows; for
-- windows 0, the window's end, which the caller knows, unless a sliding or borrowing window
-- refuses the hit: then the time until it would admit it), applied (0/1), and what the window
-- admitted before this request. Mode 3 returns one integer per impression: 1 when its id was
-- seen before, else 0. A penalty answers blocked (0/1), its strikes, the ms left in its block
-- (blocked, or started by this call; else 0), 1 when this call started a block, and 0; while
-- it blocks, its descriptor's windows answer over, 0 remaining, the ms left, not applied (a
-- shadow rule's hits are applied as without it) and 0, and when it starts a block, the windows
-- that are over answer the block's length as their reset.
--
-- A packed field (`group_counters: packed`, sidecar/algorithms/packing.py) holds several windows of one
-- descriptor as one integer, offset + spread * (their counts, bits interleaved), which every hit
-- on it changes by HINCRBY of the difference; the hits of one field come in one call.
--
-- A grouped hash that gets a new field is pruned of the fields whose keep-until (plus the grace)
-- has passed, and its expiry is pushed out to cover the fields written, so the hash stays small
-- and vanishes once its user goes idle. A bucket's field keeps its keep-until (Unix ms) as the
-- fourth word of its value; an anchored window's value is "<count> <end, Unix ms>", kept until
-- its end.

-- keys.FIELD_EPOCH: 2020-01-01T00:00:00Z, where the minutes of keep-until count from.
local field_epoch = 1577836800

local mode = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local n = tonumber(ARGV[3])
local grace = tonumber(ARGV[4])
local force = mode == 3
local seen = {}

local function stored(key, field)
  local values = seen[key]
  if values == nil then
    values = {}
    seen[key] = values
  end
  local v = values[field]
  if v == nil then
    if field == '' then
      v = redis.call('GET', key)
    else
      v = redis.call('HGET', key, field)
    end
    values[field] = v
  end
  return v
end

local function count(key, field)
  local v = stored(key, field)
  if not v then return 0 end
  return tonumber(v)
end

local function bucket(key, field)
  local v = stored(key, field)
  if not v then return nil end
  if type(v) == 'table' then return v end
  local tokens, stamp, drawn = string.match(v, '^(%S+) (%S+) (%S+)')
  return {tonumber(tokens), tonumber(stamp), tonumber(drawn)}
end

-- An anchored window's open span {count, end ms}, or nil.
local function span(key, field)
  local v = stored(key, field)
  if not v then return nil end
  if type(v) == 'table' then return v end
  local c, e = string.match(v, '^(%S+) (%S+)')
  return {tonumber(c), tonumber(e)}
end

-- A packed field's value as {offset, counts} (packing.decode).
local function unpack_value(v, spread, n)
  local counts = {}
  for j = 1, n do counts[j] = 0 end
  if v <= 0 then return 0, counts end
  local offset = v % spread
  local mixed = (v - offset) / spread
  local place = 1
  while mixed > 0 do
    for j = 1, n do
      local b = mixed % 2
      if b == 1 then counts[j] = counts[j] + place end
      mixed = (mixed - b) / 2
    end
    place = place * 2
  end
  return offset, counts
end

-- packing.encode: 0 when every count is 0.
local function pack_value(offset, counts, spread)
  local left, more = {}, false
  for j = 1, #counts do
    left[j] = counts[j]
    if counts[j] > 0 then more = true end
  end
  if not more then return 0 end
  local mixed, place = 0, 1
  while more do
    more = false
    for j = 1, #left do
      local b = left[j] % 2
      mixed = mixed + b * place
      left[j] = (left[j] - b) / 2
      if left[j] > 0 then more = true end
      place = place * 2
    end
  end
  return offset + spread * mixed
end

-- A packed slot's parameters: spread, cap, the offset of now, each window's start.
local function slot_of(text)
  local words = {}
  for w in string.gmatch(text, '%S+') do words[#words + 1] = tonumber(w) end
  local starts = {}
  for j = 4, #words do starts[#starts + 1] = words[j] end
  return words[1], words[2], words[3], starts
end

-- packing.count: window `position`'s count in the stored value `v`.
local function packed_count(v, position, text)
  if v <= 0 then return 0 end
  local spread, _, _, starts = slot_of(text)
  local offset, counts = unpack_value(v, spread, #starts)
  if offset <= starts[position] then return counts[position] end
  return 0
end

-- packing.add: the value after `cost` on window `position` (a refund below 0).
local function packed_add(v, position, cost, text)
  local spread, cap, at, starts = slot_of(text)
  local offset, counts = unpack_value(v, spread, #starts)
  if v <= 0 then offset = at end
  if cost < 0 then
    if offset > starts[position] or counts[position] == 0 then return v end
    counts[position] = math.max(0, counts[position] + cost)
    return pack_value(offset, counts, spread)
  end
  for j = 1, #starts do
    if offset > starts[j] then counts[j] = 0 end
  end
  counts[position] = math.min(cap, counts[position] + cost)
  return pack_value(math.min(offset, at), counts, spread)
end

-- What each packed hit adds to its field's value, when applied.
local change = {}

-- A concurrency window's live state, read once per key (sidecar/algorithms/concurrency.py):
-- {ends of the starts in flight, named or not, oldest first; refused starts awaiting their
-- refunds; until; ends of the starts without an id, oldest first; named starts, member to end}.
-- Judging works on this table, so a key repeated in one request sees the earlier hits.
local flights = {}
-- Per hit: the state after it (a refund's refused count is written from it), and a start's state
-- once counted or refused.
local flights_after, refused_state = {}, {}
-- Per hit: a start of an id already in flight (concurrency._duplicate).
local duplicate_start = {}
local function flight(key, refused_key)
  local f = flights[key]
  if f ~= nil then return f end
  local ends, anonymous, named = {}, {}, {}
  local found = redis.call('ZRANGEBYSCORE', key, '(' .. ARGV[2], '+inf', 'WITHSCORES')
  for j = 2, #found, 2 do
    local e = tonumber(found[j])
    ends[#ends + 1] = e
    local first = string.sub(found[j - 1], 1, 1)
    if first == '=' or first == '!' then named[found[j - 1]] = e else anonymous[#anonymous + 1] = e end
  end
  local refused, till = 0, 0
  local r = redis.call('GET', refused_key)
  if r then
    local c, u = string.match(r, '^(%S+) (%S+)')
    if tonumber(u) > now then refused, till = tonumber(c), tonumber(u) end
  end
  f = {ends, refused, till, anonymous, named}
  flights[key] = f
  return f
end

-- concurrency.every_end: the ends of `anonymous` and of `named`, oldest first.
local function every_end(anonymous, named)
  local ends = {}
  for j = 1, #anonymous do ends[j] = anonymous[j] end
  local more = false
  for _, e in pairs(named) do
    ends[#ends + 1] = e
    more = true
  end
  if more then table.sort(ends) end
  return ends
end

-- `named` without `member`, and with `added` ending at `at` (either may be nil).
local function renamed(named, member, added, at)
  local copy = {}
  for m, e in pairs(named) do
    if m ~= member then copy[m] = e end
  end
  if added ~= nil then copy[added] = at end
  return copy
end

-- `ends` with `cost` more ending at `finish`, after every one that ends no later (another
-- sidecar's clock may run ahead).
local function spliced(ends, finish, cost)
  local count = #ends
  local at = count + 1
  while at > 1 and ends[at - 1] > finish do at = at - 1 end
  local grown = {}
  for j = 1, at - 1 do grown[#grown + 1] = ends[j] end
  for _ = 1, cost do grown[#grown + 1] = finish end
  for j = at, count do grown[#grown + 1] = ends[j] end
  return grown
end

-- concurrency.answer: (remaining, ms until the oldest start ends).
local function flight_answer(ends, limit)
  local reset = 0
  if #ends > 0 then reset = ends[1] - now end
  return math.max(0, limit - #ends), reset
end

-- When a refused hit would be admitted, in ms from now, if nothing else is counted (the
-- algorithms' wait_ms, see their modules): the reset a refused hit answers.

-- A stored bucket `b` refilled to `at` admits `need` (token_bucket.refill, then admits).
local function bucket_admits(b, at, need, rate, period, capacity, borrow)
  local elapsed = at - b[2]
  if elapsed < 0 then elapsed = 0 end
  if elapsed >= math.ceil((capacity - b[1]) * period / rate) then
    return not (math.max(0, need - capacity) > borrow)
  end
  local tokens = math.min(capacity, b[1] + elapsed * rate / period)
  local drawn = b[3]
  if tokens >= capacity then drawn = 0 end
  return not (drawn + math.max(0, need - math.max(tokens, 0)) > borrow)
end

-- token_bucket.wait_ms: `tokens` and `drawn` are `b` refilled to now.
local function bucket_wait(b, tokens, drawn, need, rate, period, capacity, borrow)
  local full = math.ceil((capacity - tokens) * period / rate)
  if b ~= nil then
    full = math.max(0, b[2] + math.ceil((capacity - b[1]) * period / rate) - now)
  end
  local target = need - (borrow - drawn)
  if b == nil then return full end
  local wait, least = full, 0
  if drawn > borrow or target >= capacity or need > capacity + borrow then
    -- Admitted once full, or never: two steps back at most, for the refill's rounding.
    least = math.max(0, full - 2)
  else
    wait = math.min(full, math.max(0, math.ceil((target - tokens) * period / rate)))
    while wait < full and not bucket_admits(b, now + wait, need, rate, period, capacity, borrow) do
      wait = wait + 1
    end
  end
  while wait > least and bucket_admits(b, now + wait - 1, need, rate, period, capacity, borrow) do
    wait = wait - 1
  end
  return wait
end

-- sliding_window.over_at and wait_ms.
local function sliding_over(previous, current, elapsed, window, need, limit)
  local estimate
  if elapsed < window then
    estimate = previous * (window - elapsed) / window + current
  else
    estimate = current * (2 * window - elapsed) / window
  end
  return estimate + need > limit
end

local function sliding_wait(previous, current, elapsed, window, need, limit)
  if need > limit then return window - elapsed end
  local at
  if current + need <= limit then
    at = window - (limit - current - need) * window / previous
  else
    at = 2 * window - (limit - need) * window / current
  end
  local wait = math.max(1, math.ceil(at) - elapsed)
  while sliding_over(previous, current, elapsed + wait, window, need, limit) do
    wait = wait + 1
  end
  while wait > 1 and not sliding_over(previous, current, elapsed + wait - 1, window, need, limit) do
    wait = wait - 1
  end
  return wait
end

-- penalty.length_ms: the block of the `strikes`-th trip in a row.
local function penalty_length(strikes, block, escalate, most)
  local length = block
  for _ = 2, strikes do
    local grown = math.min(most, math.floor(length * escalate))
    if grown <= length then break end
    length = grown
  end
  return length
end

-- Mode 3: settle which impressions are new before anything is judged.
local duplicate = {}
local results = {}
if force then
  local current, previous = KEYS[2 * n + 1], KEYS[2 * n + 2]
  local first = 6 + 11 * n
  local added = false
  for g = 0, #ARGV - first do
    local id = ARGV[first + g]
    if redis.call('HEXISTS', previous, id) == 1 or redis.call('HSETNX', current, id, 1) == 0 then
      duplicate[g] = true
      results[g + 1] = 1
    else
      added = true
      results[g + 1] = 0
    end
  end
  if added and redis.call('PTTL', current) < 0 then
    redis.call('PEXPIRE', current, ARGV[5 + 11 * n])
  end
end

local skipped = {}
-- Usage hits (roles 3 and 4, see sidecar/core/usage.py): never judged, counted once the request is.
local usage = {}
local over, before_left, before_reset, after_left, after_reset, state = {}, {}, {}, {}, {}, {}
local group_over, group_role = {}, {}
local groups = {}
-- Penalties judged (sidecar/algorithms/penalty.py), by hit and by group: {until, strikes,
-- blocked, tripped, enforced}; `penalties` stays nil for a request without one.
local penalty_hit, penalties = {}, nil

-- Hit i, a penalty, judged after its descriptor's windows (group_over holds theirs).
local function judge_penalty(i, base, group, role)
  if force then
    skipped[i] = true -- a recording: impressions are facts, no penalty applies
    return
  end
  local cost = tonumber(ARGV[base + 1])
  local until_ms, strikes = 0, 0
  local v = stored(KEYS[2 * i - 1], '')
  if v then
    local u, s = string.match(v, '^(%d+):(%d+)$')
    until_ms, strikes = tonumber(u), tonumber(s)
    -- penalty.remembered: strikes forgotten are as nothing stored (Redis may keep them longer).
    if until_ms + tonumber(ARGV[base + 7]) <= now then until_ms, strikes = 0, 0 end
  end
  if group_over[group] == nil then
    groups[#groups + 1] = group
    group_over[group] = false
  end
  group_role[group] = role
  local p = {until_ms, strikes, false, false, role ~= '1'}
  if cost >= 0 and until_ms > now then
    p[3] = true
    if p[5] then group_over[group] = true end
  elseif cost > 0 and group_over[group] and mode ~= 2 then
    strikes = strikes + 1
    p[1] = now + penalty_length(strikes, tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5]),
      tonumber(ARGV[base + 6]))
    p[2], p[4] = strikes, true
  end
  penalty_hit[i] = p
  if penalties == nil then penalties = {} end
  penalties[group] = p
end

-- A refund (cost below 0, sidecar/algorithms/refunds.py): never over; a window's counter goes
-- down, floored at 0 (refunded[i], the change, applied by give_back), a bucket's tokens come
-- back up to its capacity; nothing written where nothing is stored.
local refunded = {}
-- A concurrency window's refund: {refused starts closed, starts in flight closed}.
local closed = {}
local function judge_refund(i, base, algorithm, cost)
  local p1, p2, p3, p4 = tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5]),
    tonumber(ARGV[base + 6]), tonumber(ARGV[base + 7])
  local key, field = KEYS[2 * i - 1], ARGV[base + 9]
  if algorithm == 5 then
    local f = flight(key, KEYS[2 * i])
    before_left[i], before_reset[i] = flight_answer(f[1], p1)
    local id = ARGV[base + 10]
    if id ~= '' then
      -- concurrency.refund with an id: the start of that id, if in flight and not disputed.
      local own = '=' .. id
      closed[i] = {0, 0}
      if f[5][own] ~= nil then
        closed[i].member = own
        local named = renamed(f[5], own, nil, nil)
        flights[key] = {every_end(f[4], named), f[2], f[3], f[4], named}
      end
    else
      -- concurrency.refund: refused starts closed first, then the oldest without an id.
      local given = -cost
      local from_refused = math.min(given, f[2])
      local from_ends = math.min(given - from_refused, #f[4])
      closed[i] = {from_refused, from_ends}
      closed[i].unnamed = next(f[5]) == nil
      if from_refused > 0 or from_ends > 0 then
        local anonymous = {}
        for j = from_ends + 1, #f[4] do anonymous[#anonymous + 1] = f[4][j] end
        local refused, till = f[2] - from_refused, 0
        if refused > 0 then till = f[3] end
        flights[key] = {every_end(anonymous, f[5]), refused, till, anonymous, f[5]}
      end
    end
    flights_after[i] = flights[key]
    after_left[i], after_reset[i] = flight_answer(flights[key][1], p1)
    return
  end
  if algorithm == 4 then
    -- An event window counts impressions recorded: nothing given back, answered as a check.
    local limit, length, ends = p1, p2, p3
    local close = 0
    if length > 0 then close = now + length end
    if ends > 0 and (close == 0 or ends < close) then close = ends end
    local held = 0
    local s = span(key, field)
    if s ~= nil and s[2] > now then held, close = s[1], s[2] end
    before_left[i] = math.max(0, limit - held)
    before_reset[i] = math.max(0, close - now)
    after_left[i], after_reset[i] = before_left[i], before_reset[i]
    refunded[i] = 0
    return
  end
  if algorithm == 3 then
    local rate, period, capacity = p1, p2, p3
    local b = bucket(key, field)
    local tokens, drawn = capacity, 0
    if b ~= nil then
      local elapsed = now - b[2]
      if elapsed < 0 then elapsed = 0 end
      if elapsed < math.ceil((capacity - b[1]) * period / rate) then
        tokens = math.min(capacity, b[1] + elapsed * rate / period)
        if tokens < capacity then drawn = b[3] end
      end
    end
    before_left[i] = math.max(0, math.floor(tokens))
    before_reset[i] = math.ceil((capacity - tokens) * period / rate)
    if b ~= nil then
      tokens = math.min(capacity, tokens - cost)
      if tokens >= capacity then drawn = 0 end
      state[i] = {tokens, now, drawn}
      seen[key][field] = state[i]
    end
    after_left[i] = math.max(0, math.floor(tokens))
    after_reset[i] = math.ceil((capacity - tokens) * period / rate)
    return
  end
  local limit = p1
  if algorithm == 0 and p2 > 0 then
    local raw = count(key, field)
    local current = packed_count(raw, p2, ARGV[base + 10])
    local left = math.max(0, current + cost)
    local after = packed_add(raw, p2, left - current, ARGV[base + 10])
    before_left[i] = math.max(0, limit - current)
    after_left[i] = math.max(0, limit - left)
    before_reset[i], after_reset[i] = 0, 0
    refunded[i] = after - raw
    if after ~= raw then seen[key][field] = string.format('%d', after) end
    return
  end
  local current = count(key, field)
  local left = current + cost
  if left < 0 then left = 0 end
  local capacity, estimate, after = limit, current, left
  if algorithm == 1 then
    local debt = math.max(0, count(KEYS[2 * i], ARGV[base + 10]) - limit)
    if debt > 0 then capacity = limit - debt else capacity = limit + p3 end
  elseif algorithm == 2 then
    local previous = count(KEYS[2 * i], ARGV[base + 10])
    estimate = previous * (p4 - (now - p3)) / p4 + current
    after = previous * (p4 - (now - p3)) / p4 + left
  end
  before_left[i] = math.max(0, math.floor(capacity - estimate))
  after_left[i] = math.max(0, math.floor(capacity - after))
  before_reset[i], after_reset[i] = 0, 0
  refunded[i] = left - current
  if left ~= current then seen[key][field] = tostring(left) end
end

-- Apply hit i's refund: a counter's change (deleted at 0), or a bucket's state (deleted full).
local function give_back(i, algorithm, key, field, refused_key)
  if algorithm == 5 then
    local c = closed[i]
    if c[1] > 0 then
      local f = flights_after[i]
      if f[2] > 0 then
        redis.call('SET', refused_key, string.format('%d %d', f[2], f[3]), 'PX', f[3] - now)
      else
        redis.call('DEL', refused_key)
      end
    end
    if c.member ~= nil then redis.call('ZREM', key, c.member) end
    if c[2] > 0 then
      redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[2])
      if c.unnamed then
        redis.call('ZPOPMIN', key, c[2])
      else
        -- The oldest starts without an id: their members begin with a digit.
        local left = c[2]
        for _, member in ipairs(redis.call('ZRANGE', key, 0, -1)) do
          local first = string.sub(member, 1, 1)
          if first ~= '=' and first ~= '!' then
            redis.call('ZREM', key, member)
            left = left - 1
            if left == 0 then break end
          end
        end
      end
    end
    return
  end
  if algorithm == 3 then
    local s = state[i]
    if s == nil then return end
    if after_reset[i] <= 0 then
      if field == '' then redis.call('DEL', key) else redis.call('HDEL', key, field) end
    else
      local text = string.format('%.17g %.17g %.17g', s[1], s[2], s[3])
      if field == '' then
        redis.call('SET', key, text, 'PX', after_reset[i])
      else
        redis.call('HSET', key, field, text .. string.format(' %.17g', now + after_reset[i]))
      end
    end
  elseif (refunded[i] or 0) ~= 0 then
    if field == '' then
      if redis.call('INCRBY', key, refunded[i]) <= 0 then redis.call('DEL', key) end
    elseif redis.call('HINCRBY', key, field, string.format('%d', refunded[i])) <= 0 then
      redis.call('HDEL', key, field)
    end
  end
end

for i = 1, n do
  local base = 5 + 11 * (i - 1)
  local group = ARGV[base + 2]
  local role = ARGV[base + 3]
  if role == '3' or role == '4' then
    usage[i] = role
  elseif ARGV[base] == '6' then
    judge_penalty(i, base, group, role)
  elseif force and duplicate[tonumber(group)] then
    skipped[i] = true
  elseif force and tonumber(ARGV[base]) < 3 then
    -- Recorded, a window counts the impression whatever it holds: nothing to read or judge
    -- (decide.py judges it anyway; mode 3 answers no outcome, so nobody can tell).
    over[i] = false
    local position = tonumber(ARGV[base + 5])
    if ARGV[base] == '0' and position > 0 and tonumber(ARGV[base + 1]) > 0 then
      local key, field = KEYS[2 * i - 1], ARGV[base + 9]
      local raw = count(key, field)
      local after = packed_add(raw, position, tonumber(ARGV[base + 1]), ARGV[base + 10])
      seen[key][field] = string.format('%d', after)
      change[i] = after - raw
    end
  elseif tonumber(ARGV[base + 1]) < 0 then
    judge_refund(i, base, tonumber(ARGV[base]), tonumber(ARGV[base + 1]))
    over[i] = false
    if group_over[group] == nil then
      groups[#groups + 1] = group
      group_over[group] = false
    end
    group_role[group] = role
  else
    local algorithm = tonumber(ARGV[base])
    local cost = tonumber(ARGV[base + 1])
    local p1, p2, p3, p4 = tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5]),
      tonumber(ARGV[base + 6]), tonumber(ARGV[base + 7])
    local key, field = KEYS[2 * i - 1], ARGV[base + 9]
    local need = cost
    if need == 0 then need = 1 end
    local is_over
    if algorithm == 5 then
      -- concurrency.take: admitted while the starts in flight and the cost fit the limit.
      local limit, lease = p1, p2
      local f = flight(key, KEYS[2 * i])
      local ends = f[1]
      local count = #ends
      local id = ARGV[base + 10]
      local held = nil
      if id ~= '' then held = f[5]['=' .. id] or f[5]['!' .. id] end
      if held ~= nil then
        -- concurrency._duplicate: refused; the start in flight under its id is disputed.
        duplicate_start[i] = true
        is_over = true
        before_left[i], before_reset[i] = math.max(0, limit - count), held - now
        after_left[i], after_reset[i] = before_left[i], before_reset[i]
        if f[5]['=' .. id] ~= nil then
          local named = renamed(f[5], '=' .. id, '!' .. id, held)
          refused_state[i] = {ends, f[2], f[3], f[4], named}
          refused_state[i].disputed = id
          flights[key] = refused_state[i]
        end
      else
      is_over = count + need > limit
      before_left[i], before_reset[i] = flight_answer(ends, limit)
      if is_over then
        -- concurrency.wait_ms: until enough of the oldest starts have ended.
        local wait = 0
        if count > 0 then
          if need > limit then
            wait = ends[count] - now
          else
            wait = ends[count + need - limit] - now
          end
        end
        before_reset[i] = wait
      end
      after_left[i], after_reset[i] = before_left[i], before_reset[i]
      if cost > 0 and id ~= '' then
        -- A named start: refused, it is remembered nowhere (its refund finds no such id).
        if force or not is_over then
          local named = renamed(f[5], nil, '=' .. id, now + lease)
          local all = every_end(f[4], named)
          flights[key] = {all, f[2], f[3], f[4], named}
          after_left[i], after_reset[i] = flight_answer(all, limit)
        end
      elseif cost > 0 then
        local finish = now + lease
        refused_state[i] = {ends, f[2] + cost, finish, f[4], f[5]}
        if force or not is_over then
          local anonymous = spliced(f[4], finish, cost)
          flights[key] = {every_end(anonymous, f[5]), f[2], f[3], anonymous, f[5]}
          after_left[i], after_reset[i] = flight_answer(flights[key][1], limit)
        else
          flights[key] = refused_state[i]
        end
      end
      end
      flights_after[i] = flights[key]
    elseif algorithm == 4 then
      local limit, length, ends, restarts = p1, p2, p3, p4
      local fresh = 0
      if length > 0 then fresh = now + length end
      if ends > 0 and (fresh == 0 or ends < fresh) then fresh = ends end
      local held, close = 0, fresh
      local s = span(key, field)
      if s ~= nil and s[2] > now then held, close = s[1], s[2] end
      is_over = held + need > limit
      local after_close = close
      if restarts == 1 then after_close = fresh end
      before_left[i] = math.max(0, limit - held)
      before_reset[i] = math.max(0, close - now)
      after_left[i] = math.max(0, limit - held - cost)
      after_reset[i] = math.max(0, after_close - now)
      if (force or not is_over) and cost > 0 and after_close > now then
        state[i] = {held + cost, after_close}
        seen[key][field] = state[i]
      end
    elseif algorithm == 3 then
      local rate, period, capacity, borrow = p1, p2, p3, p4
      local b = bucket(key, field)
      local tokens, drawn
      if b == nil then
        tokens, drawn = capacity, 0
      else
        local elapsed = now - b[2]
        if elapsed < 0 then elapsed = 0 end
        if elapsed >= math.ceil((capacity - b[1]) * period / rate) then
          tokens, drawn = capacity, 0
        else
          tokens = math.min(capacity, b[1] + elapsed * rate / period)
          if tokens >= capacity then drawn = 0 else drawn = b[3] end
        end
      end
      before_left[i] = math.max(0, math.floor(tokens))
      before_reset[i] = math.ceil((capacity - tokens) * period / rate)
      local credit = math.max(0, need - math.max(tokens, 0))
      is_over = drawn + credit > borrow
      if is_over then
        before_reset[i] = bucket_wait(b, tokens, drawn, need, rate, period, capacity, borrow)
      end
      if (force or not is_over) and cost > 0 then
        tokens = tokens - cost
        drawn = drawn + credit
        state[i] = {tokens, now, drawn}
        seen[key][field] = state[i]
      end
      after_left[i] = math.max(0, math.floor(tokens))
      after_reset[i] = math.ceil((capacity - tokens) * period / rate)
    else
      local limit = p1
      local packed = algorithm == 0 and p2 > 0
      local raw = count(key, field)
      local current = raw
      if packed then current = packed_count(raw, p2, ARGV[base + 10]) end
      local capacity, estimate, previous = limit, current, 0
      if algorithm == 1 then
        local debt = math.max(0, count(KEYS[2 * i], ARGV[base + 10]) - limit)
        if debt > 0 then capacity = limit - debt else capacity = limit + p3 end
      elseif algorithm == 2 then
        local elapsed = now - p3
        previous = count(KEYS[2 * i], ARGV[base + 10])
        estimate = previous * (p4 - elapsed) / p4 + current
      end
      is_over = estimate + need > capacity
      before_left[i] = math.max(0, math.floor(capacity - estimate))
      after_left[i] = math.max(0, math.floor(capacity - estimate - cost))
      before_reset[i], after_reset[i] = 0, 0
      if is_over and algorithm == 2 then
        local wait = sliding_wait(previous, current, now - p3, p4, need, limit)
        before_reset[i], after_reset[i] = wait, wait
      elseif is_over and algorithm == 1 then
        -- fixed_window.next_window_wait: the next window, p4 ms long, must end first.
        local debt = current - limit
        local next_capacity = limit + p3
        if debt > 0 then next_capacity = limit - debt end
        if need <= limit + p3 and need > next_capacity then
          before_reset[i], after_reset[i] = p2 - now + p4, p2 - now + p4
        end
      end
      if packed then
        if cost > 0 then
          local after = packed_add(raw, p2, cost, ARGV[base + 10])
          seen[key][field] = string.format('%d', after)
          change[i] = after - raw
        end
      elseif algorithm == 0 or not is_over or force then
        seen[key][field] = tostring(current + cost)
      end
    end
    over[i] = is_over
    if group_over[group] == nil then
      groups[#groups + 1] = group
      group_over[group] = false
    end
    group_over[group] = group_over[group] or is_over
    group_role[group] = ARGV[base + 3]
  end
end

local request_over = false
local quota_seen, quota_all_over = false, true
for _, group in ipairs(groups) do
  local role = group_role[group]
  if role == '0' and group_over[group] then request_over = true end
  if role == '2' then
    quota_seen = true
    quota_all_over = quota_all_over and group_over[group]
  end
end
if quota_seen and quota_all_over then request_over = true end
local blocked = mode == 2 or mode == 4 or (mode == 1 and request_over)

-- A bucket's or an anchored window's write is its whole state, judged with the request's earlier
-- hits on it as applied. Where one of those was not (its descriptor refused), the states written
-- after it are worked out again from what is stored by then (decide.py's _rewrite), taken
-- whatever the limits say: `presumed[key][field]` marks such a bucket or window, and
-- `rewritten_ttl[i]` is the new state's life (its outcome keeps what hit i was judged on).
local presumed, rewritten_ttl = {}, {}
local function rewrite(i, base, algorithm, cost, key, field)
  local p1, p2, p3, p4 = tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5]),
    tonumber(ARGV[base + 6]), tonumber(ARGV[base + 7])
  local v
  if field == '' then v = redis.call('GET', key) else v = redis.call('HGET', key, field) end
  state[i] = nil
  if algorithm == 4 then
    local limit, length, ends, restarts = p1, p2, p3, p4
    local fresh = 0
    if length > 0 then fresh = now + length end
    if ends > 0 and (fresh == 0 or ends < fresh) then fresh = ends end
    local held, close = 0, fresh
    if v then
      local c, e = string.match(v, '^(%S+) (%S+)')
      if tonumber(e) > now then held, close = tonumber(c), tonumber(e) end
    end
    if restarts == 1 then close = fresh end
    if cost > 0 and close > now then state[i] = {held + cost, close} end
    rewritten_ttl[i] = math.max(0, close - now)
    return
  end
  local rate, period, capacity = p1, p2, p3
  if cost < 0 and not v then
    rewritten_ttl[i] = 0
    return
  end
  local tokens, drawn = capacity, 0
  if v then
    local t, stamp, d = string.match(v, '^(%S+) (%S+) (%S+)')
    t, stamp, d = tonumber(t), tonumber(stamp), tonumber(d)
    local elapsed = now - stamp
    if elapsed < 0 then elapsed = 0 end
    if elapsed < math.ceil((capacity - t) * period / rate) then
      tokens = math.min(capacity, t + elapsed * rate / period)
      if tokens < capacity then drawn = d end
    end
  end
  if cost > 0 then
    drawn = drawn + math.max(0, cost - math.max(tokens, 0))
    tokens = tokens - cost
  else
    tokens = math.min(capacity, tokens - cost)
    if tokens >= capacity then drawn = 0 end
  end
  state[i] = {tokens, now, drawn}
  rewritten_ttl[i] = math.ceil((capacity - tokens) * period / rate)
end

-- Grouped hashes written: {ms they must live at least, whether a field was created}.
local hashes, hash_order = {}, {}
local function touch(key, needed, created)
  local h = hashes[key]
  if h == nil then
    h = {0, false}
    hashes[key] = h
    hash_order[#hash_order + 1] = key
  end
  if needed > h[1] then h[1] = needed end
  if created then h[2] = true end
end

for i = 1, n do
  if usage[i] then
    local base = 5 + 11 * (i - 1)
    local applied = not (mode == 2 or force)
    if applied then
      local key, field = KEYS[2 * i - 1], ARGV[base + 9]
      if usage[i] == '4' then
        if redis.call('PFADD', key, field) == 1 then
          redis.call('PEXPIREAT', key, ARGV[base + 4])
        end
      else
        local cost = tonumber(ARGV[base + 1])
        if request_over then field = ARGV[base + 10] end
        if redis.call('HINCRBY', key, field, cost) == cost then
          redis.call('PEXPIREAT', key, ARGV[base + 4])
        end
      end
    end
    local o = 5 * (i - 1)
    results[o + 1], results[o + 2], results[o + 3], results[o + 5] = 0, 0, 0, 0
    if applied then results[o + 4] = 1 else results[o + 4] = 0 end
  elseif penalty_hit[i] then
    local p = penalty_hit[i]
    local o = 5 * (i - 1)
    local left = 0
    if p[3] or p[4] then left = p[1] - now end
    results[o + 1], results[o + 2], results[o + 3], results[o + 4], results[o + 5] =
      p[3] and 1 or 0, p[2], left, p[4] and 1 or 0, 0
    if p[4] then
      local base = 5 + 11 * (i - 1)
      redis.call('SET', KEYS[2 * i - 1], string.format('%d:%d', p[1], p[2]), 'PX',
        p[1] - now + tonumber(ARGV[base + 7]))
    end
  elseif not skipped[i] then
    local base = 5 + 11 * (i - 1)
    local algorithm = tonumber(ARGV[base])
    local cost = tonumber(ARGV[base + 1])
    local applied = force or ((not blocked) and (algorithm == 0 or not group_over[ARGV[base + 2]]))
    local p = penalties and penalties[ARGV[base + 2]]
    if p and p[3] and p[5] then applied = false end -- a blocked descriptor counts nowhere
    local key, field = KEYS[2 * i - 1], ARGV[base + 9]
    local reported_reset = after_reset[i]
    if algorithm ~= 5 and algorithm >= 3 and cost ~= 0 then
      if not applied then
        if state[i] ~= nil then
          presumed[key] = presumed[key] or {}
          presumed[key][field] = true
        end
      elseif presumed[key] and presumed[key][field] then
        rewrite(i, base, algorithm, cost, key, field)
        after_reset[i] = rewritten_ttl[i]
      end
    end
    if algorithm == 5 then
      local id = ARGV[base + 10]
      if duplicate_start[i] then
        local f = refused_state[i]
        if not applied and not blocked and f ~= nil then
          -- Disputed: counted until its lease ends, closed by no refund.
          redis.call('ZREM', key, '=' .. f.disputed)
          redis.call('ZADD', key, f[5]['!' .. f.disputed], '!' .. f.disputed)
        end
      elseif applied and cost > 0 then
        -- Each start a member of its own: its end, and a number that no live member has; or
        -- its request's id.
        redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[2])
        local finish = now + tonumber(ARGV[base + 5])
        if id ~= '' then
          redis.call('ZADD', key, finish, '=' .. id)
        else
          local n = 0
          for _ = 1, cost do
            while redis.call('ZADD', key, 'NX', finish, string.format('%d:%d', finish, n)) == 0 do
              n = n + 1
            end
            n = n + 1
          end
        end
        local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
        redis.call('PEXPIRE', key, tonumber(last[2]) - now)
      elseif applied and cost < 0 then
        give_back(i, algorithm, key, field, KEYS[2 * i])
      elseif cost > 0 and not blocked and id == '' then
        -- Refused: its stream-done refund, which Envoy sends all the same, closes this.
        local f = refused_state[i]
        redis.call('SET', KEYS[2 * i], string.format('%d %d', f[2], f[3]), 'PX', f[3] - now)
      end
    elseif applied and cost > 0 then
      if algorithm == 4 then
        local s = state[i]
        if s ~= nil then
          local text = string.format('%d %d', s[1], s[2])
          if field == '' then
            redis.call('SET', key, text, 'PX', s[2] - now)
          else
            touch(key, s[2] - now, redis.call('HSET', key, field, text) == 1)
          end
        end
      elseif algorithm == 3 then
        local s = state[i]
        local text = string.format('%.17g %.17g %.17g', s[1], s[2], s[3])
        if field == '' then
          redis.call('SET', key, text, 'PX', after_reset[i])
        else
          local keep = string.format(' %.17g', now + after_reset[i])
          local created = redis.call('HSET', key, field, text .. keep) == 1
          touch(key, after_reset[i], created)
        end
      elseif field == '' then
        if redis.call('INCRBY', key, cost) == cost then
          redis.call('EXPIRE', key, ARGV[base + 8])
        end
      elseif change[i] ~= nil then
        local delta = change[i]
        if delta ~= 0 and redis.call('HINCRBY', key, field, string.format('%d', delta)) == delta then
          touch(key, 1000 * tonumber(ARGV[base + 8]), true)
        end
      elseif redis.call('HINCRBY', key, field, cost) == cost then
        touch(key, 1000 * tonumber(ARGV[base + 8]), true)
      end
    elseif applied and cost < 0 then
      give_back(i, algorithm, key, field)
    end
    if not force then
      local o = 5 * (i - 1)
      if over[i] then results[o + 1] = 1 else results[o + 1] = 0 end
      if applied then
        results[o + 2], results[o + 3], results[o + 4] = after_left[i], reported_reset, 1
      else
        results[o + 2], results[o + 3], results[o + 4] = before_left[i], before_reset[i], 0
      end
      results[o + 5] = before_left[i]
      if p and p[3] then
        results[o + 1], results[o + 2], results[o + 3], results[o + 5] = 1, 0, p[1] - now, 0
      elseif p and p[4] and over[i] then
        results[o + 3] = p[1] - now
      end
    end
  end
end

for _, key in ipairs(hash_order) do
  local h = hashes[key]
  if h[2] then
    local all = redis.call('HGETALL', key)
    local ended = {}
    for j = 1, #all, 2 do
      local field = all[j]
      local last = string.match(field, '([^|]*)$')
      local keep
      if string.sub(last, -1) == '_' then
        keep = tonumber(string.match(all[j + 1], '^%S+ %S+ %S+ (%S+)'))
      elseif string.sub(last, -1) == '^' then
        keep = tonumber(string.match(all[j + 1], '^%S+ (%S+)'))
      else
        local seconds = string.match(last, '%.(%w+)$')
        if seconds ~= nil then
          keep = tonumber(seconds, 36)
          if keep ~= nil then keep = keep * 1000 end
        else
          keep = tonumber(string.sub(last, -5), 36)
          if keep ~= nil then keep = (field_epoch + keep * 60) * 1000 end
        end
      end
      if keep ~= nil and keep + grace <= now then ended[#ended + 1] = field end
    end
    if #ended > 0 then redis.call('HDEL', key, unpack(ended)) end
  end
  if h[1] > 0 and redis.call('PTTL', key) < h[1] then
    redis.call('PEXPIRE', key, h[1])
  end
end
return results
