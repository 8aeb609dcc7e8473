"""Structured outputs: what a request asks for (params.py, light: the HTTP process imports it), the grammar
backend that compiles it and keeps one matcher per sequence on rank 0 (backend.py, llguidance), and the schema
tools and tool calls make (tools.py)."""
