-- Leases of fixed windows' budgets (sidecar/algorithms/lease.py, whose `settle` this mirrors:
-- keep them in step; tests/test_lease.py checks they agree). One call per hash slot carries
-- every counter of that slot a sidecar renews or gives back.
--
-- KEYS[i]     counter i: the window's counter key, holding `taken`, the budget handed out so far
-- ARGV[1]     margin, milliseconds: a window that started less than this before this server did
--             is treated as one it forgot (clocks of sidecars and server may differ this much)
-- ARGV[2 + 5(i-1) ...] for counter i, five values:
--   limit      the window's requests_per_unit
--   start      the window's start, Unix ms (the sidecar's clock)
--   ttl        seconds a new counter must live
--   returned   units given back (taken off first; ignored when the counter is gone)
--   want       units asked for (0: only give back)
--
-- Returns 2 integers per counter: the block granted, and what is left of the window's budget
-- after it (limit - taken).
--
-- A server that restarted forgot what it had handed out, while holders still spend their
-- blocks: a counter it does not have, of a window that started before it did, is set to its
-- limit (spent) instead of starting from 0, so the window grants nothing more. That costs the
-- rest of that one window's budget, never an over-admission.

local margin = tonumber(ARGV[1])
local started = nil
local out = {}

local function server_started_ms()
  if started == nil then
    local info = redis.call('INFO', 'server')
    local uptime = tonumber(string.match(info, 'uptime_in_seconds:(%d+)'))
    local now = redis.call('TIME')
    -- Rounded late: uptime counts whole seconds, and a later start refuses more, never less.
    started = (tonumber(now[1]) - uptime) * 1000
  end
  return started
end

for i = 1, #KEYS do
  local at = 2 + 5 * (i - 1)
  local limit = tonumber(ARGV[at])
  local start = tonumber(ARGV[at + 1])
  local ttl = tonumber(ARGV[at + 2])
  local returned = tonumber(ARGV[at + 3])
  local want = tonumber(ARGV[at + 4])
  local key = KEYS[i]
  local v = redis.call('GET', key)
  local taken
  local fresh = not v
  if v then
    taken = tonumber(v)
    if returned > 0 then
      taken = taken - returned
      if taken < 0 then taken = 0 end
    end
  elseif start < server_started_ms() + margin then
    taken = limit
  else
    taken = 0
  end
  local left = limit - taken
  local block = 0
  if want > 0 and left > 0 then
    block = math.floor((2 * left + 2) / 3)  -- two thirds, rounded up
    if want < block then block = want end
  end
  taken = taken + block
  if fresh then
    if taken > 0 then redis.call('SET', key, taken, 'EX', ttl) end
  elseif v ~= tostring(taken) then
    redis.call('SET', key, taken, 'KEEPTTL')
  end
  out[2 * i - 1] = block
  out[2 * i] = limit - taken
end
return out
