"""The Lua scripts of the worker registry (state/redis_registry.py): the store-loss marker, drain
marks, a replica's put-back after a loss, and forgetting a worker.

Every script here touches the registry's keys only (hash tag ``{reg}``), so each runs on one
Redis Cluster slot. The role and lease scripts, older, stay in state/redis_scripts.py.
"""

from __future__ import annotations

from state.redis_scripts import _LUA_CLOCK

__all__ = [
    "MARKER_SCRIPT",
    "SET_DRAINED_SCRIPT",
    "RESTORE_REGISTRY_SCRIPT",
    "FORGET_WORKER_SCRIPT",
]

# Keep the marker alive; create it with this caller's fresh token when missing.
# KEYS[1] {reg}:marker  ARGV[1] token  ARGV[2] TTL (s)
# Returns the value found (another caller's token, or ours from before), false when missing.
# The caller compares it with the value it saw last: a different one means another replica
# found the marker missing since, i.e. the store lost its data.
MARKER_SCRIPT = """
local v = redis.call('GET', KEYS[1])
if v then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return v
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return false
"""

# Drain or undrain a worker, recording when (only on a change).
# KEYS[1] {reg}:drained  KEYS[2] {reg}:drained_at
# ARGV[1] now ('' = the server's clock)  ARGV[2] worker id  ARGV[3] '1' drain | '0' undrain
# Returns 1 if that changed it, else 0.
SET_DRAINED_SCRIPT = (
    _LUA_CLOCK
    + """
local changed
if ARGV[3] == '1' then
  changed = redis.call('SADD', KEYS[1], ARGV[2])
else
  changed = redis.call('SREM', KEYS[1], ARGV[2])
end
if changed == 1 then redis.call('HSET', KEYS[2], ARGV[2], score(clock())) end
return changed
"""
)

# A replica's last-known drain marks and roles, put back after a loss where they are fresher
# than what the store has: a mark with a later time than the store's (or where it has none),
# a role with a higher version (or where it has none). Equal: the store's stays.
# KEYS[1] {reg}:drained  KEYS[2] {reg}:drained_at  KEYS[3] {reg}:roles
# ARGV[1] n marks, then n x (worker id, '1'|'0', since), then (worker id, "role|version|since")
# pairs to the end.
RESTORE_REGISTRY_SCRIPT = """
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
  end
end
while i < #ARGV do
  local wid, rec = ARGV[i], ARGV[i + 1]
  i = i + 2
  local cur = redis.call('HGET', KEYS[3], wid)
  if not cur or version(cur) < version(rec) then redis.call('HSET', KEYS[3], wid, rec) end
end
return 1
"""

# A worker's fields in the registry: its registration, drained mark and its time, its role.
# KEYS[1] {reg}:workers  KEYS[2] {reg}:drained  KEYS[3] {reg}:drained_at  KEYS[4] {reg}:roles
# ARGV[1] worker id. Returns 1 if it was registered.
FORGET_WORKER_SCRIPT = """
local was = redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
return was
"""
