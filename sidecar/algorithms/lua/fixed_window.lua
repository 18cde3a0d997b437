-- Fixed-window counters for one request (or the part of it that lives in one hash slot).
-- Mirrors sidecar/algorithms/fixed_window.py: keep the two in step.
--
-- KEYS[i]          counter key of hit i (all in one hash slot; a key may repeat)
-- ARGV[1]          mode: 0 = add every hit; 1 = all or nothing (add nothing when the request is
--                  over its limits); 2 = read only (add nothing, create nothing)
-- ARGV[2 + 4(i-1)] hits of hit i (0 = check: read only)
-- ARGV[3 + 4(i-1)] limit of hit i
-- ARGV[4 + 4(i-1)] ttl of hit i, seconds, set when the counter is created
-- ARGV[5 + 4(i-1)] role of hit i: 0 blocking, 1 shadow (never blocks), 2 quota (blocks when all
--                  quota hits are over)
--
-- Returns {applied, before_1, ..., before_n}: applied is 1 when the hits were added; before_i is
-- counter i's value before hit i (0 when absent), counting earlier hits of this request on the
-- same key as if they were added.

local mode = tonumber(ARGV[1])
local n = #KEYS
local result = {0}
local seen = {}
for i = 1, n do
  local key = KEYS[i]
  local before = seen[key]
  if before == nil then before = tonumber(redis.call('GET', key) or '0') end
  result[i + 1] = before
  seen[key] = before + tonumber(ARGV[4 * i - 2])
end

if mode == 2 then return result end
if mode == 1 then
  local quota_seen, quota_all_over = false, true
  for i = 1, n do
    local hits = tonumber(ARGV[4 * i - 2])
    local limit = tonumber(ARGV[4 * i - 1])
    local role = ARGV[4 * i + 1]
    local before = result[i + 1]
    local over
    if hits == 0 then over = before >= limit else over = before + hits > limit end
    if role == '0' and over then return result end
    if role == '2' then
      quota_seen = true
      quota_all_over = quota_all_over and over
    end
  end
  if quota_seen and quota_all_over then return result end
end

for i = 1, n do
  local hits = tonumber(ARGV[4 * i - 2])
  if hits > 0 and redis.call('INCRBY', KEYS[i], hits) == hits then
    redis.call('EXPIRE', KEYS[i], ARGV[4 * i])
  end
end
result[1] = 1
return result
