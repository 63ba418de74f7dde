"""The Lua script of the cluster's fair share (state/fair_shares.py has the steps; `fair_sync_now`
there is the same arithmetic in Python, and the conformance suite holds both to the same
results).

Both keys share the hash tag ``{fair}``, so the script touches one Redis Cluster slot:

    KEYS[1] <p>{fair}:vtc    hash  "<class>|<tenant>" -> its virtual counter
    KEYS[2] <p>{fair}:wait   hash  "<replica>|<class>|<tenant>" -> "count|since|expires|held"
                                   (unix s; held: decode blocks; count 0: it only holds)
    KEYS[3] <p>{fair}:floor  hash  "<class>" -> its floor

ARGV: now ('' for the server's clock), replica, lease (s), the number of charges then (class,
tenant, amount) for each, the number of waiters then (class, tenant, count, age s) for each,
the number of holdings then (class, tenant, blocks) for each.
The answer, flat: the number of floors then (class, floor) each, the number of counters then
(class, tenant, counter) each, the number of waiters then (replica, class, tenant, count,
waited s) each, the number of holdings then (class, tenant, blocks over every replica) each,
the number of replicas registered then their names; numbers as strings (a Lua number would
come back truncated to an integer).
"""

from __future__ import annotations

from state.fair_shares import SWEEP_ABOVE
from state.redis_scripts import _LUA_CLOCK

__all__ = ["FAIR_CLAIM_SCRIPT", "FAIR_SYNC_SCRIPT"]

FAIR_SYNC_SCRIPT = (
    _LUA_CLOCK
    + """
local now = clock()
local replica = ARGV[2]
local lease = tonumber(ARGV[3])
local function fmt(x) return string.format('%.17g', x) end
local function slot(p, t) return p .. '|' .. t end
local function floor_of(p) return tonumber(redis.call('HGET', KEYS[3], p) or '0') end
local function counter_of(s) return tonumber(redis.call('HGET', KEYS[1], s) or '') end

-- 1. live registrations; who waited before this call; this replica's own dropped
local before = {}
local regs = redis.call('HGETALL', KEYS[2])
for i = 1, #regs, 2 do
  local field, value = regs[i], regs[i + 1]
  local r, p, t = string.match(field, '^([^|]*)|(%-?%d+)|(.*)$')
  local count, _, expires = string.match(value, '^([^|]*)|([^|]*)|([^|]*)')
  if tonumber(expires) <= now then
    redis.call('HDEL', KEYS[2], field)
  else
    if tonumber(count) > 0 then before[slot(p, t)] = {p, t} end
    if r == replica then redis.call('HDEL', KEYS[2], field) end
  end
end

local function raise_floors(waiting)
  local least = {}
  for s, pt in pairs(waiting) do
    local c = counter_of(s)
    if c ~= nil and (least[pt[1]] == nil or c < least[pt[1]]) then least[pt[1]] = c end
  end
  for p, c in pairs(least) do
    if c > floor_of(p) then redis.call('HSET', KEYS[3], p, fmt(c)) end
  end
end

-- 2. floors
raise_floors(before)

-- 3. lift and charge
local named = {}
local charged = {}
local i = 4
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local p, t, amount = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2]); i = i + 3
  local s = slot(p, t)
  named[s] = {p, t}
  charged[s] = (charged[s] or 0) + amount
end
local regs_out = {}
local m = tonumber(ARGV[i]); i = i + 1
for _ = 1, m do
  local p, t, count, age = ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3]); i = i + 4
  local s = slot(p, t)
  named[s] = {p, t}
  regs_out[s] = {p, t, count, age, '0'}
end
local lifted = {}
for s, pt in pairs(named) do lifted[s] = pt end
local h = tonumber(ARGV[i]); i = i + 1
for _ = 1, h do
  local p, t, blocks = ARGV[i], ARGV[i + 1], ARGV[i + 2]; i = i + 3
  local s = slot(p, t)
  named[s] = {p, t}
  if regs_out[s] == nil then regs_out[s] = {p, t, '0', 0, '0'} end
  regs_out[s][5] = blocks
end
for s, pt in pairs(lifted) do
  local floor = floor_of(pt[1])
  local c = counter_of(s)
  if c == nil then c = floor end
  if before[s] == nil and c < floor then c = floor end
  c = c + (charged[s] or 0)
  redis.call('HSET', KEYS[1], s, fmt(c))
end

-- 4. register
for _, w in pairs(regs_out) do
  if tonumber(w[3]) > 0 or tonumber(w[5]) > 0 then
    redis.call('HSET', KEYS[2], replica .. '|' .. w[1] .. '|' .. w[2],
      w[3] .. '|' .. fmt(now - w[4]) .. '|' .. fmt(now + lease) .. '|' .. w[5])
  end
end
local waiting_now = {}
local classes_waiting = {}
local held = {}
regs = redis.call('HGETALL', KEYS[2])
local live = {}
local registered = {}
for j = 1, #regs, 2 do
  local r, p, t = string.match(regs[j], '^([^|]*)|(%-?%d+)|(.*)$')
  registered[r] = true
  local count, since, _, blocks = string.match(regs[j + 1], '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
  local s = slot(p, t)
  if tonumber(count) > 0 then
    waiting_now[s] = {p, t}
    classes_waiting[p] = true
    live[#live + 1] = {r, p, t, count, since}
  end
  if tonumber(blocks) > 0 then
    if held[s] == nil then held[s] = {p, t, 0} end
    held[s][3] = held[s][3] + tonumber(blocks)
  end
end

-- 5. a class nobody waits in: its floor follows this call's charged counters
for s, _ in pairs(charged) do
  local p = named[s][1]
  if not classes_waiting[p] then
    local c = counter_of(s)
    if c > floor_of(p) then redis.call('HSET', KEYS[3], p, fmt(c)) end
  end
end
raise_floors(waiting_now)

-- 6. sweep
if redis.call('HLEN', KEYS[1]) > """
    + str(SWEEP_ABOVE)
    + """ then
  local all = redis.call('HGETALL', KEYS[1])
  for j = 1, #all, 2 do
    local p, t = string.match(all[j], '^(%-?%d+)|(.*)$')
    if p ~= nil and waiting_now[slot(p, t)] == nil
        and tonumber(all[j + 1]) <= floor_of(p) then
      redis.call('HDEL', KEYS[1], all[j])
    end
  end
end

-- the answer
local out = {}
local floors = {}
local fl = redis.call('HGETALL', KEYS[3])
for j = 1, #fl, 2 do floors[#floors + 1] = {fl[j], fl[j + 1]} end
out[#out + 1] = tostring(#floors)
for _, f in ipairs(floors) do out[#out + 1] = f[1]; out[#out + 1] = f[2] end
for s, pt in pairs(waiting_now) do named[s] = pt end
for s, hb in pairs(held) do named[s] = {hb[1], hb[2]} end
local rows = {}
for s, pt in pairs(named) do
  local c = counter_of(s)
  if c == nil then c = floor_of(pt[1]) end
  rows[#rows + 1] = {pt[1], pt[2], fmt(c)}
end
out[#out + 1] = tostring(#rows)
for _, r in ipairs(rows) do out[#out + 1] = r[1]; out[#out + 1] = r[2]; out[#out + 1] = r[3] end
out[#out + 1] = tostring(#live)
for _, w in ipairs(live) do
  local waited = now - tonumber(w[5])
  if waited < 0 then waited = 0 end
  out[#out + 1] = w[1]; out[#out + 1] = w[2]; out[#out + 1] = w[3]
  out[#out + 1] = w[4]; out[#out + 1] = fmt(waited)
end
local hrows = {}
for _, hb in pairs(held) do hrows[#hrows + 1] = hb end
out[#out + 1] = tostring(#hrows)
for _, hb in ipairs(hrows) do
  out[#out + 1] = hb[1]; out[#out + 1] = hb[2]; out[#out + 1] = tostring(hb[3])
end
local names = {}
for r, _ in pairs(registered) do names[#names + 1] = r end
out[#out + 1] = tostring(#names)
for _, r in ipairs(names) do out[#out + 1] = r end
local ttl = math.ceil((lease + 3600) * 1000)
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
redis.call('PEXPIRE', KEYS[2], math.ceil((lease + 60) * 1000))
return out
"""
)


# Claims of waiters' requests before a take-back (state/base.py `fair_claim`). KEYS: every unit's
# key, line after line (`<p>{fair}:claim:<line>|<k>`, one slot with the counters); ARGV: the
# claimant, the claims' life in ms, then per line (its units' count, the units wanted). The
# answer: per line, the units claimed (the first free ones; a claim already held, by anyone,
# is not free until it expires).
FAIR_CLAIM_SCRIPT = """
local owner, ttl = ARGV[1], ARGV[2]
local out = {}
local key, a = 1, 3
while a < #ARGV do
  local n, want = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local got = 0
  for i = 0, n - 1 do
    if got < want and redis.call('SET', KEYS[key + i], owner, 'NX', 'PX', ttl) then
      got = got + 1
    end
  end
  out[#out + 1] = got
  key, a = key + n, a + 2
end
return out
"""
