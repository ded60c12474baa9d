"""Tooling shared by the benchmarks and the tests; nothing in the engine or the plugin imports it."""
