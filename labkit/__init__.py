"""labkit: a small, real LLM serving engine to learn PagedAttention and continuous batching from."""

__version__ = "0.1.0"
