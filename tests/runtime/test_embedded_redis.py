"""The embedded redis-server really serves, and stops cleanly."""

import redis

from runtime.embedded_redis import EmbeddedRedis


def test_embedded_redis_serves_and_stops():
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        assert client.get("k") == b"v"
        port = server.port
    try:
        redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.3).ping()
        raise AssertionError("redis-server still answers after stop()")
    except redis.ConnectionError:
        pass


def test_redis_url_fixture_answers(redis_url, redis_prefix):
    client = redis.Redis.from_url(redis_url)
    client.set(redis_prefix + "x", 1, ex=10)
    assert client.get(redis_prefix + "x") == b"1"
