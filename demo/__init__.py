"""Demos and fixtures, outside the library: the whole pipeline on a tiny local model (`python -m demo`), GRPO on
SmolLM2-135M-Instruct (`python -m demo.smollm2`), and the tiny models (`demo.tiny`) and synthetic task data
(`demo.synthetic`) that the demos, the tests and the benchmarks build locally (no hub access)."""
