"""The gateway's Prometheus metrics, all named `switchboard_…`, served at /metrics."""

from __future__ import annotations

from prometheus_client import Counter

QUOTA_REJECTIONS = Counter(
    "switchboard_quota_rejections_total",
    "Requests refused by a quota (429), by tenant and the limit that refused them.",
    ["tenant", "reason"],
)
QUOTA_REDIS_ERRORS = Counter(
    "switchboard_quota_redis_errors_total",
    "Quota operations that failed on Redis, by what happened to the request.",
    ["outcome"],
)
