"""The front-end: the offline LLM, the asyncio AsyncEngine, and the transports to the core (a thread or a child process)."""
