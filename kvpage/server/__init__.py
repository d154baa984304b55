"""The OpenAI-compatible HTTP server: FastAPI app, the background engine loop, Prometheus metrics."""
