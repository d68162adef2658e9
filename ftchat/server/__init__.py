"""`ftchat serve`: an OpenAI-compatible HTTP server over one engine thread.

protocol.py reads requests and shapes errors, prompt.py renders messages with the chat template,
reasoning.py and tool_calls.py split the reply text, worker.py owns torch (one thread, a FIFO
queue), prefix_cache.py keeps state checkpoints, metrics.py counts, app.py routes, serve.py
starts it all.
"""
