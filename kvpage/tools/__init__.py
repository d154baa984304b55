"""Command-line tools: the KV memory estimator and the block-size advisor (plain arithmetic, no
model, no torch), the model-free scheduler simulation (`python -m kvpage.tools.scheduler_sim`, no
torch), and the throughput benchmark (`kvpage bench`, which drives an engine it is given)."""
