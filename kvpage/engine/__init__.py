"""The engine: LLMEngine (add_request / step / abort), LLM (offline API), beam search."""
