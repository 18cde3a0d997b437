-- One request's windows (or the part of it in one hash slot), decided together.
-- Mirrors sidecar/algorithms/decide.py and the algorithm modules beside it, operation for
-- operation, so that Redis and memory agree to the last bit: keep them in step.
--
-- KEYS[2i-1]  hit i's counter (or bucket)      KEYS[2i]  its previous window's counter (or KEYS[2i-1])
-- ARGV[1]     mode: 0 apply (each window counts as its algorithm says); 1 all or nothing (apply
--             nothing when the request is OVER_LIMIT); 2 read only (judge, write nothing)
-- ARGV[2]     now, Unix milliseconds (the sidecar's clock)
-- ARGV[3 + 9(i-1) ...] for hit i, nine values:
--   algorithm  0 plain fixed window, 1 borrowing fixed window, 2 sliding window, 3 token bucket
--   cost       hits to add; 0 = a check (would one more hit be admitted?)
--   group      the descriptor: a descriptor is over when any of its windows is
--   role       0 blocking, 1 shadow (never blocks), 2 quota (blocks when every quota one is over)
--   p1..p4     windows: limit, unused, borrow (1) or elapsed ms (2), window ms (2)
--              buckets: rate, period ms, capacity, borrow
--   ttl        seconds a new window counter lives
--
-- Returns 5 integers per hit: over (0/1), remaining, reset ms (buckets; 0 for windows, whose
-- reset the caller knows), applied (0/1), and what the window admitted before this request.

local mode = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local n = #KEYS / 2
local seen = {}

local function stored(key)
  local v = seen[key]
  if v == nil then
    v = redis.call('GET', key)
    seen[key] = v
  end
  return v
end

local function count(key)
  local v = stored(key)
  if not v then return 0 end
  return tonumber(v)
end

local function bucket(key)
  local v = stored(key)
  if not v then return nil end
  if type(v) == 'table' then return v end
  local tokens, stamp, drawn = string.match(v, '^(%S+) (%S+) (%S+)$')
  return {tonumber(tokens), tonumber(stamp), tonumber(drawn)}
end

local over, before_left, before_reset, after_left, after_reset, state = {}, {}, {}, {}, {}, {}
local group_over, group_role = {}, {}
local groups = {}

for i = 1, n do
  local base = 3 + 9 * (i - 1)
  local algorithm = tonumber(ARGV[base])
  local cost = tonumber(ARGV[base + 1])
  local group = ARGV[base + 2]
  local p1, p2, p3, p4 = tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5]),
    tonumber(ARGV[base + 6]), tonumber(ARGV[base + 7])
  local key = KEYS[2 * i - 1]
  local need = cost
  if need == 0 then need = 1 end
  local is_over
  if algorithm == 3 then
    local rate, period, capacity, borrow = p1, p2, p3, p4
    local b = bucket(key)
    local tokens, stamp, drawn
    if b == nil then
      tokens, drawn = capacity, 0
    else
      local elapsed = now - b[2]
      if elapsed < 0 then elapsed = 0 end
      tokens = math.min(capacity, b[1] + elapsed * rate / period)
      if tokens >= capacity then drawn = 0 else drawn = b[3] end
    end
    before_left[i] = math.max(0, math.floor(tokens))
    before_reset[i] = math.ceil((capacity - tokens) * period / rate)
    local credit = math.max(0, need - math.max(tokens, 0))
    is_over = drawn + credit > borrow
    if not is_over and cost > 0 then
      tokens = tokens - cost
      drawn = drawn + credit
      state[i] = {tokens, now, drawn}
      seen[key] = state[i]
    end
    after_left[i] = math.max(0, math.floor(tokens))
    after_reset[i] = math.ceil((capacity - tokens) * period / rate)
  else
    local limit = p1
    local current = count(key)
    local capacity, estimate = limit, current
    if algorithm == 1 then
      local debt = math.max(0, count(KEYS[2 * i]) - limit)
      if debt > 0 then capacity = limit - debt else capacity = limit + p3 end
    elseif algorithm == 2 then
      estimate = count(KEYS[2 * i]) * (p4 - p3) / p4 + current
    end
    is_over = estimate + need > capacity
    before_left[i] = math.max(0, math.floor(capacity - estimate))
    after_left[i] = math.max(0, math.floor(capacity - estimate - cost))
    before_reset[i], after_reset[i] = 0, 0
    if algorithm == 0 or not is_over then seen[key] = tostring(current + cost) end
  end
  over[i] = is_over
  if group_over[group] == nil then
    groups[#groups + 1] = group
    group_over[group] = false
  end
  group_over[group] = group_over[group] or is_over
  group_role[group] = ARGV[base + 3]
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
local blocked = mode == 2 or (mode == 1 and request_over)

local result = {}
for i = 1, n do
  local base = 3 + 9 * (i - 1)
  local algorithm = tonumber(ARGV[base])
  local cost = tonumber(ARGV[base + 1])
  local applied = (not blocked) and (algorithm == 0 or not group_over[ARGV[base + 2]])
  local key = KEYS[2 * i - 1]
  if applied and cost > 0 then
    if algorithm == 3 then
      local s = state[i]
      redis.call('SET', key, string.format('%.17g %.17g %.17g', s[1], s[2], s[3]),
        'PX', after_reset[i])
    elseif redis.call('INCRBY', key, cost) == cost then
      redis.call('EXPIRE', key, ARGV[base + 8])
    end
  end
  local o = 5 * (i - 1)
  if over[i] then result[o + 1] = 1 else result[o + 1] = 0 end
  if applied then
    result[o + 2], result[o + 3], result[o + 4] = after_left[i], after_reset[i], 1
  else
    result[o + 2], result[o + 3], result[o + 4] = before_left[i], before_reset[i], 0
  end
  result[o + 5] = before_left[i]
end
return result
