"""The Lua scripts of the tenants' quotas (state/quotas.py has the rules; `take_quota_now` there
is the same arithmetic in Python, and the conformance suite holds both to the same results).

One tenant's keys share the hash tag ``{t:<tenant>}``, so each script touches one Redis Cluster
slot:

    KEYS[1] <p>{t:<tenant>}:q      hash    rq, tk: the buckets' levels (absent: full), at: when
                                           they were
    KEYS[2] <p>{t:<tenant>}:holds  hash    hold id -> "blocks|expected end (unix s)"
    KEYS[3] <p>{t:<tenant>}:hexp   zset    hold id -> lease expiry (unix s)
    KEYS[4] <p>{t:<tenant>}:hsum   string  the sum of the holds' blocks, kept exact

Limits travel with every call (ARGV, '' for none): the configuration is each replica's, the
store keeps only levels. The bucket hash expires a minute after both buckets are full again
(what a missing hash reads as: nothing is forgiven early, a debt included); the holds' three
keys a minute after the longest lease they were last given, together.
"""

from __future__ import annotations

from state.redis_scripts import _LUA_CLOCK

__all__ = [
    "RENEW_QUOTA_SCRIPT",
    "RESIZE_HOLD_SCRIPT",
    "SETTLE_QUOTA_SCRIPT",
    "TAKE_QUOTA_SCRIPT",
]

_LUA_QUOTA = (
    _LUA_CLOCK
    + """
local MINUTE = 60.0
local function refill(level, limit, elapsed)
  if level == nil then return limit end
  if elapsed < 0 then elapsed = 0 end
  return math.min(limit, level + elapsed * limit / MINUTE)
end
local function num(s)
  if s == nil or s == false or s == '' then return nil end
  return tonumber(s)
end
local function purge_holds(now)
  local dead = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', score(now))
  if #dead == 0 then return end
  local freed = 0
  for _, id in ipairs(dead) do
    local v = redis.call('HGET', KEYS[2], id)
    if v then
      freed = freed + tonumber(string.match(v, '^([^|]+)'))
      redis.call('HDEL', KEYS[2], id)
    end
    redis.call('ZREM', KEYS[3], id)
  end
  redis.call('DECRBY', KEYS[4], freed)
end
local function keep_holds(lease)
  local ms = math.ceil((lease + 60) * 1000)
  for i = 2, 4 do
    local ttl = redis.call('PTTL', KEYS[i])
    if ttl == -1 or (ttl >= 0 and ttl < ms) then redis.call('PEXPIRE', KEYS[i], ms) end
  end
end
-- The buckets at `now`, written; the hash kept until a minute after both are full again.
local function write_buckets(now, rq, tk, rpm, tpm)
  local fields = {'at', score(now)}
  local full_in = 0
  if rq then
    table.insert(fields, 'rq'); table.insert(fields, score(rq))
    full_in = math.max(full_in, (rpm - rq) * MINUTE / rpm)
  end
  if tk then
    table.insert(fields, 'tk'); table.insert(fields, score(tk))
    full_in = math.max(full_in, (tpm - tk) * MINUTE / tpm)
  end
  redis.call('HSET', KEYS[1], unpack(fields))
  redis.call('PEXPIRE', KEYS[1], math.ceil((full_in + MINUTE) * 1000))
end
local function fmt(x) if x == nil then return '' end return string.format('%.6f', x) end
"""
)

# ARGV[1] now ('' = server TIME)  ARGV[2] hold id  ARGV[3] tokens  ARGV[4] blocks
# ARGV[5] lease seconds  ARGV[6] expected end, seconds from now
# ARGV[7] requests/minute  ARGV[8] tokens/minute  ARGV[9] max reserved blocks ('' = none)
# -> {granted 0|1, limit, retry after s, requests left, tokens left, held blocks}
TAKE_QUOTA_SCRIPT = (
    _LUA_QUOTA
    + """
local now = clock()
local id, tokens, blocks = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local lease, ends_in = tonumber(ARGV[5]), tonumber(ARGV[6])
local rpm, tpm, maxb = num(ARGV[7]), num(ARGV[8]), num(ARGV[9])
purge_holds(now)
local q = redis.call('HMGET', KEYS[1], 'rq', 'tk', 'at')
local at = num(q[3]) or now
local rq, tk, held = nil, nil, tonumber(redis.call('GET', KEYS[4]) or '0')
if rpm then rq = refill(num(q[1]), rpm, now - at) end
if tpm then tk = refill(num(q[2]), tpm, now - at) end
local function answer(granted, limit, wait)
  return {granted, limit, fmt(wait), fmt(rq), fmt(tk), held}
end
if maxb and redis.call('HEXISTS', KEYS[2], id) == 1 then
  return answer(1, '', 0)  -- a retried call: taken already
end
local worst, name = -1, ''
if rpm and rq < 1 then
  local w = (1 - rq) * MINUTE / rpm
  if w > worst then worst, name = w, 'requests_per_minute' end
end
if tpm then
  local need = math.min(tokens, tpm)
  if tk < need then
    local w = (need - tk) * MINUTE / tpm
    if w > worst then worst, name = w, 'tokens_per_minute' end
  end
end
if maxb and held > 0 and held + blocks > maxb then
  local soonest = math.huge
  for i, v in ipairs(redis.call('HVALS', KEYS[2])) do
    local e = tonumber(string.match(v, '|(.+)$'))
    if e < soonest then soonest = e end
  end
  local w = math.max(soonest - now, 1.0)
  if w > worst then worst, name = w, 'max_reserved_blocks' end
end
if worst >= 0 then
  -- Refused: nothing taken; the refilled levels are not written (they follow from `at`).
  return answer(0, name, math.max(0.05, worst))
end
if rq then rq = rq - 1 end
if tk then tk = tk - tokens end
if rq or tk then write_buckets(now, rq, tk, rpm, tpm) end
if maxb then
  redis.call('HSET', KEYS[2], id, blocks .. '|' .. score(now + math.max(0, ends_in)))
  redis.call('ZADD', KEYS[3], score(now + lease), id)
  held = redis.call('INCRBY', KEYS[4], blocks)
  keep_holds(lease)
end
return answer(1, '', 0)
"""
)

# ARGV[1] now  ARGV[2] hold id ('' = none)  ARGV[3] token correction (actual - charged)
# ARGV[4] requests/minute  ARGV[5] tokens/minute ('' = none)  ARGV[6] '1': give the request
# back (the cluster refused it) -> blocks the hold had (0: gone)
SETTLE_QUOTA_SCRIPT = (
    _LUA_QUOTA
    + """
local now = clock()
local id, correction = ARGV[2], tonumber(ARGV[3])
local rpm, tpm = num(ARGV[4]), num(ARGV[5])
local freed = 0
if id ~= '' then
  local v = redis.call('HGET', KEYS[2], id)
  if v then
    freed = tonumber(string.match(v, '^([^|]+)'))
    redis.call('HDEL', KEYS[2], id)
    redis.call('ZREM', KEYS[3], id)
    redis.call('DECRBY', KEYS[4], freed)
  end
end
local refund = ARGV[6] == '1' and rpm ~= nil
if (tpm and correction ~= 0) or refund then
  -- Both buckets refilled to now (they share `at`), the tokens corrected, the request given
  -- back.
  local q = redis.call('HMGET', KEYS[1], 'rq', 'tk', 'at')
  local at = num(q[3]) or now
  local rq, tk = nil, nil
  if rpm then rq = refill(num(q[1]), rpm, now - at) end
  if refund then rq = math.min(rpm, rq + 1) end
  if tpm then tk = math.min(tpm, refill(num(q[2]), tpm, now - at) - correction) end
  write_buckets(now, rq, tk, rpm, tpm)
end
return freed
"""
)

# ARGV[1] now  ARGV[2] hold id  ARGV[3] blocks  ARGV[4] lease seconds  ARGV[5] '1': force
# ARGV[6] max reserved blocks -> {granted 0|1, retry after s, held blocks}
RESIZE_HOLD_SCRIPT = (
    _LUA_QUOTA
    + """
local now = clock()
local id, blocks, lease = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local force, maxb = ARGV[5] == '1', tonumber(ARGV[6])
purge_holds(now)
local v = redis.call('HGET', KEYS[2], id)
local old, ends = 0, now + lease
if v then
  old = tonumber(string.match(v, '^([^|]+)'))
  ends = tonumber(string.match(v, '|(.+)$'))
end
local held = tonumber(redis.call('GET', KEYS[4]) or '0')
local others = held - old
if not force and blocks > old and others + blocks > maxb then
  local soonest = now
  local all = redis.call('HGETALL', KEYS[2])
  for i = 1, #all, 2 do
    if all[i] ~= id then
      local e = tonumber(string.match(all[i + 1], '|(.+)$'))
      if soonest == now or e < soonest then soonest = e end
    end
  end
  return {0, fmt(math.max(0.05, soonest - now, 1.0)), held}
end
redis.call('HSET', KEYS[2], id, blocks .. '|' .. score(ends))
redis.call('ZADD', KEYS[3], score(now + lease), id)
held = redis.call('INCRBY', KEYS[4], blocks - old)
keep_holds(lease)
return {1, fmt(0), held}
"""
)

# ARGV[1] now  ARGV[2] lease seconds, then pairs: hold id, blocks -> ids put back
RENEW_QUOTA_SCRIPT = (
    _LUA_QUOTA
    + """
local now = clock()
local lease = tonumber(ARGV[2])
purge_holds(now)
local back = {}
for i = 3, #ARGV, 2 do
  local id, blocks = ARGV[i], tonumber(ARGV[i + 1])
  if redis.call('HEXISTS', KEYS[2], id) == 0 then
    redis.call('HSET', KEYS[2], id, blocks .. '|' .. score(now + lease))
    redis.call('INCRBY', KEYS[4], blocks)
    table.insert(back, id)
  end
  redis.call('ZADD', KEYS[3], score(now + lease), id)
end
keep_holds(lease)
return back
"""
)
