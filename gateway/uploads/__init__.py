"""Tenants' adapter uploads: the body staged, validated in a child process, stored by content
and named in the tenant's catalog."""
