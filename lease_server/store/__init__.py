"""The Redis core: key names, the Lua scripts and their wrappers, the engine that runs them, the data layout."""
