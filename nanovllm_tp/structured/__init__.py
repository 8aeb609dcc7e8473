"""Structured outputs: what a request asks for (params.py, light: the HTTP process imports it) and the grammar
backend that compiles it and keeps one matcher per sequence on rank 0 (backend.py, llguidance). The server's
tools build their constraints on it (serving/tool_calls.py)."""
