"""Benchmarks users can run against any OpenAI-compatible server (`serval bench serve`) or the offline engine
(`serval bench throughput`). The serving benchmark is an HTTP client only: it imports nothing of the engine."""
