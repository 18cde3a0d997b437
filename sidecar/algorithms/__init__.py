"""Rate limiting algorithms: pure step functions, each mirrored by a Lua script in `lua/`."""
