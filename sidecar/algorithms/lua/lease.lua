-- Leases of fixed windows' budgets and of token buckets' tokens (sidecar/algorithms/lease.py,
-- whose `settle` and `settle_bucket` this mirrors: keep them in step; tests/test_lease.py checks
-- they agree). One call per hash slot carries every counter of that slot a sidecar renews or
-- gives back.
--
-- KEYS[i]     counter i: a window's counter key, holding `taken`, the budget handed out so far;
--             or a token bucket's key, in decide.lua's format ('tokens stamp drawn')
-- ARGV[1]     margin, milliseconds: a window that started less than this before this server did
--             is treated as one it forgot (clocks of sidecars and server may differ this much)
-- ARGV[2]     now, Unix ms (the sidecar's clock), for buckets
-- ARGV[3]     lease, milliseconds: how long a sidecar may hold the tokens it took
-- ARGV[4 + 6(i-1) ...] for counter i, six values:
--   kind       0 a fixed window, 1 a token bucket
--   p1 p2 p3   window: its requests_per_unit, its start and its end (Unix ms);
--              bucket: its rate, period ms, capacity
--   returned   units given back (taken off first; ignored when a window's counter is gone)
--   want       units asked for (0: only give back)
--
-- Returns 2 integers per counter: the block granted, and what is left after it (a window's
-- limit - taken; a bucket's whole tokens).
--
-- A window's counter lives until LATE_MS after its window ends, so a renewal that reaches the
-- server late (queued behind others) still finds it; one that finds no counter that late takes
-- the window as spent, since its counter may have expired.
--
-- A block is at most two thirds of what is left, rounded up. A server that restarted forgot
-- what it had handed out, while holders still spend their blocks: a window it does not have
-- that started before it did is set to its limit (spent), so it grants nothing more; a bucket
-- it does not have while it has been up less than a lease (and the margin) is taken as empty
-- now, not full. That costs the rest of such a window, or a bucket's refill until
-- then, never an over-admission.

local margin = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local lease = tonumber(ARGV[3])
local started = nil
local out = {}
-- sidecar/storage/leases.py LATE_MS: keep them equal.
local late = 10000

local server_now = nil

local function server_now_ms()
  if server_now == nil then
    local time = redis.call('TIME')
    server_now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  end
  return server_now
end

local function server_started_ms()
  if started == nil then
    local info = redis.call('INFO', 'server')
    local uptime = tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
    -- Rounded late: uptime counts whole seconds, and a later start refuses more, never less.
    started = (math.floor(server_now_ms() / 1000) - uptime) * 1000
  end
  return started
end

local function block_of(left, want)
  if want <= 0 or left <= 0 then return 0 end
  local block = math.floor((2 * left + 2) / 3)  -- two thirds, rounded up
  if want < block then block = want end
  return block
end

for i = 1, #KEYS do
  local at = 4 + 6 * (i - 1)
  local kind = tonumber(ARGV[at])
  local p1, p2, p3 = tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3])
  local returned = tonumber(ARGV[at + 4])
  local want = tonumber(ARGV[at + 5])
  local key = KEYS[i]
  local v = redis.call('GET', key)
  if kind == 0 then
    local limit, start, ends = p1, p2, p3
    local taken
    if v then
      taken = tonumber(v)
      if returned > 0 then
        taken = taken - returned
        if taken < 0 then taken = 0 end
      end
    elseif start < server_started_ms() + margin or server_now_ms() >= ends + late - margin then
      taken = limit
    else
      taken = 0
    end
    local block = block_of(limit - taken, want)
    taken = taken + block
    if not v then
      local px = ends + late - now
      if taken > 0 and px > 0 then redis.call('SET', key, taken, 'PX', px) end
    elseif v ~= tostring(taken) then
      redis.call('SET', key, taken, 'KEEPTTL')
    end
    out[2 * i - 1] = block
    out[2 * i] = limit - taken
  else
    -- Refilled as decide.lua refills, operation for operation.
    local rate, period, capacity = p1, p2, p3
    local tokens, drawn
    if v then
      local t, stamp, d = string.match(v, '^(%S+) (%S+) (%S+)')
      t, stamp, d = tonumber(t), tonumber(stamp), tonumber(d)
      local elapsed = now - stamp
      if elapsed < 0 then elapsed = 0 end
      if elapsed >= math.ceil((capacity - t) * period / rate) then
        tokens, drawn = capacity, 0
      else
        tokens = math.min(capacity, t + elapsed * rate / period)
        if tokens >= capacity then drawn = 0 else drawn = d end
      end
    elseif now < server_started_ms() + lease + margin then
      tokens, drawn = 0, 0  -- refilled from now on
    else
      tokens, drawn = capacity, 0
    end
    tokens = math.min(capacity, tokens + returned)
    local block = block_of(math.floor(tokens), want)
    tokens = tokens - block
    if block > 0 or returned > 0 or not v then
      local reset = math.ceil((capacity - tokens) * period / rate)
      if reset > 0 then
        redis.call('SET', key, string.format('%.17g %.17g %.17g', tokens, now, drawn), 'PX', reset)
      elseif v then
        redis.call('DEL', key)  -- full again: a full bucket and none are the same
      end
    end
    out[2 * i - 1] = block
    out[2 * i] = math.floor(tokens)
  end
end
return out
