"""What users call: the LLM class (llm.py) and the prompt-shape rules it shares with the server (prompts.py).
The OpenAI server is serving/; the commands are launch/."""
