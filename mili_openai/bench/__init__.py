"""`mili bench serve`: a streaming load generator for any OpenAI-compatible server (see cli.py)."""
