"""Tools shared by the tests, the benchmarks and the demo (tiny random models, the offline SmolLM2 model folders,
prompts, the set-acceptance benchmark switch); nothing in the engine or the plugin imports them."""
