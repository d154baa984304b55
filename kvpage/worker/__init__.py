"""The worker: physical KV tensors, input building, the model runner. Uses models/ and attention/."""
