"""Tenants (issue 29): API keys stored hashed in Redis, their rate limits enforced atomically by
Lua scripts shared by every gateway process, and usage counted per tenant and key by the worker
that learns a task's final usage (docs/gateway.md, Tenants and API keys)."""
