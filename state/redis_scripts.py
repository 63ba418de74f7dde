"""The Lua scripts of `RedisStore` (state/redis_store.py), one per multi-key change.

Each script's KEYS and ARGV are documented above it. Keys of one worker share a hash tag, so
every script touches one Redis Cluster slot (docs/design.md §5) — RESERVE_SCRIPT with its
optional ledger keys excepted, which the store passes on one server only. Kept apart from the
store's Python so each reads on its own: the store only names them.
"""

from __future__ import annotations

__all__ = [
    "SET_CAPACITY_SCRIPT",
    "RESERVE_SCRIPT",
    "RENEW_SCRIPT",
    "RENEW_MANY_SCRIPT",
    "RESIZE_SCRIPT",
    "RELEASE_SCRIPT",
    "USAGE_SCRIPT",
    "STRAND_SCRIPT",
    "MARK_READY_SCRIPT",
    "UNSTRAND_SCRIPT",
    "SET_ROLE_SCRIPT",
    "LUA_FEED",
    "HOLD_LEASE_SCRIPT",
    "RELEASE_LEASE_SCRIPT",
    "REAP_SCRIPT",
    "NOTE_REQUEST_SCRIPT",
    "TRY_RETRY_SCRIPT",
]


# Shared Lua fragments: the clock, and dropping a decode worker's expired leases. Both are
# pasted into the scripts that need them (a script cannot call another script).
_LUA_CLOCK = """
local function clock()
  if ARGV[1] ~= '' then return tonumber(ARGV[1]) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function score(x) return string.format('%.6f', x) end
"""

# One entry on the registry's change feed (`Keys.feed`, a stream capped at about 64 entries:
# readers only need to know that something changed since the id they hold, not what). Every
# script that changes what the registry sync reads calls it, in the same script, so no change
# can land without its entry (state/registry_feed.py).
LUA_FEED = """
local function feed(key)
  redis.call('XADD', key, 'MAXLEN', '~', 64, '*', 'c', '1')
end
"""

# One entry out of a hash (id -> amount), its zset (id -> time) and their kept sum; the amount
# taken, 0 when the entry is not there. A reservation's release and a stranded entry's clearing.
_LUA_DROP = """
local function drop(hash, zset, sum, id)
  local old = redis.call('HGET', hash, id)
  if not old then return 0 end
  redis.call('HDEL', hash, id)
  redis.call('ZREM', zset, id)
  redis.call('DECRBY', sum, old)
  return tonumber(old)
end
"""

# Expired means expiry <= now. One id at a time rather than `unpack(all)`: Lua's stack limits
# how many arguments one call may take, and a dead router can leave many leases behind.
_LUA_PURGE = """
local function purge(now)
  local dead = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', score(now))
  if #dead == 0 then return end
  local freed = 0
  for _, id in ipairs(dead) do
    freed = freed + tonumber(redis.call('HGET', KEYS[2], id) or 0)
    redis.call('HDEL', KEYS[2], id)
    redis.call('ZREM', KEYS[3], id)
  end
  redis.call('DECRBY', KEYS[4], freed)
end
local function free_blocks()
  local cap = tonumber(redis.call('GET', KEYS[1]) or 0)
  local used = tonumber(redis.call('GET', KEYS[4]) or 0)
  return cap - used
end
"""

# Every decode-reservation script takes the same KEYS (one worker, tag {d:<worker>}):
#   KEYS[1] capacity (string)   KEYS[2] id -> blocks (hash)
#   KEYS[3] id -> expiry (zset) KEYS[4] sum of blocks (string)
# and those that admit new blocks (reserve, resize) KEYS[5] the hold-back (string: no new
# reservation before this time; state/holdback.py).
_LUA_HELD = """
local function held_back(now)
  local till = redis.call('GET', KEYS[5])
  return till and tonumber(till) > now
end
"""

# Write a worker's capacity. Where the store had none (missing or 0) and ARGV[3] > 0 (the caller
# wrote it before: the store lost it, or the worker was deleted and registered again), hold new
# reservations back until now + ARGV[3], so the live reservations' put-backs land first; a later
# hold already there stays. KEYS[1] capacity  KEYS[2] hold-back (both tag {d:<worker>})
# ARGV[1] now  ARGV[2] capacity blocks  ARGV[3] hold-back seconds (0: none)
# Returns 1 if it started a hold-back, else 0.
SET_CAPACITY_SCRIPT = (
    _LUA_CLOCK
    + """
local now = clock()
local hold = tonumber(ARGV[3])
local started = 0
if hold > 0 and tonumber(redis.call('GET', KEYS[1]) or 0) == 0 then
  local till = now + hold
  if till > tonumber(redis.call('GET', KEYS[2]) or 0) then
    -- The TTL only tidies (an injected clock may not be the server's): the value decides.
    redis.call('SET', KEYS[2], score(till), 'PX', math.ceil(hold * 1000) + 60000)
    started = 1
  end
end
redis.call('SET', KEYS[1], ARGV[2])
return started
"""
)

# Record (or update the size of) a stranded-KV entry on one prefill worker's ledger: bytes hash
# `kb`, since zset `ks`, sum `ksum`. A repeated call keeps the first `since`: the prefill
# worker's KV lease started when the KV was first ready (or, pending, will start by then).
_LUA_STRAND = """
local function strand(kb, ks, ksum, id, nbytes, since)
  local old = tonumber(redis.call('HGET', kb, id) or 0)
  redis.call('HSET', kb, id, nbytes)
  redis.call('ZADD', ks, 'NX', score(since), id)
  redis.call('INCRBY', ksum, tonumber(nbytes) - old)
end
"""

# Hold blocks for a reservation. A live id already held succeeds again without counting twice
# and gets its lease renewed: a retried call must not leak or double-book capacity.
# ARGV[1] now ('' = server TIME)  ARGV[2] reservation id  ARGV[3] blocks  ARGV[4] lease seconds
# ARGV[5] overbook blocks (prediction-based admission: room forecast to free; 0 = none)
# KEYS[5] the hold-back: while it runs a new id is refused (a held one is renewed).
# With KEYS[6..8] (a prefill worker's ledger keys, tag {p:<worker>}; one server only: a
# cluster refuses keys of two slots in one script), the stranded-KV intent too, pending, only
# when the blocks are held: ARGV[6] entry id  ARGV[7] bytes  ARGV[8] seconds until it is ready
# at the latest. One round trip before the prefill, and a refused reservation leaves no entry.
# Returns 1 if held, 0 if there is no room.
RESERVE_SCRIPT = (
    _LUA_CLOCK
    + _LUA_PURGE
    + _LUA_STRAND
    + _LUA_HELD
    + """
local now = clock()
purge(now)
local expiry = score(now + tonumber(ARGV[4]))
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 0 then
  local blocks = tonumber(ARGV[3])
  if held_back(now) then return 0 end
  if free_blocks() + tonumber(ARGV[5] or 0) < blocks then return 0 end
  redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
  redis.call('INCRBY', KEYS[4], ARGV[3])
end
redis.call('ZADD', KEYS[3], expiry, ARGV[2])
if #KEYS == 8 then
  strand(KEYS[6], KEYS[7], KEYS[8], ARGV[6], ARGV[7], now + tonumber(ARGV[8]))
end
return 1
"""
)

# Extend a live lease to now + lease seconds.
# ARGV[1] now  ARGV[2] reservation id  ARGV[3] lease seconds
# Returns 1 if renewed, 0 if the reservation is gone (released or expired).
RENEW_SCRIPT = (
    _LUA_CLOCK
    + _LUA_PURGE
    + """
local now = clock()
purge(now)
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 0 then return 0 end
redis.call('ZADD', KEYS[3], score(now + tonumber(ARGV[3])), ARGV[2])
return 1
"""
)

# Renew many leases of one worker in one call, putting back those the store lost.
# ARGV[1] now  ARGV[2] lease seconds  ARGV[3..] pairs of reservation id, blocks
# A missing id is held again at its blocks without a capacity check: its sequence occupies the
# worker whatever the count says. Returns the ids put back.
RENEW_MANY_SCRIPT = (
    _LUA_CLOCK
    + _LUA_PURGE
    + """
local now = clock()
purge(now)
local expiry = score(now + tonumber(ARGV[2]))
local back = {}
local added = 0
for i = 3, #ARGV, 2 do
  local id, blocks = ARGV[i], tonumber(ARGV[i + 1])
  local held = redis.call('HEXISTS', KEYS[2], id) == 1
  if not held and blocks > 0 then
    redis.call('HSET', KEYS[2], id, ARGV[i + 1])
    added = added + blocks
    back[#back + 1] = id
    held = true
  end
  if held then redis.call('ZADD', KEYS[3], expiry, id) end
end
if added > 0 then redis.call('INCRBY', KEYS[4], added) end
return back
"""
)

# Change a live reservation's blocks; growth needs the extra blocks free, shrinking always works.
# ARGV[1] now  ARGV[2] reservation id  ARGV[3] new blocks  ARGV[4] '1' = grow even past capacity
# (the tokens already exist on the worker: the count must not stay below use)
# KEYS[5] the hold-back: while it runs, growth is refused unless forced.
# Returns 1 if resized, 0 if gone or if growth does not fit.
RESIZE_SCRIPT = (
    _LUA_CLOCK
    + _LUA_PURGE
    + _LUA_HELD
    + """
local now = clock()
purge(now)
local old = redis.call('HGET', KEYS[2], ARGV[2])
if not old then return 0 end
local delta = tonumber(ARGV[3]) - tonumber(old)
if delta > 0 and ARGV[4] ~= '1' and (held_back(now) or free_blocks() < delta) then return 0 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('INCRBY', KEYS[4], delta)
return 1
"""
)

# Drop a reservation.
# ARGV[1] now  ARGV[2] reservation id
# Returns the blocks it held, 0 if it was already gone (released, or its lease expired).
RELEASE_SCRIPT = (
    _LUA_DROP
    + _LUA_CLOCK
    + _LUA_PURGE
    + """
local now = clock()
purge(now)
return drop(KEYS[2], KEYS[3], KEYS[4], ARGV[2])
"""
)

# Drop expired leases, then read the worker's usage.
# ARGV[1] now
# Returns {capacity, reserved blocks, live reservations}.
USAGE_SCRIPT = (
    _LUA_CLOCK
    + _LUA_PURGE
    + """
purge(clock())
return {tonumber(redis.call('GET', KEYS[1]) or 0), tonumber(redis.call('GET', KEYS[4]) or 0),
        redis.call('HLEN', KEYS[2])}
"""
)

# Every ledger script takes the same KEYS (one prefill worker, tag {p:<worker>}):
#   KEYS[1] id -> bytes (hash)  KEYS[2] id -> since (zset)  KEYS[3] sum of bytes (string)

# Record (or update the size of) stranded KV, ready at now + ARGV[4] (negative: that long ago;
# positive: pending, ready by then at the latest).
# ARGV[1] now  ARGV[2] request id  ARGV[3] bytes  ARGV[4] seconds until ready
STRAND_SCRIPT = (
    _LUA_CLOCK
    + _LUA_STRAND
    + """
strand(KEYS[1], KEYS[2], KEYS[3], ARGV[2], ARGV[3], clock() + tonumber(ARGV[4] or 0))
return 1
"""
)

# A pending entry's prefill answered ARGV[3] seconds ago: its KV lease counts from then. Only
# an entry still there is touched (ZADD XX), so a mark that arrives after the unstrand (they
# are separate background calls) cannot bring the entry back.
# ARGV[1] now  ARGV[2] request id  ARGV[3] age seconds
# Returns 1 if the entry was there, 0 if not.
MARK_READY_SCRIPT = (
    _LUA_CLOCK
    + """
if redis.call('HEXISTS', KEYS[1], ARGV[2]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], 'XX', score(clock() - tonumber(ARGV[3])), ARGV[2])
return 1
"""
)

# Clear a stranded entry.
# ARGV[1] request id
# Returns the bytes cleared, 0 if absent.
UNSTRAND_SCRIPT = (
    _LUA_DROP
    + """
return drop(KEYS[1], KEYS[2], KEYS[3], ARGV[1])
"""
)

# A role change, compare-and-set on the version, on the registry's feed. KEYS[1] {reg}:roles
# KEYS[2] {reg}:feed  ARGV[1] now ('' = the
# server's clock)  ARGV[2] worker id  ARGV[3] role  ARGV[4] expected version (0: none yet)
# ARGV[5] broken mark ('' or absent: none). Returns the new "role|version|since[|broken]", or
# false when the version moved on.
SET_ROLE_SCRIPT = (
    _LUA_CLOCK
    + LUA_FEED
    + """
local cur = redis.call('HGET', KEYS[1], ARGV[2])
local version = 0
if cur then version = tonumber(string.match(cur, '^[^|]*|(%d+)|')) end
if version ~= tonumber(ARGV[4]) then return false end
local rec = ARGV[3] .. '|' .. (version + 1) .. '|' .. score(clock())
if ARGV[5] and ARGV[5] ~= '' then rec = rec .. '|' .. ARGV[5] end
redis.call('HSET', KEYS[1], ARGV[2], rec)
feed(KEYS[2])
return rec
"""
)

# Take or extend a lease. KEYS[1] the lease key  ARGV[1] holder  ARGV[2] ttl in ms.
HOLD_LEASE_SCRIPT = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

RELEASE_LEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""

# Remove and return entries stranded at least `older_than` seconds.
# ARGV[1] now  ARGV[2] older_than seconds
# Returns a flat list {id, bytes, since, id, bytes, since, ...} (strings: Lua numbers would be
# truncated to integers on the way out).
REAP_SCRIPT = (
    _LUA_CLOCK
    + """
local cutoff = clock() - tonumber(ARGV[2])
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', score(cutoff), 'WITHSCORES')
local out = {}
local freed = 0
for i = 1, #old, 2 do
  local id = old[i]
  local nbytes = redis.call('HGET', KEYS[1], id) or '0'
  freed = freed + tonumber(nbytes)
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
  out[#out + 1] = id
  out[#out + 1] = nbytes
  out[#out + 1] = old[i + 1]
end
if freed ~= 0 then redis.call('DECRBY', KEYS[3], freed) end
return out
"""
)

# Retry-budget buckets: a hash field per unix second. Pruning fields older than the retention
# runs only when a second's first count lands, so it costs one HKEYS per second, not per call.
_LUA_BUCKETS = """
local function count(key, sec, retention, n)
  local now_count = redis.call('HINCRBY', key, string.format('%d', sec), n)
  if now_count == n then
    for _, f in ipairs(redis.call('HKEYS', key)) do
      if tonumber(f) <= sec - retention then redis.call('HDEL', key, f) end
    end
  end
  redis.call('EXPIRE', key, ARGV[3])
end
local function window_sum(key, first)
  local total = 0
  local kv = redis.call('HGETALL', key)
  for i = 1, #kv, 2 do
    if tonumber(kv[i]) >= first then total = total + tonumber(kv[i + 1]) end
  end
  return total
end
"""

# Count first attempts (a router sends its count once per state refresh, not once per request).
# KEYS[1] requests per second (hash, tag {rb})
# ARGV[1] now  ARGV[2] retention seconds  ARGV[3] TTL seconds  ARGV[4] how many
NOTE_REQUEST_SCRIPT = (
    _LUA_CLOCK
    + _LUA_BUCKETS
    + """
count(KEYS[1], math.floor(clock()), tonumber(ARGV[2]), tonumber(ARGV[4]))
return 1
"""
)

# Spend one retry iff retries_in_window + 1 <= ratio * requests_in_window + min_per_s * window.
# The window is the last ceil(window) whole seconds, the current one included.
# KEYS[1] requests per second (hash)  KEYS[2] retries per second (hash), both tag {rb}
# ARGV[1] now  ARGV[2] retention seconds  ARGV[3] TTL seconds
# ARGV[4] ratio  ARGV[5] min_per_s  ARGV[6] window seconds
# Returns 1 if the retry was allowed (and counted), 0 if not.
TRY_RETRY_SCRIPT = (
    _LUA_CLOCK
    + _LUA_BUCKETS
    + """
local sec = math.floor(clock())
local window = tonumber(ARGV[6])
local first = sec - math.ceil(window) + 1
local requests = window_sum(KEYS[1], first)
local retries = window_sum(KEYS[2], first)
if retries + 1 > tonumber(ARGV[4]) * requests + tonumber(ARGV[5]) * window then return 0 end
count(KEYS[2], sec, tonumber(ARGV[2]), 1)
return 1
"""
)
