"""ragcache.api: the REST API (native /v1/documents and /v1/query, OpenAI-compatible /v1/chat/completions).

create_app(rc, settings) in app.py builds the FastAPI app around one engine; server.run(settings) serves it."""
