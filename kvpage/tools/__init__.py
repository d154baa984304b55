"""Command-line tools that need no engine: the KV memory estimator and the block-size advisor."""
