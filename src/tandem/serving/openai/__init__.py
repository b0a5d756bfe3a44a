"""The OpenAI-compatible HTTP front end: the API server, its request models, chat templates,
tool calls and `response_format`, streaming and the request fan-out."""
