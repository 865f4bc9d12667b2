"""The Lua scripts behind adapter uploads: naming a blob and the tenant's upload slots.

`REGISTER` is the one atomic step that reserves a tenant's adapter name, checks the tenant's
storage quota and references the blob, so two uploads of one name cannot both win and a
losing upload never touches the winner's reference. Storage use is computed from the
tenant's own records (at most `max_adapters` of them), so no counter can drift from the
names. Upload slots are a sorted set of upload ids scored by lease expiry (ms), like the
request concurrency leases: a gateway that dies stops renewing, and its slots come back.
Time comes from Redis (`TIME`), so replicas with skewed clocks agree on leases.
"""

# KEYS: 1 the tenant's names hash, 2 the blob's reference set, 3 the tenant's quota hash,
#       4 the reference set of the blob the name held when the caller looked (replace only)
# ARGV: 1 name, 2 record JSON, 3 reference member, 4 adapter id, 5 the blob's float32 bytes,
#       6 default max adapters, 7 default max adapter bytes, 8 "1" to replace other content,
#       9 the adapter id the caller saw under the name ("" for none), 10 the version it saw
# Replacing swaps the name's record and references in this one step: the old content's bytes
# leave the storage in use as the new content's enter it.
# Returns: {"created", record} | {"same", existing record} | {"taken", existing record}
#          | {"replaced", record, references left on the old blob} | {"moved"} (the name
#          changed since the caller looked: look again)
#          | {"max_adapters", used, limit} | {"max_adapter_bytes", used, limit}
REGISTER = """
local existing = redis.call('HGET', KEYS[1], ARGV[1])
local old = nil
if existing then
  old = cjson.decode(existing)
  if old['adapter_id'] == ARGV[4] then return {'same', existing} end
  if ARGV[8] ~= '1' then return {'taken', existing} end
  if old['adapter_id'] ~= ARGV[9] then return {'moved'} end
  if (tonumber(old['version']) or 0) ~= tonumber(ARGV[10]) then return {'moved'} end
elseif ARGV[9] ~= '' then
  return {'moved'}
end
local cfg = redis.call('HMGET', KEYS[3], 'max_adapters', 'max_adapter_bytes')
local max_count = tonumber(cfg[1]) or tonumber(ARGV[6])
local max_bytes = tonumber(cfg[2]) or tonumber(ARGV[7])
local count = redis.call('HLEN', KEYS[1])
if not old and count + 1 > max_count then return {'max_adapters', count, max_count} end
local used = 0
for _, raw in ipairs(redis.call('HVALS', KEYS[1])) do
  used = used + (tonumber(cjson.decode(raw)['num_bytes']) or 0)
end
if old then used = used - (tonumber(old['num_bytes']) or 0) end
if used + tonumber(ARGV[5]) > max_bytes then return {'max_adapter_bytes', used, max_bytes} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
if old then
  redis.call('SREM', KEYS[4], ARGV[3])
  return {'replaced', ARGV[2], redis.call('SCARD', KEYS[4])}
end
return {'created', ARGV[2]}
"""

# KEYS: 1 the tenant's names hash, 2 the blob's reference set
# ARGV: 1 name, 2 the adapter id expected under it, 3 reference member
# Deletes the name only if it still names that blob, and its reference with it (compared by
# id, so records written by older versions, with fewer fields, delete too).
# Returns: -1 if the name changed or went, else the references left on the blob.
UNREGISTER = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current or cjson.decode(current)['adapter_id'] ~= ARGV[2] then return -1 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[2], ARGV[3])
return redis.call('SCARD', KEYS[2])
"""

# KEYS: 1 the tenant's upload leases; ARGV: 1 upload id, 2 lease ms, 3 max concurrent
# Returns: {1, running} when the slot is taken, {0, running} when the tenant is at its cap.
ACQUIRE_UPLOAD = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local running = redis.call('ZCARD', KEYS[1])
if running >= tonumber(ARGV[3]) then return {0, running} end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return {1, running}
"""

# KEYS: 1 the tenant's upload leases; ARGV: 1 upload id, 2 lease ms.
# Extends a live lease only (XX, and not once expired): a released slot stays released.
RENEW_UPLOAD = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) <= now then return 0 end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""
