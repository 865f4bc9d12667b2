"""switchboard."""
