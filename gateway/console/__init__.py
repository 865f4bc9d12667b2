"""The web console: server-rendered page shells whose scripts call the gateway's own API."""
