"""The Lua scripts behind quotas: each admission decision, settlement and lease renewal is
one atomic script, so limits hold exactly however many gateway replicas share the Redis.

Time comes from Redis (`TIME`), so replicas with skewed clocks still agree on windows and
leases. Every key a script touches is passed in KEYS and carries the tenant's hash tag
(`{tenant}`), so each script touches one hash slot: the rule for every multi-key script and
transaction here, should the gateway ever run on Redis Cluster (it does not today: see
gateway/README.md).

Windows are sliding logs (exact, unlike fixed windows that admit 2x at a boundary):
- requests: a sorted set of request ids scored by admission time (ms);
- tokens: a sorted set of `id|tokens` scored by admission time, plus a running total so a
  decision never sums the whole window; expired entries are subtracted as they leave.
In-flight requests are a sorted set of request ids scored by lease expiry (ms): a gateway
that dies without releasing its slots stops renewing them, and they expire.
"""

# KEYS: 1 quota hash, 2 request log, 3 token log, 4 token total, 5 in-flight leases, 6 daily
# ARGV: 1 request id, 2 tokens to reserve, 3 lease ms, 4 window ms, 5 daily key ttl s
# Returns: {admitted, reason, rpm, requests_used, request_reset_ms, tpm, tokens_used,
#           token_reset_ms, retry_ms, concurrency, running, daily, daily_used}
# (limits are -1 when unset; *_used are before this request; reason is "" when admitted)
ADMIT = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cfg = redis.call('HMGET', KEYS[1], 'rpm', 'tpm', 'concurrency', 'daily_tokens')
local rpm, tpm, conc, daily = tonumber(cfg[1]), tonumber(cfg[2]), tonumber(cfg[3]), tonumber(cfg[4])
local id, need = ARGV[1], tonumber(ARGV[2])
local lease, window = tonumber(ARGV[3]), tonumber(ARGV[4])
local cutoff = now - window

local req_used, req_reset, tok_used, tok_reset, running, spent = 0, 0, 0, 0, 0, 0
if rpm then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', cutoff)
  req_used = redis.call('ZCARD', KEYS[2])
end
if tpm then
  local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', cutoff)
  if #expired > 0 then
    local freed = 0
    for _, member in ipairs(expired) do
      freed = freed + tonumber(string.match(member, '|(%d+)$'))
    end
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', cutoff)
    redis.call('DECRBY', KEYS[4], freed)
  end
  tok_used = tonumber(redis.call('GET', KEYS[4]) or '0')
end
if conc then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
  running = redis.call('ZCARD', KEYS[5])
end
if daily then
  spent = tonumber(redis.call('GET', KEYS[6]) or '0')
end

-- When the request log frees enough slots for one more request (its `over`-th oldest leaves).
local function request_reset(over)
  local entry = redis.call('ZRANGE', KEYS[2], over, over, 'WITHSCORES')
  if #entry == 0 then return 0 end
  return math.max(0, tonumber(entry[2]) + window - now)
end
-- When enough reserved tokens leave the window for `want` more to fit (walks the log: only
-- on a token rejection); with want = 0, when the oldest reservation leaves.
local function token_reset(want)
  local entries = redis.call('ZRANGE', KEYS[3], 0, want > 0 and -1 or 0, 'WITHSCORES')
  local left = tok_used
  for i = 1, #entries, 2 do
    left = left - tonumber(string.match(entries[i], '|(%d+)$'))
    if want == 0 or left + want <= tpm then
      return math.max(0, tonumber(entries[i + 1]) + window - now)
    end
  end
  return window
end

local function answer(admitted, reason, retry)
  if rpm and req_reset == 0 then req_reset = request_reset(math.max(0, req_used - rpm)) end
  if tpm and tok_reset == 0 then tok_reset = token_reset(0) end
  return {admitted, reason, rpm or -1, req_used, req_reset, tpm or -1, tok_used, tok_reset,
          retry, conc or -1, running, daily or -1, spent}
end

if conc and running >= conc then return answer(0, 'concurrency', 1000) end
if rpm and req_used >= rpm then
  req_reset = request_reset(req_used - rpm)
  return answer(0, 'requests', req_reset)
end
if tpm and need > tpm then return answer(0, 'too_large', 0) end
if tpm and tok_used + need > tpm then
  tok_reset = token_reset(need)
  return answer(0, 'tokens', tok_reset)
end
if daily and spent + need > daily then
  return answer(0, 'daily', 86400000 - now % 86400000)
end

if rpm then
  redis.call('ZADD', KEYS[2], now, id)
  redis.call('PEXPIRE', KEYS[2], window)
end
if tpm then
  redis.call('ZADD', KEYS[3], now, id .. '|' .. need)
  redis.call('INCRBY', KEYS[4], need)
  redis.call('PEXPIRE', KEYS[3], window)
  redis.call('PEXPIRE', KEYS[4], window)
end
if conc then
  redis.call('ZADD', KEYS[5], now + lease, id)
  redis.call('PEXPIRE', KEYS[5], lease)
end
if daily then
  redis.call('INCRBY', KEYS[6], need)
  redis.call('EXPIRE', KEYS[6], tonumber(ARGV[5]))
end
return answer(1, '', 0)
"""

# KEYS: 1 token log, 2 token total, 3 in-flight leases, 4 daily, 5 usage hash
# ARGV: 1 request id, 2 reserved, 3 used, 4 1 if the daily budget was charged,
#       5 usage ttl s, then usage field / increment pairs
# The unused part of the reservation goes back to the token window (if the entry is still
# in it) and to the daily budget; the slot is released; usage is counted.
SETTLE = """
local id, reserved, used = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local refund = math.max(0, reserved - used)
local member = id .. '|' .. reserved
local score = redis.call('ZSCORE', KEYS[1], member)
if score then
  redis.call('ZREM', KEYS[1], member)
  if reserved - refund > 0 then
    redis.call('ZADD', KEYS[1], score, id .. '|' .. (reserved - refund))
  end
  redis.call('DECRBY', KEYS[2], refund)
end
if ARGV[4] == '1' and redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('DECRBY', KEYS[4], refund)
end
redis.call('ZREM', KEYS[3], id)
for i = 6, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[5], ARGV[i], ARGV[i + 1])
end
if #ARGV >= 6 then redis.call('EXPIRE', KEYS[5], tonumber(ARGV[5])) end
return refund
"""

# KEYS: 1 in-flight leases; ARGV: 1 request id, 2 lease ms. Extends a running request's lease;
# returns 0 (and changes nothing) when the lease is gone: settled (SETTLE removed it) or expired.
# A renewal still on its way when the request settles must not bring the slot back to life.
RENEW = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not expiry or tonumber(expiry) < now then return 0 end
local lease = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[1])
redis.call('PEXPIRE', KEYS[1], lease)
return 1
"""

# KEYS: 1 request log, 2 token log, 3 token total, 4 in-flight leases, 5 daily; ARGV: 1 window ms.
# Returns {requests_used, tokens_used, running, daily_used} as ADMIT would count them now, and
# changes nothing (expired entries are left for ADMIT to remove). A count is meaningful only
# while its limit is set: ADMIT keeps no log for a limit the tenant does not have.
PEEK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - tonumber(ARGV[1])
local requests = redis.call('ZCOUNT', KEYS[1], '(' .. cutoff, '+inf')
local tokens = tonumber(redis.call('GET', KEYS[3]) or '0')
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', cutoff)) do
  tokens = tokens - tonumber(string.match(member, '|(%d+)$'))
end
local running = redis.call('ZCOUNT', KEYS[4], '(' .. now, '+inf')
local daily = tonumber(redis.call('GET', KEYS[5]) or '0')
return {requests, tokens, running, daily}
"""
