"""ftchat: local chat and greedy decode of Qwen3.8-Flash-Next with offloaded experts."""

__version__ = "0.1.0"
