"""Tools for tests, benchmarks and the demo (tiny random models, the offline SmolLM2 model folders); the engine never imports them."""
