"""The Lua scripts of the worker registry (state/redis_registry.py): the store-loss marker, drain
marks, a replica's put-back after a loss, forgetting a worker, and the tenants' key table.

Every script that changes what the registry sync reads (a registration, a drain mark, a role,
the tenant keys, the marker re-created) appends to the registry's change feed in the same script
(`LUA_FEED`, `Keys.feed`): quiet replicas block on that feed instead of reading the registry
every second (state/registry_feed.py). Each takes the feed key last among its KEYS.

Every script here touches the registry's keys only (hash tag ``{reg}``), so each runs on one
Redis Cluster slot — but for `REGISTRY_AND_USAGE_SCRIPT`, a quiet replica's one read a beat,
which reads the decode and prefill workers' keys too and so is for one server only. The role
and lease scripts, older, stay in state/redis_scripts.py.
"""

from __future__ import annotations

from state.redis_scripts import _LUA_CLOCK, LUA_FEED, USAGE_SCRIPT

__all__ = [
    "MARKER_SCRIPT",
    "REGISTER_WORKER_SCRIPT",
    "FORGET_ROLE_SCRIPT",
    "SET_DRAINED_SCRIPT",
    "RESTORE_REGISTRY_SCRIPT",
    "FORGET_WORKER_SCRIPT",
    "REGISTRY_AND_USAGE_SCRIPT",
    "PUT_TENANT_KEY_SCRIPT",
    "REVOKE_TENANT_KEY_SCRIPT",
    "READ_TENANT_KEYS_SCRIPT",
    "RESTORE_TENANT_KEYS_SCRIPT",
    "PUBLISH_DEMAND_SCRIPT",
    "READ_DEMANDS_SCRIPT",
]

# Keep the marker alive; create it with this caller's fresh token when missing. With it, publish
# the caller's longest gap between renewal rounds `own` (state/holdback.py): the store keeps the
# longest any replica published, for the marker's TTL; where the marker was missing (the store
# lost its data, or first use) the caller's remembered longest `carried` starts it again.
# Returns {the marker found (another caller's token, or ours from before), false when missing;
# the longest round published (a string: '0' for none)}. The caller compares the marker with the
# value it saw last: a different one means another replica found it missing since, i.e. the
# store lost its data. Re-creating it is a registry change (`fkey`, the feed): every quiet
# replica then reads the new token at once and learns of the loss.
_LUA_MARKER = (
    LUA_FEED
    + """
local function marker(key, token, ttl, rkey, own, carried, fkey)
  local v = redis.call('GET', key)
  local pub, pubs = tonumber(own), own
  if v then
    redis.call('EXPIRE', key, ttl)
  else
    redis.call('SET', key, token, 'EX', ttl)
    feed(fkey)
    if tonumber(carried) > pub then pub, pubs = tonumber(carried), carried end
  end
  local cur = redis.call('GET', rkey)
  if pub > 0 and (not cur or pub >= tonumber(cur)) then
    redis.call('SET', rkey, pubs, 'EX', ttl)
    cur = pubs
  end
  return {v, cur or '0'}
end
"""
)

# KEYS[1] {reg}:marker  KEYS[2] {reg}:renewal  KEYS[3] {reg}:feed
# ARGV[1] token  ARGV[2] TTL (s)  ARGV[3] own longest round (s)  ARGV[4] remembered longest (s)
MARKER_SCRIPT = (
    _LUA_MARKER + "return marker(KEYS[1], ARGV[1], ARGV[2], KEYS[2], ARGV[3], ARGV[4], KEYS[3])\n"
)

# A worker's registration, written (and fed) only when it differs from the store's: a put-back
# of what the store already holds wakes no replica.
# KEYS[1] {reg}:workers  KEYS[2] {reg}:feed  ARGV[1] worker id  ARGV[2] registration (JSON)
REGISTER_WORKER_SCRIPT = (
    LUA_FEED
    + """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
feed(KEYS[2])
return 1
"""
)

# A `both` worker's role record dropped. KEYS[1] {reg}:roles  KEYS[2] {reg}:feed
# ARGV[1] worker id. Returns 1 if it had one.
FORGET_ROLE_SCRIPT = (
    LUA_FEED
    + """
local was = redis.call('HDEL', KEYS[1], ARGV[1])
if was == 1 then feed(KEYS[2]) end
return was
"""
)

# Drain or undrain a worker, recording when (only on a change).
# KEYS[1] {reg}:drained  KEYS[2] {reg}:drained_at  KEYS[3] {reg}:feed
# ARGV[1] now ('' = the server's clock)  ARGV[2] worker id  ARGV[3] '1' drain | '0' undrain
# Returns 1 if that changed it, else 0.
SET_DRAINED_SCRIPT = (
    _LUA_CLOCK
    + LUA_FEED
    + """
local changed
if ARGV[3] == '1' then
  changed = redis.call('SADD', KEYS[1], ARGV[2])
else
  changed = redis.call('SREM', KEYS[1], ARGV[2])
end
if changed == 1 then
  redis.call('HSET', KEYS[2], ARGV[2], score(clock()))
  feed(KEYS[3])
end
return changed
"""
)

# A replica's last-known drain marks and roles, put back after a loss where they are fresher
# than what the store has: a mark with a later time than the store's (or where it has none),
# a role with a higher version (or where it has none). Equal: the store's stays.
# KEYS[1] {reg}:drained  KEYS[2] {reg}:drained_at  KEYS[3] {reg}:roles  KEYS[4] {reg}:feed
# ARGV[1] n marks, then n x (worker id, '1'|'0', since), then (worker id, "role|version|since")
# pairs to the end.
RESTORE_REGISTRY_SCRIPT = (
    LUA_FEED
    + """
local changed = false
local function version(rec) return tonumber(string.match(rec, '^[^|]*|(%d+)|')) end
local n = tonumber(ARGV[1])
local i = 2
for _ = 1, n do
  local wid, drained, since = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  local cur = redis.call('HGET', KEYS[2], wid)
  if not cur or tonumber(cur) < tonumber(since) then
    if drained == '1' then
      redis.call('SADD', KEYS[1], wid)
    else
      redis.call('SREM', KEYS[1], wid)
    end
    redis.call('HSET', KEYS[2], wid, since)
    changed = true
  end
end
while i < #ARGV do
  local wid, rec = ARGV[i], ARGV[i + 1]
  i = i + 2
  local cur = redis.call('HGET', KEYS[3], wid)
  if not cur or version(cur) < version(rec) then
    redis.call('HSET', KEYS[3], wid, rec)
    changed = true
  end
end
if changed then feed(KEYS[4]) end
return 1
"""
)

# A worker's fields in the registry: its registration, drained mark and its time, its role.
# KEYS[1] {reg}:workers  KEYS[2] {reg}:drained  KEYS[3] {reg}:drained_at  KEYS[4] {reg}:roles
# KEYS[5] {reg}:feed  ARGV[1] worker id. Returns 1 if it was registered.
FORGET_WORKER_SCRIPT = (
    LUA_FEED
    + """
local was = redis.call('HDEL', KEYS[1], ARGV[1])
local gone = redis.call('SREM', KEYS[2], ARGV[1]) + redis.call('HDEL', KEYS[3], ARGV[1])
  + redis.call('HDEL', KEYS[4], ARGV[1])
if was + gone > 0 then feed(KEYS[5]) end
return was
"""
)

# What `registry_view` and `usage_view` read, in one script: a quiet replica's one round trip a
# beat (router/workers/registry.py takes the state refresher's read along). One server only: the
# keys are of several hash tags. The usage of each decode worker is `USAGE_SCRIPT` itself, run as
# a function whose parameters shadow KEYS and ARGV, so its rule (drop expired leases, then read)
# lives in one place.
# KEYS[1..5] {reg}: marker, workers, drained, drained_at, roles; KEYS[6] {reg}:tkeys:version;
# KEYS[7] {reg}:renewal; KEYS[8] {reg}:feed; then 4 keys per decode worker (in
# `Keys.decode_worker` order), then one ledger sum per prefill worker.
# ARGV[1] now ('' = the server's clock)  ARGV[2] marker token  ARGV[3] marker TTL (s)
# ARGV[4] n decode workers  ARGV[5] own longest renewal round (s)  ARGV[6] remembered longest (s)
# Returns {marker as MARKER_SCRIPT returns it, workers (flat HGETALL), drained members, drained_at
# (flat), roles (flat), {{capacity, reserved, live reservations} per decode worker}, {sum or
# false per prefill worker}, the tenant keys' version or false}.
REGISTRY_AND_USAGE_SCRIPT = (
    _LUA_MARKER
    + "local function usage_of(KEYS, ARGV)\n"
    + USAGE_SCRIPT
    + """end
local found = marker(KEYS[1], ARGV[2], ARGV[3], KEYS[7], ARGV[5], ARGV[6], KEYS[8])
local n = tonumber(ARGV[4])
local usage = {}
for i = 0, n - 1 do
  local k = 9 + 4 * i
  usage[i + 1] = usage_of({KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]}, {ARGV[1]})
end
local sums = {}
for k = 9 + 4 * n, #KEYS do
  sums[#sums + 1] = redis.call('GET', KEYS[k])
end
return {found, redis.call('HGETALL', KEYS[2]), redis.call('SMEMBERS', KEYS[3]),
        redis.call('HGETALL', KEYS[4]), redis.call('HGETALL', KEYS[5]), usage, sums,
        redis.call('GET', KEYS[6])}
"""
)

# -- the tenants' API keys (router/tenants.py) ----------------------------------------------
# Every script takes the same three keys, all under {reg}:
# KEYS[1] {reg}:tkeys (id -> "tenant|digest|source")  KEYS[2] {reg}:tkeys:revoked (digests)
# KEYS[3] {reg}:tkeys:version; the scripts that change the table take KEYS[4] {reg}:feed
_LUA_DIGEST = (
    LUA_FEED
    + """
local function digest(rec) return string.match(rec, '^[^|]*|([^|]*)|') end
"""
)

# Set a key id to a new key, revoking what it held before (a rotation) and ARGV[4] (a rotated
# configured key's digest, which the table does not hold).
# ARGV[1] key id  ARGV[2] record "tenant|digest|source"  ARGV[3] its digest  ARGV[4] digest or ''
# Returns the new version; 0 when ARGV[3] is revoked (nothing written).
PUT_TENANT_KEY_SCRIPT = (
    _LUA_DIGEST
    + """
if redis.call('SISMEMBER', KEYS[2], ARGV[3]) == 1 then return 0 end
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and digest(cur) ~= ARGV[3] then redis.call('SADD', KEYS[2], digest(cur)) end
if ARGV[4] ~= '' and ARGV[4] ~= ARGV[3] then redis.call('SADD', KEYS[2], ARGV[4]) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
feed(KEYS[4])
return redis.call('INCR', KEYS[3])
"""
)

# Revoke the key an id holds, and ARGV[2] (a configured key's digest), and drop the id.
# ARGV[1] key id  ARGV[2] digest or ''. Returns the new version.
REVOKE_TENANT_KEY_SCRIPT = (
    _LUA_DIGEST
    + """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  redis.call('SADD', KEYS[2], digest(cur))
  redis.call('HDEL', KEYS[1], ARGV[1])
end
if ARGV[2] ~= '' then redis.call('SADD', KEYS[2], ARGV[2]) end
feed(KEYS[4])
return redis.call('INCR', KEYS[3])
"""
)

# The table as one snapshot. No ARGV. Returns {version or false, table (flat), revoked digests}.
READ_TENANT_KEYS_SCRIPT = """
return {redis.call('GET', KEYS[3]), redis.call('HGETALL', KEYS[1]), redis.call('SMEMBERS', KEYS[2])}
"""

# A replica's last-known table, put back after a loss: the union of every replica's, revocations
# first (a key revoked anywhere stays revoked, and an id holding a revoked digest is dropped), then
# each key whose id is free and whose digest is not revoked. If that changed anything the version
# becomes max(the store's, ARGV[1]) + 1 (so every replica reads the table again).
# ARGV[1] the replica's known version  ARGV[2] n revoked digests, then the n digests, then
# (key id, record, digest) triples to the end. Returns the version.
RESTORE_TENANT_KEYS_SCRIPT = (
    _LUA_DIGEST
    + """
local changed = 0
local n = tonumber(ARGV[2])
for i = 3, 2 + n do changed = changed + redis.call('SADD', KEYS[2], ARGV[i]) end
local table_ = redis.call('HGETALL', KEYS[1])
for j = 1, #table_, 2 do
  if redis.call('SISMEMBER', KEYS[2], digest(table_[j + 1])) == 1 then
    changed = changed + redis.call('HDEL', KEYS[1], table_[j])
  end
end
local i = 3 + n
while i + 2 <= #ARGV do
  local id, rec, d = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  if redis.call('SISMEMBER', KEYS[2], d) == 0 then
    changed = changed + redis.call('HSETNX', KEYS[1], id, rec)
  end
end
local version = tonumber(redis.call('GET', KEYS[3]) or '0')
if changed > 0 then
  version = math.max(version, tonumber(ARGV[1])) + 1
  redis.call('SET', KEYS[3], version)
  feed(KEYS[4])
end
return version
"""
)


# Every replica's demand for the role manager (router/workers/role_signals.py): one field per
# replica, "when|payload" (the payload is the router's, opaque here); entries older than
# `max age` are dropped by both scripts, so a replica that stopped publishing goes away.
_LUA_DEMAND_PRUNE = """
local function prune(now, max_age)
  local fresh = {}
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    local at, payload = string.match(all[i + 1], '^([^|]*)|(.*)$')
    if at == nil or now - tonumber(at) > max_age then
      redis.call('HDEL', KEYS[1], all[i])
    else
      table.insert(fresh, all[i]); table.insert(fresh, payload)
    end
  end
  return fresh
end
"""

# KEYS[1] {reg}:demand  ARGV[1] now  ARGV[2] replica  ARGV[3] payload  ARGV[4] max age (s)
PUBLISH_DEMAND_SCRIPT = (
    _LUA_CLOCK
    + _LUA_DEMAND_PRUNE
    + """
local now = clock()
redis.call('HSET', KEYS[1], ARGV[2], score(now) .. '|' .. ARGV[3])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[4]) * 2000))
return 1
"""
)

# KEYS[1] {reg}:demand  ARGV[1] now  ARGV[2] max age (s) -> flat (replica, payload) pairs
READ_DEMANDS_SCRIPT = (
    _LUA_CLOCK
    + _LUA_DEMAND_PRUNE
    + """
return prune(clock(), tonumber(ARGV[2]))
"""
)
